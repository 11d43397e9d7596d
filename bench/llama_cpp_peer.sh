#!/usr/bin/env bash
# moat next to llama.cpp on the same weights, in one run (issue 12): llama-bench and moat's
# bench/model_bench alternate per thread count, first on the bf16 bench checkpoint (BF16 GGUF), then on
# the FP8 one (FP8 e4m3 128x128 blocks for moat; dequantized and quantized to Q8_0 for llama.cpp, the
# matrices the checkpoint keeps in bf16 stay bf16 in both). Prints a markdown table (measure | moat |
# llama.cpp | moat / llama.cpp) and the llama.cpp version on stdout, progress on stderr; bench/run.sh
# puts it in BENCHMARKS.md as the `peer` section (ONLY=peer bench/run.sh).
#
# llama.cpp is built by you, outside this repository (CPU backend, native ISA; where the tree has no
# tools/, as the npm copies of llama.cpp, the library alone and bench/libllama_bench.cpp stand in):
#   cmake -S $LLAMA_CPP_DIR -B $LLAMA_CPP_DIR/build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DGGML_CUDA=OFF \
#     -DCMAKE_BUILD_TYPE=Release && cmake --build $LLAMA_CPP_DIR/build -j --target llama-bench
#   LLAMA_CPP_DIR=/path/to/llama.cpp bench/llama_cpp_peer.sh
# The GGUFs are written by bench/gguf_from_hf.py (our converter; it needs the `gguf` Python package:
# $LLAMA_CPP_DIR/gguf-py is used, or an installed one) into GGUF_DIR, again whenever the checkpoint or
# the converter is newer than the GGUF (bf16: ~7 GB, a few minutes; Q8_0: ~4 GB, ~5-10 minutes).
#
# Environment: LLAMA_CPP_DIR (required), LLAMA_BENCH (default $LLAMA_CPP_DIR/build/bin/llama-bench),
#   BUILD_DIR=build, THREADS=1,2, PEER_PROMPT=512 (prefill tokens), PEER_GEN=128 (decode tokens:
#   llama-bench -n, model_bench --decode-tokens), PEER_REPS=5 (llama-bench -r, model_bench --repetitions), BF16_MODEL=checkpoints/bench,
#   FP8_MODEL=checkpoints/bench-fp8 (FP8_MODEL= skips the FP8 rows), GGUF_DIR=checkpoints/gguf,
#   LLAMA_BENCH_ARGS (extra llama-bench flags), LLAMA_BENCH_FP8_ARGS (more, for the Q8_0 run only: e.g.
#   `-nr 1`, where llama.cpp's AMX buffers abort on deepseek2's Q8_0 weights), MOAT_ARGS (extra model_bench flags, e.g. --exact),
#   PYTHON=/usr/bin/python3, PEER_BUILD=0 (use $BUILD_DIR/model_bench as it is, no cmake --build).
# A quick check of the plumbing (seconds of benchmark, not numbers to keep):
#   PEER_PROMPT=16 PEER_GEN=4 PEER_REPS=1 LLAMA_CPP_DIR=... bench/llama_cpp_peer.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${LLAMA_CPP_DIR:-}" ]]; then
  echo "bench/llama_cpp_peer.sh: set LLAMA_CPP_DIR to a llama.cpp checkout built with llama-bench (see the top of this script)" >&2
  exit 2
fi
BUILD_DIR=${BUILD_DIR:-build}
LLAMA_BENCH=${LLAMA_BENCH:-$LLAMA_CPP_DIR/build/bin/llama-bench}
peer_tool="llama-bench"
if [[ ! -x "$LLAMA_BENCH" ]]; then
  # A tree with libllama but no tools/ (the npm copies of llama.cpp): our stand-in over llama.h,
  # which times the same pp / tg tests (bench/libllama_bench.cpp).
  lib_dir=$(dirname "$(find "$LLAMA_CPP_DIR/build" -name 'libllama.so' -print -quit 2>/dev/null)" 2>/dev/null || true)
  if [[ -z "$lib_dir" || "$lib_dir" == . || ! -f "$LLAMA_CPP_DIR/include/llama.h" ]]; then
    echo "bench/llama_cpp_peer.sh: no llama-bench at $LLAMA_BENCH and no libllama.so under $LLAMA_CPP_DIR/build: build llama.cpp (see the top of this script) or set LLAMA_BENCH" >&2
    exit 2
  fi
  LLAMA_BENCH="$BUILD_DIR/libllama_bench"
  g++ -O2 -std=c++17 bench/libllama_bench.cpp -I"$LLAMA_CPP_DIR/include" -I"$LLAMA_CPP_DIR/ggml/include" \
    -L"$lib_dir" -lllama -lggml -lggml-base -Wl,-rpath,"$lib_dir" -o "$LLAMA_BENCH"
  peer_tool="bench/libllama_bench (no llama-bench in that tree)"
