#!/usr/bin/env bash
# HTTP overhead of `moat serve`: the same closed-loop workload (random prompts of exactly
# INPUT_LEN tokens, OUTPUT_LEN greedy output tokens with ignore_eos, PROMPTS_PER_STREAM requests
# per stream) run through the engine core alone (bench/engine_bench) and through `moat serve` +
# `moat bench` (bench/serve_bench.sh), alternating, REPS times per concurrency. This VM's memory
# bandwidth drifts by 20-30% over minutes, so two sweeps run minutes apart (the serving tables)
# cannot resolve a few percent; each pair here runs back to back and its ratio is what counts.
# Prints a markdown table: one row per concurrency, output tok/s of each rep and the median ratio.
#   bench/http_overhead.sh                              (concurrency 1 and 64, 3 reps: ~20 minutes)
#   CONCURRENCY=1 REPS=1 OUTPUT_LEN=16 bench/http_overhead.sh   (a smoke run)
# Environment: BUILD_DIR (build), MODEL (checkpoints/bench), CONCURRENCY (1,64), REPS (3), THREADS (2),
# INPUT_LEN (128), OUTPUT_LEN (64), PROMPTS_PER_STREAM (2).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
MODEL=${MODEL:-checkpoints/bench}
CONCURRENCY=${CONCURRENCY:-1,64}
REPS=${REPS:-3}
THREADS=${THREADS:-2}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-64}
PROMPTS_PER_STREAM=${PROMPTS_PER_STREAM:-2}
cmake --build "$BUILD_DIR" --target moat engine_bench -j2 >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for c in ${CONCURRENCY//,/ }; do
  for rep in $(seq 1 "$REPS"); do
    "$BUILD_DIR/engine_bench" --model "$MODEL" --threads "$THREADS" --concurrency "$c" --prompt-tokens "$INPUT_LEN" \
      --output-tokens "$OUTPUT_LEN" --requests-per-stream "$PROMPTS_PER_STREAM" --markdown >"$work/engine.$c.$rep.md"
    BUILD_DIR="$BUILD_DIR" MODEL="$MODEL" CONCURRENCY="$c" INPUT_LEN="$INPUT_LEN" OUTPUT_LEN="$OUTPUT_LEN" \
      PROMPTS_PER_STREAM="$PROMPTS_PER_STREAM" OUT_DIR="$work/serve.$c.$rep" SERVE_ARGS="--threads $THREADS" \
      bench/serve_bench.sh >/dev/null 2>"$work/serve.$c.$rep.log" ||
      { echo "bench/serve_bench.sh failed:" >&2; tail -n 20 "$work/serve.$c.$rep.log" >&2; exit 1; }
  done
done

python3 - "$work" "$CONCURRENCY" "$REPS" <<'PY'
import json, statistics, sys
work, levels, reps = sys.argv[1], [int(c) for c in sys.argv[2].split(",")], int(sys.argv[3])
def engine_tps(path):
    for line in open(path):
        f = [x.strip() for x in line.split("|")]
        if len(f) > 6 and f[3].isdigit():
            return float(f[5])
    raise SystemExit(f"no engine_bench row in {path}")
print("| concurrency | engine core output tok/s (each rep) | moat serve output tok/s (each rep) | serve / engine (each rep) | median serve / engine | failed requests |")
print("|---|---|---|---|---|---|")
for c in levels:
    e = [engine_tps(f"{work}/engine.{c}.{r}.md") for r in range(1, reps + 1)]
    records = [json.load(open(f"{work}/serve.{c}.{r}/bench_serve.json"))[0] for r in range(1, reps + 1)]
    s = [rec["output_tps"] for rec in records]
    failed = sum(rec["failed"] for rec in records)
    ratios = [b / a for a, b in zip(e, s)]
    fmt = lambda xs, d: ", ".join(f"{x:.{d}f}" for x in xs)
    print(f"| {c} | {fmt(e, 1)} | {fmt(s, 1)} | {fmt(ratios, 3)} | {statistics.median(ratios):.3f} | {failed} |")
PY
