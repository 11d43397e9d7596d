#!/usr/bin/env bash
# `mpirun -np 2 moat generate --tp 2` prints the same greedy text as `moat generate` (--tp 1), and a
# --tp that disagrees with mpirun's process count is refused with both numbers.
# Usage: tests/dist/generate_tp.sh [BUILD_DIR]
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
moat=${1:-$root/build}/moat
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
args=(generate --prompt "The meaning of life is" --temperature 0 --max-tokens 40 --threads 1)
one=$("$moat" "${args[@]}" 2>/dev/null) || { echo "FAIL: moat generate (tp 1) failed"; exit 1; }
two=$(mpirun --oversubscribe -np 2 "$moat" "${args[@]}" --tp 2 2>/dev/null) || { echo "FAIL: mpirun -np 2 moat generate --tp 2 failed"; exit 1; }
if [ "$one" != "$two" ]; then
  echo "FAIL: --tp 2 generated different text"; echo "--- tp 1:"; echo "$one"; echo "--- tp 2:"; echo "$two"; exit 1
fi
[ -n "$one" ] || { echo "FAIL: no text generated"; exit 1; }
err=$(mpirun --oversubscribe -np 2 "$moat" "${args[@]}" --tp 4 2>&1) && { echo "FAIL: --tp 4 under -np 2 was accepted"; exit 1; }
grep -q -- "--tp 4 but mpirun started 2 processes" <<<"$err" || { echo "FAIL: unclear refusal: $err"; exit 1; }
echo "PASS: --tp 2 generates the --tp 1 text"