fi
THREADS=${THREADS:-1,2}
PEER_PROMPT=${PEER_PROMPT:-512}
PEER_GEN=${PEER_GEN:-128}
PEER_REPS=${PEER_REPS:-5}
BF16_MODEL=${BF16_MODEL-checkpoints/bench}
FP8_MODEL=${FP8_MODEL-checkpoints/bench-fp8}
GGUF_DIR=${GGUF_DIR:-checkpoints/gguf}
LLAMA_BENCH_ARGS=${LLAMA_BENCH_ARGS:-}
LLAMA_BENCH_FP8_ARGS=${LLAMA_BENCH_FP8_ARGS:-}
# llama.cpp runs under each of these (llama-bench -lm) and is credited with its best: on a VM whose
# page cache holds the GGUF in 4 KiB pages, its mmap pays a TLB miss per page (decode at less than
# half the speed it reaches with the weights read into memory, `none`).
LLAMA_LOAD_MODES=${LLAMA_LOAD_MODES:-mmap,none}
MOAT_ARGS=${MOAT_ARGS:-}
PYTHON=${PYTHON:-/usr/bin/python3}
if [[ -d "$LLAMA_CPP_DIR/gguf-py" ]]; then
  export PYTHONPATH="$LLAMA_CPP_DIR/gguf-py${PYTHONPATH:+:$PYTHONPATH}"
fi

[[ "${PEER_BUILD:-1}" == 0 ]] || cmake --build "$BUILD_DIR" --target model_bench -j2 >/dev/null
log_dir=$(mktemp -d)
trap 'rm -rf "$log_dir"' EXIT

