#!/usr/bin/env bash
# Serving benchmark of `moat serve` over HTTP: starts the server on the bench checkpoint
# (DeepSeek-V2-Lite shapes, 6 layers, random weights; generated, git-ignored:
#   tools/make_checkpoint.py --preset bench --out checkpoints/bench --shards 4),
# runs `moat bench` against it at several concurrencies (random prompts of exact token length,
# ignore_eos so every request generates --output-len tokens), and prints a markdown table.
#   bench/serve_bench.sh                                   (the full sweep: run it on an idle machine)
#   CONCURRENCY=1,4 NUM_PROMPTS=4 OUTPUT_LEN=16 bench/serve_bench.sh   (a smoke run)
# Environment: BUILD_DIR (build), MODEL (checkpoints/bench), CONCURRENCY (1,4,16,64), INPUT_LEN (128),
# OUTPUT_LEN (64), NUM_PROMPTS (moat bench's default: max(16, 4 x concurrency)), PROMPTS_PER_STREAM
# (instead: one run per concurrency of that many prompts per stream, as bench/engine_bench), OUT_DIR (.),
# TOKENIZER_DIR (for a checkpoint without a tokenizer), SERVE_ARGS (extra `moat serve` flags, e.g. "--threads 2 --max-num-seqs 64").
# Writes $OUT_DIR/bench_serve.json and $OUT_DIR/bench_serve.png (moat bench --plot over all concurrencies).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
MODEL=${MODEL:-checkpoints/bench}
CONCURRENCY=${CONCURRENCY:-1,4,16,64}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-64}
NUM_PROMPTS=${NUM_PROMPTS:-}
PROMPTS_PER_STREAM=${PROMPTS_PER_STREAM:-}
OUT_DIR=${OUT_DIR:-.}
SERVE_ARGS=${SERVE_ARGS:-}
moat=$BUILD_DIR/moat

if [[ ! -x "$moat" ]]; then
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$BUILD_DIR" --target moat -j2 >/dev/null
fi
if [[ ! -f "$MODEL/config.json" ]]; then
  echo "no checkpoint at $MODEL; generate it with: tools/make_checkpoint.py --preset bench --out $MODEL --shards 4" >&2
  exit 1
fi

# The bench checkpoint has random weights and no tokenizer; moat serve needs one, and moat bench
# uses it to make prompts of exact length. Serve a directory of links to the checkpoint's files
# plus a tokenizer whose ids cover (nearly) the checkpoint's 102400: DeepSeek LLM's (100015 ids;
# the test data's copy by default, TOKENIZER_DIR for another). A small one (k3-nano's 4096) does
# not do: the random model samples ids beyond it, which decode to no text.
serve_dir=$MODEL
if [[ ! -f "$MODEL/tokenizer.json" && ! -f "$MODEL/tiktoken.model" ]]; then
  tok=${TOKENIZER_DIR:-}
  if [[ -z "$tok" ]]; then
    for d in shared/testdata/tokenizers/deepseek-llm ../shared/testdata/tokenizers/deepseek-llm; do
      [[ -f "$d/tokenizer.json" ]] && { tok=$d; break; }
    done
  fi
  [[ -n "$tok" && -f "$tok/tokenizer.json" ]] ||
    { echo "$MODEL has no tokenizer; set TOKENIZER_DIR to a directory with tokenizer.json (e.g. DeepSeek LLM's)" >&2; exit 1; }
  serve_dir=checkpoints/$(basename "$MODEL")-serve
  mkdir -p "$serve_dir"
  for f in "$MODEL"/*; do ln -sfn "$(realpath "$f")" "$serve_dir/$(basename "$f")"; done
  for f in tokenizer.json tokenizer_config.json; do
    [[ -f "$tok/$f" ]] && ln -sfn "$(realpath "$tok/$f")" "$serve_dir/$f"
  done
fi

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp "${TMPDIR:-/tmp}/moat-serve-bench.XXXXXX.log")
max_seqs=$(tr ',' '\n' <<<"$CONCURRENCY" | grep -v inf | sort -n | tail -1)
# shellcheck disable=SC2086
"$moat" serve --model "$serve_dir" --port "$port" --no-access-log --served-model-name bench \
  --max-num-seqs "${max_seqs:-64}" --max-context $((INPUT_LEN + OUTPUT_LEN + 64)) $SERVE_ARGS >"$log" 2>&1 &
pid=$!
cleanup() {
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    wait "$pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT
echo "moat serve on $serve_dir, port $port (pid $pid): waiting for /health" >&2
for _ in $(seq 1 3000); do  # the 6 GB checkpoint may take minutes to load on a busy machine
  kill -0 "$pid" 2>/dev/null || { echo "moat serve exited:" >&2; tail -n 20 "$log" >&2; exit 1; }
  [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health") == 200 ]] && break
  sleep 0.2
done
[[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health") == 200 ]] ||
  { echo "moat serve not ready after 10 minutes" >&2; tail -n 20 "$log" >&2; exit 1; }

mkdir -p "$OUT_DIR"
json=$OUT_DIR/bench_serve.json
args=(--base-url "http://127.0.0.1:$port" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --tokenizer "$serve_dir"
      --no-progress)
args+=(--concurrency "$CONCURRENCY" --json "$json" --plot "$OUT_DIR/bench_serve.png")
# --prompts-per-stream: PROMPTS_PER_STREAM x concurrency requests per level, the workload of
# bench/engine_bench (two requests per stream), so the two tables compare as HTTP vs none
if [[ -n "$PROMPTS_PER_STREAM" ]]; then
  args+=(--prompts-per-stream "$PROMPTS_PER_STREAM")
elif [[ -n "$NUM_PROMPTS" ]]; then
  args+=(--num-prompts "$NUM_PROMPTS")
fi
"$moat" bench "${args[@]}" >&2

python3 - "$json" "$MODEL" <<'PY'
import json, sys
records = json.load(open(sys.argv[1]))
r0 = records[0]
print(f"moat serve on {sys.argv[2]}: {r0['input_len']} prompt tokens, {r0['output_len']} output tokens per request")
print()
print("| concurrency | requests | failed | output tok/s | tok/s per stream | req/s | TTFT median ms | TTFT p99 ms | TPOT median ms | ITL p99 ms |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in records:
    print(f"| {r['concurrency']} | {r['completed']} | {r['failed']} | {r['output_tps']:.1f} | {r['per_stream_tps']:.1f} "
          f"| {r['request_tps']:.2f} | {r['ttft_ms']['median']:.1f} | {r['ttft_ms']['p99']:.1f} "
          f"| {r['tpot_ms']['median']:.2f} | {r['itl_ms']['p99']:.2f} |")
PY
