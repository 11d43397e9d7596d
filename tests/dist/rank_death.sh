#!/usr/bin/env bash
# A worker rank that dies mid-run ends the whole job with a message naming it, instead of leaving
# rank 0 waiting in its next all-reduce: `mpirun -np 2 moat generate --tp 2` with a long
# generation, rank 1 killed (SIGKILL) once it is stepping; mpirun must exit non-zero within 30 s and
# say which rank died.
# Usage: tests/dist/rank_death.sh [BUILD_DIR]
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
moat=${1:-$root/build}/moat
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
log=$(mktemp "${TMPDIR:-/tmp}/moat-rank-death.XXXXXX")
mpirun --oversubscribe -np 2 "$moat" generate --prompt "The meaning of life is" --max-tokens 150000 --ignore-eos \
  --max-context 160000 --tp 2 --threads 1 >/dev/null 2>"$log" &
pid=$!
worker=""
for _ in $(seq 1 300); do  # up to 30 s for the ranks to start
  for child in $(pgrep -P "$pid"); do
    tr '\0' '\n' < "/proc/$child/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=1' && worker=$child
  done
  [ -n "$worker" ] && break
  sleep 0.1
done
[ -n "$worker" ] || { echo "FAIL: no rank-1 process under mpirun"; kill -9 "$pid"; exit 1; }
sleep 2  # loaded and stepping (k3-nano loads in well under a second)
kill -0 "$pid" 2>/dev/null || { echo "FAIL: the job ended before rank 1 was killed"; cat "$log"; exit 1; }
kill -9 "$worker"
for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$pid" 2>/dev/null; then
  echo "FAIL: the job still runs 30 s after rank 1 died"; kill -9 "$pid"; pkill -9 -P "$pid"; exit 1
fi
wait "$pid"; rc=$?
[ "$rc" != 0 ] || { echo "FAIL: mpirun exited 0 after a rank died"; exit 1; }
grep -q "rank 1" "$log" || { echo "FAIL: the message does not name rank 1:"; cat "$log"; exit 1; }
rm -f "$log"
echo "PASS: rank 1's death ended the job (mpirun exit $rc) with a message naming it"