# gguf_for CHECKPOINT OUT.gguf: converts when OUT is missing or older than the checkpoint or the converter
gguf_for() {
  local model=$1 out=$2 f stale=0
  [[ -f "$out" ]] || stale=1
  if (( !stale )); then
    for f in "$model"/config.json "$model"/*.safetensors bench/gguf_from_hf.py; do
      [[ "$f" -nt "$out" ]] && stale=1
    done
  fi
  if (( stale )); then
    echo "peer: converting $model -> $out (bench/gguf_from_hf.py)" >&2
    "$PYTHON" bench/gguf_from_hf.py "$model" "$out" >"$log_dir/convert.log" 2>&1 ||
      { cat "$log_dir/convert.log" >&2; return 1; }
    tail -1 "$log_dir/convert.log" >&2
  fi
}

# results: lines "<kind> <engine> <threads> <prefill tok/s> <prefill sd> <decode tok/s> <decode sd> <prefill %>
# <decode %>" (the last two: moat's share of its roofline, "-" for llama.cpp)
results="$log_dir/results"
: >"$results"
run_pair() {  # run_pair KIND CHECKPOINT GGUF
  local kind=$1 model=$2 gguf=$3 t out
  # as bench/run.sh: drop the checkpoint's cached pages once, so the loader maps it in 2 MiB folios
  # (and the GGUF's, so llama.cpp's mmap starts from the same state)
  for f in "$model"/*.safetensors "$gguf"; do dd if="$f" iflag=nocache count=0 status=none || true; done
  for t in ${THREADS//,/ }; do
    echo "peer: $kind, $t thread(s): moat model_bench" >&2
    # shellcheck disable=SC2086
    "$BUILD_DIR/model_bench" --model "$model" --threads "$t" --prompt-tokens "$PEER_PROMPT" \
      --decode-tokens "$PEER_GEN" --repetitions "$PEER_REPS" $MOAT_ARGS >"$log_dir/moat.out" 2>"$log_dir/moat.err" ||
      { cat "$log_dir/moat.err" >&2; echo "peer: model_bench failed" >&2; return 1; }
    "$PYTHON" - "$kind" "$t" "$PEER_PROMPT" "$log_dir/moat.out" >>"$results" <<'PY' || { cat "$log_dir/moat.out" >&2; return 1; }
import re, sys
kind, t, p, path = sys.argv[1:5]
text = open(path).read()
pre = re.search(r"prefill (\d+) tokens: ([\d.]+) tok/s", text)
dec = re.search(r"decode: ([\d.]+) tok/s", text)
if not pre or not dec or pre.group(1) != p:
    sys.exit(f"peer: cannot read prefill {p} / decode tok/s in model_bench's output")
# the range of the repetitions, as llama.cpp's cells show theirs (weights mmapped: model_bench's default)
spread = re.search(r"median of \d+ repetitions: prefill ([\d.]+-[\d.]+) tok/s, decode ([\d.]+-[\d.]+) tok/s", text)
pre_sd, dec_sd = (spread.group(1) + ",mmap", spread.group(2) + ",mmap") if spread else ("-", "-")
# moat's share of its own roofline in the same process: prefill against the matmul peak (or the
# weights' bytes, whichever bounds it), decode against the bandwidth probes around the repetitions
pre_pct = re.search(r"prefill \d+ tokens: [\d.]+ tok/s, roofline [\d.]+ tok/s \((\d+)%", text)
dec_pct = re.search(r"decode: [\d.]+ tok/s, roofline [\d.]+ tok/s \((\d+)%", text)
print(kind, "moat", t, pre.group(2), pre_sd, dec.group(1), dec_sd,
      pre_pct.group(1) if pre_pct else "-", dec_pct.group(1) if dec_pct else "-")
PY
    echo "peer: $kind, $t thread(s): llama-bench" >&2
    # shellcheck disable=SC2086
    local kind_args=""
    [[ $kind == fp8 ]] && kind_args=$LLAMA_BENCH_FP8_ARGS
    # shellcheck disable=SC2086
    # prefill from an empty cache; decode at a depth of the prompt's tokens (-d), as moat decodes
    # after its prompt
    "$LLAMA_BENCH" -m "$gguf" -p "$PEER_PROMPT" -n 0 -r "$PEER_REPS" -t "$t" -lm "$LLAMA_LOAD_MODES" -o json $LLAMA_BENCH_ARGS $kind_args \
      >"$log_dir/llama_pp.json" 2>"$log_dir/llama.err" ||
      { tail -20 "$log_dir/llama.err" >&2; echo "peer: llama-bench failed" >&2; return 1; }
    # shellcheck disable=SC2086
    "$LLAMA_BENCH" -m "$gguf" -p 0 -n "$PEER_GEN" -d "$PEER_PROMPT" -r "$PEER_REPS" -t "$t" -lm "$LLAMA_LOAD_MODES" -o json $LLAMA_BENCH_ARGS $kind_args \
      >"$log_dir/llama_tg.json" 2>"$log_dir/llama.err" ||
      { tail -20 "$log_dir/llama.err" >&2; echo "peer: llama-bench failed" >&2; return 1; }
    "$PYTHON" - "$kind" "$t" "$PEER_PROMPT" "$PEER_GEN" "$log_dir/llama_pp.json" "$log_dir/llama_tg.json" "$log_dir/build" >>"$results" <<'PY'
import json, statistics, sys
kind, t, p, n, pp_path, tg_path, build = sys.argv[1:8]
rows = json.load(open(pp_path)) + json.load(open(tg_path))
def best(test):  # the load mode with the highest median of its repetitions
    return max(test, key=lambda r: statistics.median(r["samples_ts"]))
pp = [r for r in rows if r["n_prompt"] == int(p) and r["n_gen"] == 0]
tg = [r for r in rows if r["n_gen"] == int(n) and r["n_prompt"] == 0 and r.get("n_depth", 0) == int(p)]
if not pp or not tg:
    sys.exit(f"peer: no pp{p} / tg{n} @ d{p} rows in llama-bench's JSON (a llama-bench without -d?)")
pp, tg = best(pp), best(tg)
def cell(r):  # median, spread (min-max) and the load mode it ran under
    s = r["samples_ts"]
    return f"{statistics.median(s)} {min(s):.1f}-{max(s):.1f},{r.get('load_mode', '?')}"
print(kind, "llama", t, *cell(pp).split(" "), *cell(tg).split(" "), "-", "-")
r = rows[0]
with open(build, "w") as f:
    json.dump({k: r.get(k) for k in ("build_commit", "build_number", "cpu_info", "backends", "n_batch", "n_ubatch",
                                     "flash_attn", "type_k", "load_mode")}, f)
PY
  done
}

kinds=()
if [[ -n "$BF16_MODEL" && -f "$BF16_MODEL/config.json" ]]; then
  gguf_for "$BF16_MODEL" "$GGUF_DIR/$(basename "$BF16_MODEL")-bf16.gguf"
  kinds+=(bf16)
fi
if [[ -n "$FP8_MODEL" && -f "$FP8_MODEL/config.json" ]]; then
  gguf_for "$FP8_MODEL" "$GGUF_DIR/$(basename "$FP8_MODEL")-q8_0.gguf"
  kinds+=(fp8)
fi
if (( ${#kinds[@]} == 0 )); then
  echo "bench/llama_cpp_peer.sh: no checkpoint at '$BF16_MODEL' or '$FP8_MODEL' (tools/make_checkpoint.py --preset bench, see bench/run.sh)" >&2
  exit 1
fi
for kind in "${kinds[@]}"; do
  if [[ $kind == bf16 ]]; then
    run_pair bf16 "$BF16_MODEL" "$GGUF_DIR/$(basename "$BF16_MODEL")-bf16.gguf"
  else
    run_pair fp8 "$FP8_MODEL" "$GGUF_DIR/$(basename "$FP8_MODEL")-q8_0.gguf"
  fi
done

# the llama.cpp version: its CMakeLists' LLAMA_VERSION, the commit (git, else llama-bench's build info)
cmake_version() {  # cmake_version FILE PREFIX: "MAJOR.MINOR.PATCH" from set(PREFIX_MAJOR n) lines
  sed -n "s/^set($2_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)).*/\2/p" "$1" 2>/dev/null | paste -sd. -
}
version=$(cmake_version "$LLAMA_CPP_DIR/CMakeLists.txt" LLAMA_VERSION)
ggml_version=$(cmake_version "$LLAMA_CPP_DIR/ggml/CMakeLists.txt" GGML_VERSION)
commit=$(git -C "$LLAMA_CPP_DIR" describe --tags --always --dirty 2>/dev/null || true)

