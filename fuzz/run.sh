#!/usr/bin/env bash
# Builds moat's libFuzzer targets (clang, ASan + UBSan) in build-fuzz/ and runs each for a fixed
# number of executions over seeds made from the real files in tests/, models/ and
# ../shared/testdata (fuzz/make_seeds.py reads them in place; nothing is copied into the repo).
#
#   fuzz/run.sh [-n RUNS] [-t SECONDS] [-j PARALLEL] [TARGET...]
#
# RUNS: executions per target (default 1000000); SECONDS: wall-clock cap per target (default
# 480; whichever comes first ends it); PARALLEL: targets run at once (default 1). Targets
# (default all): safetensors shard_index config tokenizer_json tiktoken tokenizer_encode
# chat_template request. A crash, hang (> 10 s per input), leak or sanitizer report stops the target and
# leaves the input in build-fuzz/artifacts/; rerun one with build-fuzz/fuzz_TARGET FILE.
# The summary (executions, result) is build-fuzz/summary.txt; logs are build-fuzz/logs/.
# Debian 12 packages: clang libclang-rt-14-dev (tools/setup-debian.sh does not install them).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=1000000
seconds=480
parallel=1
while getopts "n:t:j:" opt; do
  case $opt in
    n) runs=$OPTARG ;;
    t) seconds=$OPTARG ;;
    j) parallel=$OPTARG ;;
    *) sed -n 2,16p "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(safetensors shard_index config tokenizer_json tiktoken tokenizer_encode chat_template request)

out=build-fuzz
CXX=${CXX:-clang++} cmake -S fuzz -B "$out" -DCMAKE_BUILD_TYPE=RelWithDebInfo > /dev/null
cmake --build "$out" -j"$(nproc)" --target $(printf 'fuzz_%s ' "${targets[@]}") > "$out/build.log" || {
  tail -30 "$out/build.log"; exit 1; }
rm -rf "$out/seeds"
python3 fuzz/make_seeds.py . "$out/seeds"
mkdir -p "$out/corpus" "$out/artifacts" "$out/logs"

declare -A max_len=([safetensors]=16384 [shard_index]=32768 [config]=4096 [tokenizer_json]=65536
                    [tiktoken]=16384 [tokenizer_encode]=2048 [chat_template]=16384 [request]=8192)
declare -A dict=([safetensors]=json [shard_index]=json [config]=json [tokenizer_json]=json
                 [tiktoken]=json [chat_template]=jinja [tokenizer_encode]= [request]=json)

run_one() {
  local t=$1
  mkdir -p "$out/corpus/$t" "$out/seeds/$t"
  local args=(-runs="$runs" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2560 -malloc_limit_mb=1024
              -max_len="${max_len[$t]}" -print_final_stats=1 -artifact_prefix="$out/artifacts/$t-")
  [ -n "${dict[$t]}" ] && args+=(-dict="fuzz/${dict[$t]}.dict")
  local start=$SECONDS rc=0
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    "$out/fuzz_$t" "${args[@]}" "$out/corpus/$t" "$out/seeds/$t" > "$out/logs/$t.log" 2>&1 || rc=$?
  local execs
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$out/logs/$t.log" | grep -o '[0-9]*$' || true)
  [ -n "$execs" ] || execs=$(grep -o '^#[0-9]*' "$out/logs/$t.log" | tail -1 | tr -d '#')
  local result=clean
  [ $rc -eq 0 ] || result="FAILED (rc $rc): $(grep -m1 -E 'ERROR|SUMMARY|runtime error|Test unit written' "$out/logs/$t.log" || echo see log)"
  printf '%-18s %10s executions %5ss  %s\n' "$t" "${execs:-?}" $((SECONDS - start)) "$result" | tee -a "$out/summary.txt"
  [ $rc -eq 0 ]
}

echo "# $(date -u +%FT%TZ) runs=$runs seconds=$seconds" >> "$out/summary.txt"
failed=0
if [ "$parallel" -le 1 ]; then
  for t in "${targets[@]}"; do run_one "$t" || failed=1; done
else
  pids=()
  for t in "${targets[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$parallel" ]; do wait -n || failed=1; done
    run_one "$t" &
  done
  while [ "$(jobs -rp | wc -l)" -gt 0 ]; do wait -n || failed=1; done
fi
exit $failed