"$PYTHON" - "$results" "$log_dir/build" "$THREADS" "$PEER_PROMPT" "$PEER_GEN" "$PEER_REPS" "$BF16_MODEL" "$FP8_MODEL" \
  "${version:-?}" "${ggml_version:-?}" "$commit" "$LLAMA_BENCH_ARGS" "$MOAT_ARGS" "$LLAMA_LOAD_MODES" "$peer_tool" "$LLAMA_BENCH_FP8_ARGS" <<'PY'
import json, sys
results, build, threads, p, n, reps, bf16_model, fp8_model, version, ggml_version, commit, lb_args, moat_args, load_modes, tool, fp8_args = sys.argv[1:17]
r = {}
for line in open(results):
    kind, engine, t, pre, pre_sd, dec, dec_sd, pre_pct, dec_pct = line.split()
    r[kind, engine, int(t)] = (float(pre), pre_sd, float(dec), dec_sd, pre_pct, dec_pct)
b = json.load(open(build))
threads = [int(t) for t in threads.split(",")]
label = {"bf16": "bf16", "fp8": "FP8 (moat) vs Q8_0 (llama.cpp)"}
def cell(v, sd):  # sd: "-" (one measurement) or "min-max,load mode" (the median of the reps)
    if sd == "-":
        return f"{v:.1f}"
    spread, mode = sd.split(",")
    return f"{v:.1f} ({spread}, {mode})"
print("| measure | moat tok/s | llama.cpp tok/s | moat / llama.cpp | moat, % of its roofline |")
print("|---|---|---|---|---|")
for kind in ("bf16", "fp8"):
    for what, i, pct in ((f"prefill {p} tokens", 0, 4), (f"decode {n} tokens", 2, 5)):
        for t in threads:
            m, l = r.get((kind, "moat", t)), r.get((kind, "llama", t))
            if not m or not l:
                continue
            th = "thread" if t == 1 else "threads"
            share = f"{m[pct]}%" if m[pct] != "-" else "-"
            print(f"| {label[kind]} {what}, {t} {th} | {cell(m[i], m[i + 1])} | {cell(l[i], l[i + 1])} | {m[i] / l[i]:.2f} | {share} |")
print()
commit = commit or (b.get("build_commit") or "?")
fa = {-1: "auto", 0: "off", 1: "on"}.get(b.get("flash_attn"), b.get("flash_attn"))
print(f"llama.cpp {version} (ggml {ggml_version}, commit {commit}; backend {b.get('backends')}, cpu_info "
      f"{b.get('cpu_info')!r}), measured by {tool}: `llama-bench -p {p} -n 0 -r {reps} -t T -lm {load_modes}{(' ' + lb_args) if lb_args else ''}` "
      f"and `llama-bench -p 0 -n {n} -d {p} ...` "
      f"(median of {reps} repetitions (min-max, the load mode that did best); n_batch {b.get('n_batch')}, n_ubatch {b.get('n_ubatch')}, flash attention {fa}, "
      f"KV cache {b.get('type_k')}{('; the Q8_0 rows with ' + fp8_args) if fp8_args else ''}). moat: `model_bench --prompt-tokens {p} --decode-tokens {n} --repetitions {reps}"
      f"{(' ' + moat_args) if moat_args else ''}` (median of {reps} repetitions (min-max), weights mmapped). Both engines decode after {p} tokens in the cache "
      f"(moat after its prompt, llama.cpp's tg{n} at depth {p}) and prefill from an empty one.")
PY
