#!/usr/bin/env bash
# Regenerates BENCHMARKS.md from measurements taken in one run on this machine:
#   1. kernel microbenchmarks (bench/kernel_bench.cpp): memory read bandwidth and bf16 peak at 1 and
#      2 threads, and the cpu matmul / MLA attention kernels next to those rooflines;
#   2. model-level decode and prefill, serving, speculative decoding and moat serve (below);
#   3. Kimi Linear (hybrid KDA + MLA, MXFP4 experts) on checkpoints/bench-kimi, generated here when
#      missing (tools/make_checkpoint.py --preset bench-kimi: ~2.5 minutes, 1.5 GB); ~3.5 minutes
#      of model_bench on a busy 2-core machine.
# Run it on an idle machine: anything else running halves these numbers (DESIGN.md, toolchain facts).
#   bench/run.sh            (BUILD_DIR=build, THREADS=1,2; KIMI=checkpoints/bench-kimi (KIMI= skips
#                            section 3), KIMI_CONTEXTS=1024,4096,8192, KIMI_CHUNK=2048)
#   ONLY=kimi bench/run.sh  reruns section 3 alone (its kernel rows with kernel_bench --kda-only, which
#                            measures the bandwidth and peak probes again) and replaces that section of
#                            the existing BENCHMARKS.md (between its marker comments) in place
#   ONLY=tp bench/run.sh    reruns the tensor-parallel section (bench/tp_bench.sh: mpirun, ~1 minute)
#                            and replaces it in place
#   ONLY=peer bench/run.sh  reruns the side-by-side with llama.cpp (bench/llama_cpp_peer.sh: needs
#                            LLAMA_CPP_DIR, a llama.cpp build with llama-bench; ~10 minutes, plus the
#                            GGUF conversion the first time) and replaces that section in place. A full
#                            run includes it when LLAMA_CPP_DIR is set and leaves a note in its place when not.
#   ONLY=kernels bench/run.sh reruns kernel_bench (the probes and every kernel row, ~10 minutes)
#                            and replaces the kernel section in place
#   ONLY=model bench/run.sh reruns the model decode and prefill rows (MODELS) and replaces them in place
#   ONLY=spec bench/run.sh  reruns the speculative-decoding rows and replaces them in place
#   ONLY=cuda bench/run.sh  reruns the CUDA backend section: build/cuda_bench on this machine's GPU
#                            (~1 minute), or CUDA_BENCH_OUTPUT=FILE, cuda_bench's output saved on a GPU
#                            machine (bench/cuda_device_check.sh writes it), and replaces that section in
#                            place. A full run without a GPU or that file keeps the section it finds.
#   ONLY=serve bench/run.sh reruns the engine-core rows and `moat serve` over HTTP, then the HTTP
#                            overhead (bench/http_overhead.sh: engine core and server back to back,
#                            OVERHEAD_REPS=3 pairs at concurrency 1 and 64, ~20 minutes), and replaces
#                            the engine and serve sections and the plot, docs/bench_serve.png, in place
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
THREADS=${THREADS:-1,2}
OUT=${OUT:-BENCHMARKS.md}

cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR" --target kernel_bench -j2 >/dev/null

ONLY=${ONLY:-}

# The CUDA backend's ops at DeepSeek-V3 shapes (bench/cuda_bench.cpp), measured where a GPU is or
# read from CUDA_BENCH_OUTPUT; otherwise the section already in $OUT is carried over unchanged.
cuda_rows=""
if [[ -n "${CUDA_BENCH_OUTPUT:-}" ]]; then
  cuda_rows=$(cat "$CUDA_BENCH_OUTPUT")
elif [[ -z "$ONLY" || "$ONLY" == cuda ]] && cmake --build "$BUILD_DIR" --target cuda_bench -j2 >/dev/null 2>&1; then
  cuda_rows=$("$BUILD_DIR/cuda_bench" 2>/dev/null) || cuda_rows=""
fi
previous_cuda_section=$(/usr/bin/python3 - "$OUT" <<'PY'
import re, sys, os
text = open(sys.argv[1]).read() if os.path.exists(sys.argv[1]) else ""
m = re.search(r"<!-- bench/run.sh section: cuda .*?<!-- end of section: cuda -->\n", text, re.S)
print(m.group(0) if m else "", end="")
PY
)
cuda_section() {
  echo "<!-- bench/run.sh section: cuda (ONLY=cuda bench/run.sh regenerates it alone, on a GPU or from CUDA_BENCH_OUTPUT) -->"
  echo
  echo "## CUDA backend: decode ops at DeepSeek-V3 shapes on one GPU"
  echo
  echo "_Measured $(date -u +%Y-%m-%d) ($(git rev-parse --short HEAD 2>/dev/null || echo '?')) by \`cuda_bench\` on the device it names below;"
  echo "the CPU machine of this file's header did not run it._ The engine does not run a model on the GPU yet"
  echo "(\`--backend\` takes cpu or reference), so these are the cuda ops alone, at DeepSeek-V3 / Kimi K2 shapes with"
  echo "random weights, each against two limits measured in the same run: a device-to-device copy (bytes read +"
  echo "written; a read-only stream such as a GEMV can pass it by a few %) and the bf16 matmul op's own rate at"
  echo "8192^3 (cuBLAS after rounding x to bf16). Weights cycle through >= 256 MB so every call reads HBM; times are"
  echo "CUDA events, the median of up to 25 calls. Decode-sized matmuls (T <= 8, bf16 or fp8) run moat's GEMV"
  echo "(fp32 arithmetic, weights streamed once); larger ones cuBLAS, fp8 after dequantizing the matrix to bf16."
  echo "MLA rows read a paged cache of 576-value rows (blocks of 64) for 128 heads (TP 1) or 16 (TP 8); GB/s"
  echo "counts each cache row once per step."
  echo
  echo "$cuda_rows"
  echo
  echo "What limits each group (from these rows and the kernels' design; no hardware counters were read):"
  echo "- bf16 GEMV (T = 1): the large matrices stream at 87-105% of the copy probe; q_a + kv_a (2112 rows) and q_b"
  echo "  reach 48-70%: 15-30 us calls where launch and the last wave's tail weigh (K is split over up to 8 warps a row"
  echo "  pair to fill the GPU; that took q_a + kv_a from 41% to 46-50% over three runs)."
  echo "- fp8 GEMV: 23-48%, in about the same time as bf16 for half the bytes, so not the memory: every code is"
  echo "  converted e4m3 -> f16 -> f32 and multiplied in fp32, per weight; the conversion's cost is the suspect,"
  echo "  not established."
  echo "- bf16 at T = 16-64 (cuBLAS): 27-97%, lowest on the small q_a + kv_a; a GEMV pass per 8 tokens or a"
  echo "  split-K GEMM would serve batched decode better."
  echo "- fp8 at T = 16-512: 5-9%: the whole matrix is dequantized to a bf16 copy every call (1 byte read, 2 written,"
  echo "  2 read again by cuBLAS). FP8 tensor-core GEMMs with the checkpoint's 128 x 128 block scales would remove it."
  echo "- Routed experts: experts of 1-8 rows run grouped by row count (one GEMV launch for all their gates and ups,"
  echo "  one for their downs): bf16 72% at T = 1 (a host synchronization reads the expert ids back each layer), 83-98%"
  echo "  at 4-64 tokens; at 256 tokens experts get ~8 rows or more and run cuBLAS one at a time (46%). fp8 inherits"
  echo "  its GEMV's conversion cost (36-50%) and, past 8 rows an expert, the dequantized path (10% at 256 tokens)."
  echo "- MLA decode: fp32 on CUDA cores. At 128 heads a cache row costs 2 x 128 x 1088 flops for 1152 bytes"
  echo "  (~240 flops/byte), so the copy bandwidth would need ~1 PFLOP/s: only tensor cores (bf16 q . k and p . v, as"
  echo "  FlashMLA) can get there; the kernel runs ~13 TFLOP/s (~20% of the fp32 datasheet peak). At 16 heads"
  echo "  (~30 flops/byte) the same holds at 1/8 the flops: 10% of the copy bandwidth."
  echo
  echo "History (same H200 kind, same day): the first run of the cuda backend (every kernel as first written) read fp8"
  echo "matmuls at 3% of the copy bandwidth at every T up to 64 (the per-weight dequantization), routed experts at"
  echo "28-42% (bf16) and 3% (fp8), and MLA decode at 0-1%: 840 ms for 64 x 32k rows at 128 heads, 106 ms at 16, 1.65 ms"
  echo "for one 4k sequence (one block per token and head walking every row alone). Now 43 ms, 5.8 ms, 0.05 ms. With the"
  echo "GEMV but one launch per expert matmul, the routed experts read 49-55% (bf16) and 21-23% (fp8) up to 16 tokens."
  echo "compute-sanitizer: memcheck finds no error in tests/ops/cuda_ops_test.cpp (it found attn_res_mix's"
  echo "over-read on the first run); racecheck finds none in moat's kernels and reports hazards inside cuBLAS's own"
  echo "nvjet kernels (calls of 9 and 17 tokens)."
  echo
  echo "<!-- end of section: cuda -->"
}

load_before=$(cut -d' ' -f1 /proc/loadavg)
if [[ "$ONLY" == kimi ]]; then
  kernels=$("$BUILD_DIR/kernel_bench" --threads "$THREADS" --kda-only --markdown)
elif [[ "$ONLY" == serve || "$ONLY" == tp || "$ONLY" == peer || "$ONLY" == model || "$ONLY" == spec || "$ONLY" == cuda ]]; then
  kernels=""
else
  kernels=$("$BUILD_DIR/kernel_bench" --threads "$THREADS" --markdown)
fi
load_after=$(cut -d' ' -f1 /proc/loadavg)

# Model-level numbers (bench/model_bench.cpp, one process per row so peak RSS is that row's own):
# decode tok/s at 1 stream and prefill tok/s for 512 tokens, each next to its roofline measured in
# the same process (active weight bytes + latent cache read per token over bandwidth; prefill
# FLOPs over the bf16 peak), and peak RSS against checkpoint + KV pool. The bench checkpoints
# (DeepSeek-V2-Lite shapes, 6 layers, random weights) are generated, not shipped:
#   tools/make_checkpoint.py --preset bench --out checkpoints/bench --shards 4
#   tools/make_checkpoint.py --preset bench --fp8 --out checkpoints/bench-fp8 --shards 2
MODELS=${MODELS:-models/k3-nano checkpoints/bench checkpoints/bench-fp8}
# Kimi-Linear-48B-shaped hybrid (4 layers: KDA x 3 then MLA, 64 routed experts in MXFP4); KIMI= skips it.
KIMI=${KIMI-checkpoints/bench-kimi}
[[ -n "$ONLY" && "$ONLY" != kimi ]] && KIMI=""
if [[ -n "$KIMI" && ! -f "$KIMI/config.json" ]]; then
  /usr/bin/python3 tools/make_checkpoint.py --preset bench-kimi --out "$KIMI" --shards 3 >/dev/null
fi
cmake --build "$BUILD_DIR" --target model_bench -j2 >/dev/null
# A checkpoint just written (or read with read()) sits in the page cache as small folios, which
# stay small; dropping it once lets the loader's populate read it back in 2 MiB folios, as after a
# cold start (GNU dd: iflag=nocache count=0 drops the whole file's cached pages).
for model in $MODELS $KIMI; do
  for f in "$model"/*.safetensors; do [[ -f "$f" ]] && dd if="$f" iflag=nocache count=0 status=none || true; done
done
model_benchmarks() {
  echo "| model | threads | activations, weights, % in 2 MiB pages | GB/s weights' memory / fresh buffer | prefill 512 tok/s | roofline | % | decode tok/s | roofline | % | peak RSS MiB | checkpoint + KV MiB | RSS ratio |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  for model in $MODELS; do
    if [[ ! -f "$model/config.json" ]]; then
      echo "| $model | - | - | - | not generated on this machine (see bench/run.sh) | | | | | | | | |"
      continue
    fi
    for t in ${THREADS//,/ }; do
      "$BUILD_DIR/model_bench" --model "$model" --threads "$t" --markdown
      [[ "$model" == models/* ]] && continue
      "$BUILD_DIR/model_bench" --model "$model" --threads "$t" --weights-in-memory --markdown
      "$BUILD_DIR/model_bench" --model "$model" --threads "$t" --exact --markdown
      # as an AVX-512F server without BF16 dot products (Skylake-SP .. Ice Lake) runs: fp32 FMAs
      # (cpu.matmul_avx512fma), against the 512-bit FMA peak
      if grep -qw avx512_bf16 /proc/cpuinfo; then
        MOAT_DISABLE_ISA=amx-bf16,avx512bf16 "$BUILD_DIR/model_bench" --model "$model" --threads "$t" --markdown
      fi
    done
  done
}
model_rows=""
[[ -z "$ONLY" || "$ONLY" == model ]] && model_rows=$(model_benchmarks)
model_section() {
  echo "<!-- bench/run.sh section: model (ONLY=model bench/run.sh regenerates it alone) -->"
  echo
  echo "$model_rows"
  echo
  echo "<!-- end of section: model -->"
}

# Kimi Linear (bench/model_bench.cpp on the hybrid): decode bytes per token against the measured
# bandwidth (weights with MXFP4 experts at their packed size + KDA state read and written + MLA
# latent rows), and prefill from an empty cache at KIMI_CONTEXTS tokens (the KDA layers' time per
# token against the MLA layer's), in calls of KIMI_CHUNK tokens. 1k + 4k + 8k took 98 s at one
# thread on a busy 2-core machine; 32k tokens through the model would take ~8 minutes per thread
# count (the MLA layer's attention over 32k rows dominates), so the 32k point is kernel_bench's
# kda_chunked rows. The state per request next to `moat plan`'s figure.
KIMI_CONTEXTS=${KIMI_CONTEXTS:-1024,4096,8192}
KIMI_CHUNK=${KIMI_CHUNK:-2048}
# timed decode steps: 32 (model_bench's default, ~0.8 s at 2 threads) read 78-91% of the roofline
# in back-to-back runs on the Xeon VM, 128 read 85-91%
KIMI_DECODE_TOKENS=${KIMI_DECODE_TOKENS:-128}
kimi_decode_rows="" kimi_profile_rows="" kimi_prefill_rows="" kimi_state=""
if [[ -n "$KIMI" && -f "$KIMI/config.json" ]]; then
  kimi_start=$(date +%s)
  for t in ${THREADS//,/ }; do
    kimi_decode_rows+=$("$BUILD_DIR/model_bench" --model "$KIMI" --threads "$t" --decode-bytes \
      --decode-tokens "$KIMI_DECODE_TOKENS" --markdown)$'\n'
    kimi_profile_rows+=$("$BUILD_DIR/model_bench" --model "$KIMI" --threads "$t" --profile \
      --decode-tokens "$KIMI_DECODE_TOKENS" --markdown)$'\n'
    kimi_prefill_rows+=$("$BUILD_DIR/model_bench" --model "$KIMI" --threads "$t" --contexts "$KIMI_CONTEXTS" \
      --prefill-chunk "$KIMI_CHUNK" --markdown)$'\n'
  done
  cmake --build "$BUILD_DIR" --target moat -j2 >/dev/null
  # the model's figure: the decode rows' "state B / request" column (model.state_bytes_per_request())
  kimi_state=$("$BUILD_DIR/moat" plan --model "$KIMI" --context 8192 --concurrency 1 --json |
    /usr/bin/python3 -c '
import json, sys
name, rows = sys.argv[1], sys.argv[2]
lac = json.load(open(name + "/config.json"))["linear_attn_config"]
H, K, W, L = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"], len(lac["kda_layers"])
model = int(rows.splitlines()[0].split("|")[4].strip())
tp1 = [r for r in json.load(sys.stdin) if r["tp"] == 1]
plan = round(tp1[0]["state_gb_per_gpu"] * 1e9) if tp1 else None
same = "yes" if plan == model else "NO"
print(f"| {name} | {L} KDA layers x (3 x {W - 1} x {H * K} conv inputs + {H} x {K} x {K} state) x 4 B | {model:,} | "
      f"{plan:,} | {same} |" if plan is not None else f"| {name} | - | {model:,} | no TP 1 row | NO |")
' "$KIMI" "$kimi_decode_rows")
  kimi_seconds=$(( $(date +%s) - kimi_start ))
fi

kimi_section() {
  echo "<!-- bench/run.sh section: kimi (ONLY=kimi bench/run.sh regenerates it alone) -->"
  echo
  echo "## Kimi Linear (hybrid KDA + MLA, MXFP4 experts)"
  echo
  echo "\`$KIMI\` (tools/make_checkpoint.py --preset bench-kimi, random weights): Kimi-Linear-48B-A3B's layer shapes"
  echo "(hidden 2304; KDA 32 heads x 128, short conv 4; MLA 32 heads, kv_lora 512, nope / rope / v 128 / 64 / 128, no"
  echo "q_lora, NoPE; dense intermediate 9216; experts of 1024, top 8 + 1 shared) in 4 layers [KDA + dense MLP, KDA, KDA,"
  echo "MLA] with 64 routed experts (the 48B has 256) in MXFP4 (compressed-tensors weight_packed + e8m0 weight_scale)"
  echo "and vocab 32000; everything else bf16. This section took ${kimi_seconds}s."
  echo
  echo "Recurrent state per request: what the model allocates (ModelConfig::state_bytes_per_request, the"
  echo "formula in the second column) against \`moat plan --model $KIMI\` (state per GPU at TP 1, one request)."
  echo
  echo "| model | state per request | bytes (model) | bytes (moat plan) | equal |"
  echo "|---|---|---|---|---|"
  echo "$kimi_state"
  echo
  echo "Decode, one stream, greedy, after a random prompt of 512 tokens ($KIMI_DECODE_TOKENS timed steps). The roofline is the"
  echo "bandwidth of the weights' own memory over the bytes one decode token moves: the active weights (routed experts"
  echo "at 0.5 B per weight + one e8m0 scale per 32, the rest bf16, one embedding row), the KDA state read and written"
  echo "once (2 x the state per request) and the MLA layer's latent rows at the context (bf16, 576 values). % is"
  echo "the share of the measured bandwidth the decode moves; the target is >= 85%."
  echo
  echo "| model | threads | activations, weights | state B / request | context | weights MB | state read + written MB | latent rows MB | MB / token | GB/s weights' memory / fresh buffer | decode tok/s | roofline | % |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  printf "%s" "$kimi_decode_rows"
  echo
  echo "Where a decode token's time goes: the same decode in another process with an ops::OpProfile attached"
  echo "(\`model_bench --profile\`: wall time per kind of op on the calling thread, pool work included; matmuls and routed"
  echo "experts with the weight bytes they streamed, and that rate as a share of the bandwidth measured in that process)."
  echo "WeightSpec.ADecodeTokenStreamsExactlyTheActiveWeights holds the profiled bytes equal to the roofline's active"
  echo "weights. rest = norms, routing, residuals, the embedding row and the argmax."
  echo
  echo "| model | threads | decode tok/s | ms / token | matmul ms (GB/s, % of bandwidth) | routed experts ms (GB/s, %) | per-head matmul ms | MLA attention ms | KDA ms | rest ms |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  printf "%s" "$kimi_profile_rows"
  echo
  echo "What limits the rows, profiled. AMD EPYC Zen 3 VM (2026-12-03, AVX2 only; these tables): the bf16 GEMVs read at"
  echo "68-76% of the bandwidth inside the model in this run (83-88% in the day's first), the MXFP4 experts at 37-53% (42-49%): on AVX2 the 4-bit decode is compute-bound"
  echo "(int16 activations, one widening and 2 vpmaddwd per 32 codes: 9.1-10.5 GB/s on one core in the kernel table, 4.3-4.8 on"
  echo "the exact fp32 tile). KDA runs on its AVX2 copy of kda_cpu.inc (before it, on the scalar reference: 87% of a"
  echo "k3-nano prefill; its per-token inputs, q / k norms and decays, were ~15% of a chunked prefill until they loaded whole vectors unmasked and summed on 4 chains: kda_chunked 38-39 -> 30-31 us per token at 12 heads). Prefill is bound by the fp32 FMA peak (no bf16 dot product on AVX2): 69-73% of it at 1 thread,"
  echo "67-77% at 2, with the KDA layers' projections most of it."
  echo "Intel Xeon VM (2026-12-02, ~18 GB/s per core; the tables were from it until this run): the bf16 GEMVs (~80% of a"
  echo "token's time) read at ~95% of the bandwidth inside the model at 1 and 2 threads, the MXFP4 experts (24 calls of"
  echo "~1.2 MB per layer) at ~80%: decoding 4-bit codes costs more per byte than streaming bf16 (kernel table: MXFP4"
  echo "T=1 at 82-86% alone). With bf16 activations they ran at 73%: vdpbf16ps issues at a quarter of the FMA rate on"
  echo "that core; int16 activations on vpdpwssd took them to ~80%. Matmul groups (the projections of one input in"
  echo "one pool dispatch: ~20 fewer barriers per token) measured within the noise there. Zen 5 VM (2026-12-01,"
  echo "before both changes): the bf16 GEMVs read at ~75-80% of the bandwidth inside the model against 84-88% in"
  echo "kernel_bench, the MXFP4 experts at ~60-70% against 82-84% alone; at 2 threads the caller waited ~12% of the"
  echo "parallel time at the ~64 barriers per token (the worker's half ~5% slower, starting 5-10 us later)."
  echo
  echo "Prefill of N random tokens from an empty cache (fresh state), in forward calls of up to $KIMI_CHUNK tokens as a"
  echo "chunked-prefill engine runs a long prompt, timed once per N. The per-layer columns come from timestamps at each"
  echo "layer's output, so a layer's time is its attention plus its MLP / MoE; rest = final norm and lm_head. The KDA"
  echo "layers' time per token should stay flat in N (fixed-size state, chunked kernel); the MLA layer's grows with N"
  echo "(attention over every earlier row). Roofline: the matmul peak (AMX tiles' where the bf16 matmul runs on them,"
  echo "else vdpbf16ps') over 2 x active params per token, the lm_head once per call, absorbed MLA attention FLOPs and"
  echo "KDA's 7 K V per token and head; with AMX the attention and KDA kernels (fp32 FMAs) and the weight reads bind"
  echo "long before that peak."
  echo
  echo "| model | threads | prompt tokens | prefill tok/s | us / token | KDA layers us / token | MLA layer us / token | rest us / token | roofline tok/s | % |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  printf "%s" "$kimi_prefill_rows"
  echo
  echo "The KDA prefill kernel alone at 1k, 8k and 32k tokens (kda_chunked rows of the kernel table above, one"
  echo "sequence): 32 heads x 128 is one Kimi Linear 48B layer at TP 1, 12 x 128 one Kimi K3 layer per rank at TP 8."
  echo
  echo "| measurement | kernel | achieved | roofline | % of roofline |"
  echo "|---|---|---|---|---|"
  grep '^| kda_chunked' <<<"$kernels" || true
  echo
  echo "<!-- end of section: kimi -->"
}

# Replaces section $1 of $OUT (between its marker comments) with the file $2, or inserts it before
# the heading $3 when the file has no such section yet.
replace_section() {
  /usr/bin/python3 - "$OUT" "$2" "$1" "$3" <<'PY'
import re, sys
out, part, name, before = sys.argv[1], open(sys.argv[2]).read(), sys.argv[3], sys.argv[4]
text = open(out).read()
marked = re.compile(r"<!-- bench/run.sh section: " + name + r" .*?<!-- end of section: " + name + r" -->\n", re.S)
if marked.search(text):
    text = marked.sub(lambda m: part, text)
elif before and "\n" + before in text:
    text = text.replace("\n" + before, "\n" + part + "\n" + before, 1)
else:
    text = text.rstrip("\n") + "\n\n" + part
open(out, "w").write(text)
PY
}

# ONLY=NAME: writes section NAME (made by the function $2) in place of its old text (or before the heading $3)
# and ends the run with the message $4.
replace_only_section() {
  "$2" > "$OUT.$1"
  # A section rerun alone may come from another machine than the header's: it says which.
  local stamp="_This section was rerun alone (ONLY=$1) on $(date -u +%Y-%m-%d) ($(git rev-parse --short HEAD 2>/dev/null || echo '?')), on $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //') with $(nproc) hardware threads; the header's machine may differ._"
  awk -v stamp="$stamp" 'NR == 1 { print; print ""; print stamp; next } { print }' "$OUT.$1" > "$OUT.$1.tmp"
  mv "$OUT.$1.tmp" "$OUT.$1"
  replace_section "$1" "$OUT.$1" "$3"
  rm -f "$OUT.$1"
  echo "$4"
  exit 0
}

if [[ "$ONLY" == cuda ]]; then
  [[ -n "$cuda_rows" ]] || { echo "ONLY=cuda: no GPU here (build/cuda_bench exits 77) and no CUDA_BENCH_OUTPUT file" >&2; exit 1; }
  cuda_section > "$OUT.cuda"
  replace_section cuda "$OUT.cuda" ""
  rm -f "$OUT.cuda"
  echo "replaced the CUDA section of $OUT"
  exit 0
fi

# The kernel table with its rooflines (a marked section: ONLY=kernels regenerates it alone).
kernel_section() {
  echo "<!-- bench/run.sh section: kernels (ONLY=kernels bench/run.sh regenerates it alone) -->"
  echo
  echo "## Kernels against this run's rooflines"
  echo
  echo "Rooflines are measured in the same run: memory read bandwidth (512 MiB in 2 MiB pages, summed with 512-bit loads,"
  echo "256-bit on CPUs without AVX-512,"
  echo "the best of five access patterns: one stream or 4 / 8 streams side by side per thread, with and without software"
  echo "prefetch; the kernel column names the winner) for T=1 matmul and attention (GB/s of weights or cache read), and the"
  echo "vdpbf16ps / vfmadd231ps peaks with 24 independent accumulators per thread for T=512 (GFLOPS; on AVX2-only CPUs the"
  echo "vfmadd231ps peak with 12 ymm accumulators, no bf16 row, and the matmul rows' roofline is that fp32 peak); where the CPU has AMX,"
  echo "the tdpbf16ps peak too (four independent tile accumulators), the roofline of cpu.matmul_amx_bf16's batched rows. Every"
  echo "vector probe loop is unrolled explicitly and checked by tests/ops/no_spill_test.cpp (at -O2 they used to keep accumulators"
  echo "in memory and read 2-3x low). Weight sets are cycled through >= 256 MiB and twice the L3 so every call reads DRAM,"
  echo "as decode does (also in 2 MiB pages)."
  echo "Shapes are [out, in]: 2048x10944 is DeepSeek-V2-Lite's dense down projection, 1408x2048 an expert's"
  echo "gate or up projection. MLA attention over the bf16 latent cache does ~30 flops per cache byte at"
  echo "16 heads, so its roofline is min(dot-product peak, bandwidth x 30): the peak of the dot products the kernel"
  echo "runs (cpu.mla_attention_avx512bf16: vdpbf16ps, its queries split into bf16 hi + lo and its probabilities rounded"
  echo "to bf16; its \`exact\` row is the fp32-FMA cpu.mla_attention_avx512 that --exact runs; AMX: the tile peak)."
  echo "A bandwidth row above 100% means the kernel (4 prefetched row streams) reads memory slightly"
  echo "faster than the best probe pattern."
  echo
  echo "$kernels"
  echo
  echo "cpu.matmul_avx512bf16 and cpu.matmul_amx_bf16 rows without a suffix run moat's default: activations rounded to bf16 once"
  echo "(normalized error ~4e-3; W16A16, W8A16, W4A16, as llama.cpp and GPU engines run). \`exact\` rows (fp32-accurate:"
  echo "\`moat --exact\`, the golden tests' mode) split them into bf16 hi + lo at T=1 (two dot products per weight vector)"
  echo "and run the 512-bit fp32-FMA GEMM of cpu.matmul_avx512fma at T=512 (its peak: half the bf16 one; until 2026-12-04"
  echo "they split at every T: of the bf16 peak at 1 / 2 threads, 1408x2048 bf16 26% / 26% -> 43% / 41%, fp8 10% / 10% -> 43% / 40%,"
  echo "2048x10944 bf16 25% / 24% -> 39% / 39%, fp8 7% / 7% -> 39% / 37%)."
  echo "cpu.matmul_avx2fma (CPUs without AVX-512 BF16: weights decoded to fp32 in registers for T <= 20 (fp8 10 on the exponent route, each code decoded once for two tokens, 4 through F16C; 4-bit 10-12), a packed 6 x 16"
  echo "fp32 GEMM beyond; on AVX-512F CPUs without BF16 it is cpu.matmul_avx512fma, whose packed GEMM is 12 x 32 in 512-bit FMAs)"
  echo "is fp32-accurate in both modes except in 4-bit decode, whose default quantizes x to int16 per 32 elements (an error"
  echo "below rounding x to bf16; its exact rows run the fp32 tile); its fp8 T=1 rows decode e4m3 by integer ops into fp32's"
  echo "exponent field on AMD CPUs (F16C conversions elsewhere). The other kernels are fp32-accurate always."
  echo "Its fp8 tiles multiply x by each row block's scales in fp32 (once per 128 rows; since 2026-12-05, before: each 128-column partial sum): in L2 on Zen 5 with AVX2 alone 1.23-1.31x (exponent route, T = 1-4), F16C 1.09x at T = 1 and 1.77x at 2-4 (token pairs now)."
  echo "Batched fp8 rows of cpu.matmul_avx512bf16 (T = 3-16) fold each 128-row block's scales into x (bf16(x x scale), the rounding x takes anyway) and decode every code once per group of up to 4 tokens (tile_fp8_wide; since 2026-12-05: before, a decode per token pair to 12 tokens and dequantized chunks past it; alternating runs, 1 and 2 threads: 0.52-1.03x the time, 0.60-0.90x at T = 8-16 on most shapes). T = 17-64: dequantized chunks."
  echo "Batched bf16 rows (T = 16-64) run the packed panels: since 2026-12-05 their packing reads whole panels through row pointers and each micro-kernel step prefetches a few lines of the next block (alternating runs, 2 threads: 0.71-0.92x the time of the burst prefetch before; matmul_avx512bf16.cpp, run_panel). These rows move with the VM's memory phase: compare rows of one run, and the probes above them. Since 2026-12-05 (after the run before this one) every panel call rounds x from fp32 straight into the micro-kernel's token tiles, split across the threads (pack_x_f32; in-process A/B at 2 threads: T = 48 / 512 0.93 / 0.87 of the time), and the decode tiles (T = 1-16) write their sums through a staging block in L1 that reaches y in whole vectors every 16 tiles (lane_tiles; 1 thread: T = 1 / 3 / 6 0.94 / 0.96 / 0.90 of the time, 2048x1408 T = 8 0.73). fp8 at K = 2048 and T = 6-8 was the weakest batched row in this run (~150-165 GFLOPS against 205-220 at K = 1408): two groups of 4 tokens re-read 4 rows of codes beside 24-32 KiB of scaled x. Since (after this run) such calls (K <= 4096, T = 5-12) take the groups over K in chunks whose x fits 12 KiB (kFp8WideXBytes; in-process A/B at 2 threads: T = 8 1.30-1.35x the rate, T = 6 1.05-1.17x; at 1 thread 1.34-1.39x in three runs of four; at K = 10944 chunks lost 5-22%, so wide matrices keep whole rows)."
  echo
  echo "Prefill GEMM: moat's own kernels, oneDNN and OpenBLAS are not linked. Where the CPU has AMX (this run's"
  echo "machine when an AMX peak row is shown) calls of more than 5 tokens (bf16; 8 for fp8, 11 for 4-bit) run on AMX-BF16 tiles"
  echo "(cpu.matmul_amx_bf16: bf16 and fp8 take 16-row strips of the weights as A tiles, in place or staged as bf16 rows, 4-bit"
  echo "to 128 tokens too; f16 and longer 4-bit calls take the AVX-512 kernel's packed weight panels, the B tiles' layout); the"
  echo "cpu.matmul_avx512bf16 rows at T=512 beside them are the same shapes on AVX-512 BF16 in the same run. On the panels the"
  echo "AMX rows reached ~15-25% of the tile peak (the 16x16 transpose per 16 rows x 32 columns and the tile loads bound them);"
  echo "the strips, since 2026-12-05, ran 1.2-2.2x the panels' rate (docs/architecture.md; no AMX run of this table since)."
  echo "An exact row on the AMX kernel runs the AVX-512 tiles (the hi + lo split is"
  echo "not done on AMX) and is set against the vdpbf16ps peak. DESIGN.md's toolchain facts: oneDNN 2.6 bf16 2048^3"
  echo "reaches ~200 GFLOPS with 2 threads on a busy Zen machine and Debian's OpenBLAS has no sbgemm."
  echo
  echo
  echo "Load average before / after this kernel run: $load_before / $load_after."
  echo
  echo "<!-- end of section: kernels -->"
}
if [[ "$ONLY" == kernels ]]; then
  replace_only_section kernels kernel_section "## Model decode and prefill" \
    "replaced the kernel section of $OUT (load average $load_before before the kernel run, $load_after after)"
fi
if [[ "$ONLY" == model ]]; then
  replace_only_section model model_section "## Side by side with llama.cpp (same weights)" \
    "replaced the model decode and prefill rows of $OUT"
fi

if [[ "$ONLY" == kimi ]]; then
  [[ -n "$kimi_decode_rows" ]] || { echo "ONLY=kimi: no Kimi checkpoint at '$KIMI'" >&2; exit 1; }
  replace_only_section kimi kimi_section "## moat serve over HTTP" \
    "replaced the Kimi section of $OUT (load average $load_before before the kernel probes, $load_after after)"
fi

# Side by side with llama.cpp on the same weights (bench/llama_cpp_peer.sh): llama-bench and model_bench
# alternating per thread count, bf16 GGUF against the bf16 checkpoint and Q8_0 against FP8. Skipped, with a
# note in the section, when LLAMA_CPP_DIR is unset (llama.cpp is built by the user outside this repository).
peer_rows="" peer_note=""
if [[ -z "$ONLY" || "$ONLY" == peer ]]; then
  if [[ -z "${LLAMA_CPP_DIR:-}" ]]; then
    peer_note="Not measured in this run: LLAMA_CPP_DIR was not set (see bench/llama_cpp_peer.sh)."
    echo "bench/run.sh: skipping the llama.cpp peer section: LLAMA_CPP_DIR is unset" >&2
  elif ! peer_rows=$(BUILD_DIR="$BUILD_DIR" THREADS="$THREADS" bench/llama_cpp_peer.sh); then
    peer_rows=""
    peer_note="Not measured in this run: bench/llama_cpp_peer.sh failed (LLAMA_CPP_DIR=$LLAMA_CPP_DIR)."
    echo "bench/run.sh: bench/llama_cpp_peer.sh failed; the peer section says so" >&2
  fi
fi
peer_section() {
  echo "<!-- bench/run.sh section: peer (ONLY=peer bench/run.sh regenerates it alone) -->"
  echo
  echo "## Side by side with llama.cpp (same weights)"
  echo
  if [[ -z "$peer_rows" ]]; then
    echo "$peer_note"
  else
    echo "bench/llama_cpp_peer.sh: llama.cpp's llama-bench (CPU backend, native ISA, built outside this repository; or"
    echo "bench/libllama_bench, the same pp / tg tests over libllama, where the tree has no tools/: the line under the"
    echo "table says which) and moat's model_bench on the same weights, in one run, the engines alternating per thread count. bf16: the"
    echo "bench checkpoint, converted by bench/gguf_from_hf.py to a BF16 GGUF (norms and router f32, as llama.cpp's own"
    echo "converter writes them). FP8 vs Q8_0: the FP8 bench checkpoint (e4m3, 128x128 block scales) for moat; for"
    echo "llama.cpp its FP8 matrices dequantized and quantized to Q8_0 (8.5 bits a weight), the embedding and lm_head"
    echo "bf16 in both. Random token ids in both. Prefill: one prompt from an empty cache; decode: one stream after the"
    echo "prompt's tokens in the cache (llama.cpp: tg at depth -d of the prompt's length), greedy in moat, random ids in llama.cpp."
    echo "llama.cpp runs with its weights mmapped and read into memory (llama-bench -lm mmap,none) and each row shows"
    echo "the better one: the median of its repetitions, their range and the load mode; moat's rows are the median and range"
    echo "of as many repetitions in one process (model_bench --repetitions). Both engines' files are dropped"
    echo "from the page cache first (with the GGUF in 4 KiB pages, llama.cpp's mmap decode ran at half speed here)."
    echo "The last column is moat's median against its own roofline, measured by model_bench in the same process: prefill"
    echo "against the matmul peak probe (vdpbf16ps chains; or the weights' bytes, whichever bounds it), decode against the"
    echo "one-pass bandwidth probes of the weights' memory read around the repetitions (issue 12's target: 80%)."
    echo
    echo "$peer_rows"
    echo
    echo "What limits each engine's rows. This table: AMD EPYC Zen 5 (2026-12-05; AVX-512 with BF16, no AMX; llama.cpp from the"
    echo "npm package @novastera-oss/llamarn 0.10.5, ggml 0.22.0, built with GGML_NATIVE). moat runs cpu.matmul_avx512bf16"
    echo "(vdpbf16ps on bf16 activations; fp8 codes turned into bf16 by byte-table lookups in registers) and"
    echo "cpu.mla_attention_avx512bf16. Decode is bound by the memory in moat: its rows read 82-88% of the one-pass probes of the"
    echo "same process (the last column). bf16: both engines stream the same 1.41 GB a token, so llama.cpp's 17.9 / 24.2 tok/s"
    echo "are 66% / 47% of that same roofline (27.0 / 51.3 tok/s). FP8 against Q8_0: moat streams ~0.93 GB a token (e4m3 at 1"
    echo "byte a weight, the 420 MB bf16 lm_head, the bf16 per-head MLA matrices), llama.cpp ~0.96 (Q8_0 at 1.0625 bytes a"
    echo "weight, the same bf16 matrices), so where both engines read the same share of the bandwidth moat leads by ~3%; here"
    echo "llama.cpp's Q8_0 decode reads ~67% / ~42% of the probes at 1 / 2 threads and moat 82% / 84%. Prefill is compute-bound"
    echo "in both: moat's rows reach 57-69% of the vdpbf16ps peak (MLA attention, norms and routing, and the experts' calls of"
    echo "~48 tokens on packed panels), llama.cpp's Q8_0 runs on int8 dot products and its bf16 on the AVX-512 BF16 dot product."
    echo "The rows move by 10-15% between runs on these VMs; this machine's runs since 2026-12-03 (before the weights were"
    echo "copied onto cache lines at load and before the decode tiles' staging): bf16 decode 1.00-1.21x / 1.39-1.72x, FP8 decode"
    echo "1.09-1.56x / 1.38-1.62x, prefill 1.8-2.1x (bf16) and 1.8-2.6x (FP8)."
    echo
    echo "AVX2 alone, both engines, on this machine (the same run's hour; a stand-in for AVX2-only CPUs such as Zen 2 / 3: moat"
    echo "with MOAT_DISABLE_ISA=amx-bf16,avx512bf16,avx512, so cpu.matmul_avx2fma, fp32 FMAs on weights decoded in registers or"
    echo "packed; llama.cpp's libllama rebuilt with GGML_NATIVE=OFF GGML_AVX2=ON GGML_AVX512=OFF; one run of"
    echo "bench/llama_cpp_peer.sh, the same settings as above; the roofline column against the ymm FMA peak and the bandwidth):"
    echo
    echo "| measure | moat tok/s | llama.cpp tok/s | moat / llama.cpp | moat, % of its roofline |"
    echo "|---|---|---|---|---|"
    echo "| bf16 prefill 512 tokens, 1 thread | 87.8 (43.3-88.8, mmap) | 50.9 (49.6-51.9, mmap) | 1.72 | 80% |"
    echo "| bf16 prefill 512 tokens, 2 threads | 116.4 (101.1-147.0, mmap) | 99.4 (89.5-100.2, mmap) | 1.17 | 55% |"
    echo "| bf16 decode 128 tokens, 1 thread | 20.6 (19.1-22.8, mmap) | 16.3 (15.5-16.4, mmap) | 1.26 | 85% |"
    echo "| bf16 decode 128 tokens, 2 threads | 34.6 (34.1-38.3, mmap) | 20.5 (19.2-21.6, mmap) | 1.69 | 84% |"
    echo "| FP8 (moat) vs Q8_0 (llama.cpp) prefill 512 tokens, 1 thread | 77.1 (74.0-82.5, mmap) | 77.9 (73.7-79.1, mmap) | 0.99 | 72% |"
    echo "| FP8 (moat) vs Q8_0 (llama.cpp) prefill 512 tokens, 2 threads | 147.4 (145.4-156.3, mmap) | 143.2 (134.7-148.1, mmap) | 1.03 | 71% |"
    echo "| FP8 (moat) vs Q8_0 (llama.cpp) decode 128 tokens, 1 thread | 25.3 (22.1-26.9, mmap) | 20.3 (17.5-23.1, none) | 1.25 | 70% |"
    echo "| FP8 (moat) vs Q8_0 (llama.cpp) decode 128 tokens, 2 threads | 40.3 (37.7-42.9, mmap) | 29.6 (28.2-31.0, mmap) | 1.36 | 72% |"
    echo
    echo "There the FP8 prefill misses issue 12's 1.2x: it is compute-bound on fp32 FMAs (8 multiply-adds an instruction), while"
    echo "llama.cpp's Q8_0 runs int8 dot products (vpmaddubsw: 32 products an instruction against an FMA's 8). model_bench --profile half an hour later (1 thread, with the packing change below:"
    echo "85.6 tok/s, 83% of the FMA roofline: 536 GFLOP a"
    echo "prompt against a 108 GFLOPS peak): the dense matmuls 2.32 s (~92% of the FMA peak by their FLOPs), the routed experts"
    echo "3.12 s, MLA attention 0.41 s (7%), per-head matmuls 0.16 s. At 100% of the FMA roofline the prompt would take 4.9 s"
    echo "(103.5 tok/s, 1.33x this llama.cpp), so the fp32 route cannot hold 1.2x on such CPUs. A prefill on int16 dot products"
    echo "(x and each column's codes int16 per 32 elements, vpmaddwd + vpaddd; not exact, as e4m3 spans 18 bits) was built on"
    echo "2026-12-05 and measured on an Intel Xeon (Emerald Rapids-class; the AVX2 entry called directly, 1 thread): 0.55-0.62x the"
    echo "fp32 GEMM at T = 48 and 0.8x at T = 512, because vpmaddwd ymm issues once a cycle there (10 independent chains: 1.92 G/s"
    echo "against 4.17 G/s of vfmadd ymm), 16 multiply-adds a cycle as the two FMA pipes give, with the adds on top. It stays off"
    echo "main (git branch avx2-fp8-int16, tests included) until an AVX2-only CPU with two vpmaddwd pipes can measure it."
    echo "The bf16 2-thread prefill row's repetitions ranged 101-147 tok/s (the VM's phases); its median is 55% of the"
    echo "roofline where the 1-thread row reads 80%. FP8 decode on AVX2 is compute-bound at 70-72% of the bandwidth on this"
    echo "machine (each e4m3 code becomes fp32 by shifts and masks into fp32's exponent field: exact, subnormals included; 9"
    echo "integer instructions per 32 weights beside the FMAs), yet ahead of llama.cpp's Q8_0 there."
    echo "Real Zen 3 (2026-12-03, before the fp8 tiles read x scaled per row block (1.23x on the exponent tile) and before the"
    echo "decode tiles' staging; one run, moat one measurement, llama.cpp's decode from an empty cache; 18-28 / 33-40 GB/s):"
    echo "bf16 prefill 1.71x / 1.80x, decode 1.44x / 1.28x; FP8 vs Q8_0 prefill 1.19x / 1.20x, decode 1.10x / 1.05x (moat's FP8"
    echo "decode compute-bound at one thread at ~21 G weights/s against 28 GB/s of memory; at two threads both engines bound by"
    echo "the bandwidth, where the bytes allow moat ~3%); moat's bf16 matmuls read 90-92% of the bandwidth inside the model."
    echo "The packed GEMM moat's AVX2 prefill runs had packed 4 panels per k block: since 2026-12-05 (after the runs above) calls"
    echo "whose x passes 6 MiB pack 16 (K = 10944 at T = 512: 77 -> 92 GFLOPS at 1 thread on this machine, matmul_avx2.cpp)."
    echo "Intel Xeon (Emerald Rapids-class, 2026-12-05, after that change) with AVX2 alone in both engines (moat as above; libllama"
    echo "built GGML_NATIVE=OFF GGML_AVX2=ON GGML_AVX512=OFF GGML_AVX_VNNI=OFF; one run of bench/llama_cpp_peer.sh, 1 / 2 threads):"
    echo "bf16 prefill 2.28x / 1.98x (56.1 / 91.5 tok/s against 24.6 / 46.1), decode 2.02x / 1.65x (9.0 / 15.3 against 4.5 / 9.3;"
    echo "moat at 82% / 80% of its bandwidth probes); FP8 vs Q8_0 prefill 1.29x / 1.36x (65.5 / 132.8 against 50.7 / 97.4; moat"
    echo "at 76% / 73% of the ymm FMA roofline), decode 1.50x / 1.83x (11.0 / 25.7 against 7.4 / 14.0; moat's fp8 tiles on the F16C"
    echo "route Intel keeps are compute-bound there at 66% / 69% of the bandwidth). On that core every AVX2 target holds; the FP8"
    echo "prefill's miss is the Zen 5 stand-in's above, whose llama.cpp Q8_0 ran 1.5x this one's per thread."
    echo
    echo "Intel Xeon with AMX (Emerald Rapids-class, 2026-12-05 17:25, after the kernels' scratch buffers were put on cache"
    echo "lines; the same llama.cpp built with GGML_NATIVE; one run of bench/llama_cpp_peer.sh, 1 / 2 threads): bf16 prefill"
    echo "6.93x / 5.16x (361.8 / 522.6 tok/s against 52.2 / 101.3), decode 1.49x / 1.36x (9.9 / 17.6 against 6.7 / 13.0; moat at"
    echo "88% / 86% of its bandwidth probes); FP8 vs Q8_0 prefill 5.90x / 4.31x (334.9 / 445.9 against 56.7 / 103.3), decode"
    echo "1.69x / 1.45x (13.8 / 24.7 against 8.2 / 17.0; moat at 81% / 75%). The same VM earlier that day, before that change: bf16"
    echo "prefill 5.52x / 5.58x (197.6 / 402.6 against 35.8 / 72.2), decode 1.41x / 1.50x (79% / 82%), FP8 vs Q8_0 prefill 6.33x"
    echo "/ 3.67x, decode 1.51x / 1.45x (75% / 76%); llama.cpp itself ran 1.1-1.5x faster in the later run, so only ratios"
    echo "within one run compare. What the change fixed: std::vector's memory is 16-byte aligned, so every 64-byte row of the"
    echo "AMX strips' packed x and staged weights straddled two cache lines, and a tile load off line boundaries took twice as"
    echo "long (a 16-row tileloadd from L1 ~40 TSC cycles, a tdpbf16ps ~15; on lines the loads hide behind the multiplies: 2 A +"
    echo "2 B tile loads per 4 multiplies ran 2.3-2.5 TFLOPS on one core, as the multiplies alone). 64 experts' 1408 x 2048 bf16"
    echo "matrices from memory, 48 tokens each: 126 -> 91 ms a layer; the model's prefill in alternating runs of the two builds:"
    echo "0.88x / 0.94x the time at 1 thread, ~1.2x the rate at 2 (base/aligned_vector.h). moat's prefill still reads only 28% /"
    echo "20% of its roofline column (bf16, the AMX peak probe; FP8 15% / 12%), where this VM's AMX rate, probes included,"
    echo "swings 2-2.5x within seconds. perf puts half of the bf16 prefill in the routed experts' strips, whose weight tile"
    echo "loads wait on memory (23% of the strips' samples on the instruction after that load), and whose rows per expert range"
    echo "1-250 on random tokens, each expert rounded up to 16-token tiles: a layer's 64 experts from memory took 128-134 ms"
    echo "with the rows as routed against 106 ms at 48 rows each in the same minute (~80 ms to read them at the probes'"
    echo "bandwidth). The dense calls of 512 tokens run on staged strips whose x (2 MiB at K = 2048) streams from beyond L2 for"
    echo "every 32 rows; splitting them into 256-token halves (x in L2) ran 1.2-1.4x at K = 2048-2816 alone but lost at K >="
    echo "7168 and did not speed the model's prefill in alternating runs, and rotating x through the tiles no sum uses (no tile"
    echo "reloaded within a half step) ran 1.05-1.4x slower: neither is kept. An earlier AMX VM (2026-12-02, before the strips):"
    echo "bf16 prefill 4.38x / 3.28x, decode 1.27x / 1.31x, FP8 vs Q8_0 prefill 2.51x / 2.54x, decode 1.41x / 1.61x; moat's"
    echo "bf16 decode at 89% / 84% of the bandwidth roofline of the model section, llama.cpp's at 70% / 64% of it. moat's prefill runs on"
    echo "AMX tiles, while llama.cpp's AMX buffers take only quantized types (its loader keeps bf16 tensors in plain CPU"
    echo "buffers), so its bf16 prefill runs on AVX-512 dot products. llama.cpp's Q8_0 rows run with -nr 1 (no extra buffer"
    echo "types): with its AMX buffers the scheduler aborts on this deepseek2 GGUF (GGML_ASSERT cur_backend_id != -1), so its"
    echo "Q8_0 decode is the AVX-512 VNNI dot product without repacking."
    echo "What had held moat's decode back on Zen 5 before 2026-12-04 was alignment: the bench checkpoint's shards 2-4 start"
    echo "their tensor data 16, 24 and 56 bytes past a cache line (a safetensors header pads only to 8 bytes), so every 64-byte"
    echo "load of a weight row touched two lines; moat copies misaligned matrices onto cache lines at load"
    echo "(docs/architecture.md, \"Weights start on cache lines\"; 1 thread decode 20.4-22.0 -> 23.6-24.8 tok/s)."
  fi
  echo
  echo "<!-- end of section: peer -->"
}
if [[ "$ONLY" == peer ]]; then
  [[ -n "$peer_rows" ]] || { echo "ONLY=peer: $peer_note" >&2; exit 1; }
  replace_only_section peer peer_section "## Serving throughput (engine core, no HTTP)" \
    "replaced the llama.cpp peer section of $OUT"
fi

# Tensor parallelism (bench/tp_bench.sh): TP 2 under mpirun against TP 1 on the same two cores,
# and the modelled all-reduce cost of Kimi K3 at TP 8. Needs mpirun and checkpoints/bench-serve
# (bench/serve_bench.sh links a tokenizer beside the bench checkpoint).
tp_section() {
  local rows
  rows=$(BUILD_DIR="$BUILD_DIR" bench/tp_bench.sh) || return 1
  echo "<!-- bench/run.sh section: tp (ONLY=tp bench/run.sh regenerates it alone) -->"
  echo
  echo "## Tensor and expert parallelism (MPI ranks on one machine)"
  echo
  echo "$rows"
  echo
  echo "<!-- end of section: tp -->"
}
if [[ "$ONLY" == tp ]]; then
  cmake --build "$BUILD_DIR" --target moat -j2 >/dev/null
  replace_only_section tp tp_section "" "replaced the tensor-parallel section of $OUT"
fi

# Serving throughput through the engine core (bench/engine_bench.cpp): closed loop at each
# concurrency, prompt 128 + output 64 tokens, next to the decode-step roofline of that batch.
ENGINE_MODELS=${ENGINE_MODELS:-checkpoints/bench checkpoints/bench-fp8}
ENGINE_THREADS=${ENGINE_THREADS:-2}
ENGINE_CONCURRENCY=${ENGINE_CONCURRENCY:-1,4,16,64}
cmake --build "$BUILD_DIR" --target engine_bench -j2 >/dev/null
engine_benchmarks() {
  echo "| model | threads | concurrency | requests | output tok/s | tok/s per stream | TTFT p50 / p99 ms | ITL p50 / p99 ms | step roofline tok/s | % | decode step / roofline ms | % |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
  for model in $ENGINE_MODELS; do
    if [[ ! -f "$model/config.json" ]]; then
      echo "| $model | - | - | - | not generated on this machine (see bench/run.sh) | | | | | | | |"
      continue
    fi
    "$BUILD_DIR/engine_bench" --model "$model" --threads "$ENGINE_THREADS" --concurrency "$ENGINE_CONCURRENCY" --markdown
    # a smaller token budget per step bounds the steps that carry a prompt chunk (ITL p99)
    "$BUILD_DIR/engine_bench" --model "$model" --threads "$ENGINE_THREADS" --concurrency 64 \
      --max-num-batched-tokens 256 --markdown
  done
}
engine_rows=""
[[ "$ONLY" == spec ]] || engine_rows=$(engine_benchmarks)

# Speculative decoding at one stream (bench/spec_bench.cpp): the shipped pair with its draft and
# n-gram lookup at one thread, and n-gram and the MTP head on the bench checkpoint with an MTP layer
# at ENGINE_THREADS, each next to its cost model; then where a verification forward's time goes
# (spec_bench --profile) on the shipped target. The MTP checkpoint is the bench checkpoint (its
# shards linked, so the two share the page cache) plus DeepSeek-V3's MTP layer (random weights: its
# guesses are never accepted, the rows measure the cost), generated here when missing (~10 s, 2 GB):
#   tools/make_checkpoint.py --mtp-over checkpoints/bench --out checkpoints/bench-mtp
BENCH_MTP=${BENCH_MTP:-checkpoints/bench-mtp}
cmake --build "$BUILD_DIR" --target spec_bench -j2 >/dev/null
spec_benchmarks() {
  echo "| target | draft | temperature | proposer | k | decode tok/s | speedup | accepted % | tokens / step | guesses / step | verify / step | proposer step / step | predicted |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  "$BUILD_DIR/spec_bench" --model models/k3-nano --draft models/k3-nano-draft --threads 1 --k 2,4,6 \
    --temperatures 0,0.7 --markdown
  if [[ -f checkpoints/bench/config.json && ! -f "$BENCH_MTP/config.json" ]]; then
    /usr/bin/python3 tools/make_checkpoint.py --mtp-over checkpoints/bench --out "$BENCH_MTP" >/dev/null
  fi
  if [[ -f "$BENCH_MTP/config.json" ]]; then
    "$BUILD_DIR/spec_bench" --model "$BENCH_MTP" --threads "$ENGINE_THREADS" --k 1,2,4 --temperatures 0 --tokens 64 \
      --markdown
  fi
  echo
  echo "Where the verification forward's time goes (\`spec_bench --profile\`, the target forward over 1 and k + 1"
  echo "tokens at the mean context, ms by kind of op, one thread, the same run):"
  echo
  echo '```'
  "$BUILD_DIR/spec_bench" --model models/k3-nano --threads 1 --k 2,4,6 --profile
  echo '```'
}
spec_rows=""
[[ -z "$ONLY" || "$ONLY" == spec ]] && spec_rows=$(spec_benchmarks)
spec_section() {
  echo "<!-- bench/run.sh section: spec (ONLY=spec bench/run.sh regenerates it alone) -->"
  echo
  echo "$spec_rows"
  echo
  echo "<!-- end of section: spec -->"
}
if [[ "$ONLY" == spec ]]; then
  replace_only_section spec spec_section "## Kimi Linear (hybrid KDA + MLA, MXFP4 experts)" \
    "replaced the speculative-decoding rows of $OUT"
fi

# moat serve over HTTP (bench/serve_bench.sh: moat bench against moat serve on the bench
# checkpoint, the engine_bench workload: 2 requests per stream), and the HTTP overhead against
# the engine_bench rows above. SERVE=0 skips it (the checkpoint loads a second time: minutes).
serve_rows=""
if [[ "${SERVE:-1}" != 0 && -f checkpoints/bench/config.json ]]; then
  cmake --build "$BUILD_DIR" --target moat -j2 >/dev/null
  serve_dir=$(mktemp -d)
  serve_rows=$(BUILD_DIR="$BUILD_DIR" MODEL=checkpoints/bench CONCURRENCY="$ENGINE_CONCURRENCY" PROMPTS_PER_STREAM=2 \
               OUT_DIR="$serve_dir" SERVE_ARGS="--threads $ENGINE_THREADS" bench/serve_bench.sh 2>/dev/null)
  # the overhead pairs engine core and server runs back to back (bench/http_overhead.sh): the
  # sweeps above run minutes apart, and this VM's bandwidth drifts more than the overhead between them
  overhead=$(BUILD_DIR="$BUILD_DIR" MODEL=checkpoints/bench CONCURRENCY=1,64 REPS="${OVERHEAD_REPS:-3}" \
             THREADS="$ENGINE_THREADS" bench/http_overhead.sh 2>/dev/null) ||
    overhead="bench/http_overhead.sh failed: rerun it by hand to see why"
  mkdir -p docs
  cp "$serve_dir/bench_serve.png" docs/bench_serve.png
  rm -rf "$serve_dir"
fi

serve_section() {
  echo "<!-- bench/run.sh section: serve (ONLY=serve bench/run.sh regenerates it alone) -->"
  echo
  echo "## moat serve over HTTP"
  echo
  echo "bench/serve_bench.sh: \`moat bench\` against \`moat serve --threads $ENGINE_THREADS\` on the bench checkpoint"
  echo "(a tokenizer from the test data linked beside it), random prompts of exactly 128 tokens, 64 output tokens"
  echo "(ignore_eos), two requests per stream as bench/engine_bench: the same workload through HTTP, SSE streaming"
  echo "and detokenization. TTFT and ITL here are measured by the client."
  echo
  echo "$serve_rows"
  echo
  echo "HTTP overhead (bench/http_overhead.sh): output tok/s of the server against the engine core alone, the"
  echo "same workload run back to back (engine core, then server, ${OVERHEAD_REPS:-3} times per concurrency): the two"
  echo "sweeps above run minutes apart, and this VM's memory bandwidth drifts by more than the overhead over"
  echo "minutes, so only the paired ratios count. The target is serve / engine >= 0.95."
  echo
  echo "$overhead"
  echo
  echo "Throughput against interactivity, the plot \`moat bench --plot\` draws from the same sweep (output tok/s of"
  echo "the server against tok/s per stream, one point per concurrency):"
  echo
  echo "![moat serve: output tok/s against tok/s per stream](docs/bench_serve.png)"
  echo
  echo "<!-- end of section: serve -->"
}

if [[ "$ONLY" == serve ]]; then
  [[ -n "$serve_rows" ]] || { echo "ONLY=serve: no checkpoint at checkpoints/bench (or SERVE=0)" >&2; exit 1; }
  engine_section() {
    echo "<!-- bench/run.sh section: engine (ONLY=serve bench/run.sh regenerates it with the serve section) -->"
    echo
    echo "$engine_rows"
    echo
    echo "<!-- end of section: engine -->"
  }
  engine_section > "$OUT.engine"
  serve_section > "$OUT.serve"
  replace_section engine "$OUT.engine" ""
  replace_section serve "$OUT.serve" ""
  rm -f "$OUT.engine" "$OUT.serve"
  echo "replaced the engine-core and serve sections of $OUT"
  exit 0
fi

{
  echo "# Benchmarks"
  echo
  echo "GENERATED by \`bench/run.sh\` on $(date -u +%Y-%m-%d) ($(git rev-parse --short HEAD 2>/dev/null || echo '?')); do not edit by hand."
  echo
  echo "- Machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) hardware threads," \
       "$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)," \
       "$(lscpu 2>/dev/null | awk -F: '/Thread\(s\) per core/ {gsub(/ /, "", $2); print $2}') thread(s) per core" \
       "(when 2 threads add nothing over 1, the two hardware threads share one core or the other is busy)"
  echo "- Load average before / after the kernel run: $load_before / $load_after" \
       "(a busy machine shows much lower bandwidth and peak; compare rows only within one run)"
  echo
  kernel_section
  echo
  echo "## Model decode and prefill"
  echo
  echo "One stream, greedy, random prompt of 512 tokens then 32 decode steps."
  echo "Rooflines are measured inside each row's process: decode = bandwidth / (active weight bytes +"
  echo "bf16 latent cache read per token + a hybrid's recurrent state read and written), the bandwidth of summing the weights' own memory (every file's"
  echo "mapping, or the --no-mmap copy). On this VM that differs run to run by where the memory landed:"
  echo "a fully 2 MiB-mapped page-cache file has read at 11 GB/s while a fresh buffer read at 16 GB/s (host"
  echo "paging the guest cannot see); both are shown (best of 3 rounds of each read pattern, after the run). It also"
  echo "drifts 10-30% from minute to minute, so decode's roofline and % use one-pass probes of the weights' memory"
  echo "(each pattern once, the best) taken just before and just after the timed decode: the % is its bytes per second"
  echo "over the mean of the two. prefill = the slower of FLOPs / matmul peak (2 x active params"
  echo "x 512, the lm_head once, + absorbed attention FLOPs, at the AMX tile peak where the bf16 matmul resolves to"
  echo "cpu.matmul_amx_bf16, else the vdpbf16ps peak) and the weight bytes the prompt's forward reads (a MoE's experts"
  echo "touched by any of its tokens: nearly all at 512 tokens) / bandwidth. With AMX the bytes bind the bench models'"
  echo "prefill (6.4 GB of weights at ~17.5 GB/s: ~1400 tok/s at 1 thread); exact rows run AVX-512 (no hi + lo split on"
  echo "AMX), so their % is against a roofline they cannot reach. On the AMX machine of the"
  echo "2026-12-02 run, AMX prefill is 6.0x / 5.1x (1 / 2 threads) the exact (AVX-512, two dot products) rows; \`MOAT_DISABLE_ISA=amx-bf16\` runs the"
  echo "default on AVX-512 BF16 alone: 89.8 tok/s against 278 with AMX at 1 thread, in one earlier run on the same"
  echo "machine. What bounds it: perf on the 1-thread prefill puts pack_panel (the weights read from memory and"
  echo "transposed into the B tiles' layout) about level with the tile loop, and the routed experts get ~48 tokens"
  echo "each at 512 tokens x 6 of 64 experts, where an AMX call runs at ~400 GFLOPS from memory (kernel table, T=64"
  echo "rows). Since 2026-12-05 the AMX calls read the weights in strips instead of transposing them (1-thread prefill"
  echo "160-202 -> 247 tok/s bf16 and 162-168 -> 208-229 FP8, old and new binaries alternating on an Emerald Rapids-class VM)."
  echo "Prefill attention runs on AMX tiles too (cpu.mla_attention_amx, flash attention over the packed"
  echo "latent rows): \`model_bench --profile\` put it at 481 of 2165 ms of a 512-token prefill on the AVX-512 kernel"
  echo "and at 116 ms on the tiles, at 2048 tokens 7.8 s of 14.5 s before and 2.1 s after (2026-12-02, 1 thread; old"
  echo "and new binaries alternating on a slowed VM: 2048-token prefill 79 -> 179 tok/s)."
  echo "k3-nano (11 MiB) fits in the caches, so its DRAM roofline is only indicative."
  echo "The table's last rerun (2026-12-05, after the kernels' scratch buffers went onto cache lines) came from an Intel Xeon VM"
  echo "(Emerald Rapids-class, AMX, 16 GB/s a thread): its default rows run cpu.matmul_amx_bf16, and the prefill rooflines are"
  echo "the AMX peak probe's (2.1-4.4 TFLOPS), hence the low % of the AMX rows; the prose below on the fp8 exponent route and"
  echo "F16C describes the Zen 5 VM's rows, where the other sections come from."
  echo "Rows marked \`(MOAT_DISABLE_ISA=amx-bf16,avx512bf16)\` run as an AVX-512F server without BF16 dot products does"
  echo "(Skylake-SP, Cascade Lake, Ice Lake): cpu.matmul_avx512fma, fp32 FMAs on weights decoded in registers (decode) or"
  echo "packed (prefill, 512-bit), against the 512-bit FMA peak. Before that kernel (2026-12-04, alternating runs, 2 threads)"
  echo "such a prefill ran on 256-bit FMAs at 157-171 tok/s against 268-281. Its fp8 decode reads 66-68% of the bandwidth here (60-67% before its tiles took x scaled per row block, 2026-12-05):"
  echo "on AMD the codes go through the exponent route in ymm registers, compute-bound. Intel servers take F16C instead, which"
  echo "has a 512-bit tile: with MOAT_FP8_DECODE=f16c on this Zen 5 (alternating runs) decode 21.4 -> 26.3-26.6 tok/s at 1"
  echo "thread, 35.0-35.2 -> 43.5-50.3 at 2, against the ymm F16C tile."
  echo "RSS ratio = peak RSS / (checkpoint + KV pool); weights are mmapped, not copied."
  echo "\`default\` activations (OpTable::set_exact_activations: per model): rounded to bf16 once for the bf16 dot"
  echo "products (W16A16, W8A16, W4A16), as llama.cpp and GPU engines run them. \`exact\` rows"
  echo "(\`--exact\`, what the golden tests hold to 1e-3) keep every matmul fp32-accurate: decode-sized calls split x"
  echo "into bf16 hi + lo (two dot products per weight vector; the fp8 decode GEMV becomes compute-bound), calls of"
  echo "more tokens (bf16 from 25, fp8 from 8, 4-bit from 32) run the 512-bit fp32-FMA GEMM of cpu.matmul_avx512fma,"
  echo "whose peak is half the bf16 one (before 2026-12-04 they split too: fp8 exact prefill 98 -> 247 tok/s, bf16 258"
  echo "-> 270, 2 threads, alternating runs). \`mmap\` maps the checkpoint (the"
  echo "default, zero copy) at a 2 MiB-aligned address and populates it at load, so the page cache's 2 MiB"
  echo "folios are mapped whole (the % column: share of resident weights in 2 MiB pages; 4 KiB pages cost"
  echo "a TLB miss per page, ~20% of decode speed on this VM). \`in memory\` reads the checkpoint into"
  echo "anonymous huge-page memory (\`--no-mmap\`): the same RSS."
  echo
  model_section
  echo
  peer_section
  echo
  echo "## Serving throughput (engine core, no HTTP)"
  echo
  echo "bench/engine_bench: random prompts of 128 tokens, 64 greedy output tokens each, two requests per"
  echo "stream, closed loop (a finished request is replaced at once, so new prompts keep arriving while"
  echo "the others decode: chunked prefill under load). TTFT and ITL are measured at step granularity."
  echo "Step roofline: a decode step of B streams reads every weight outside the routed experts once, the"
  echo "experts its B tokens touch (E x (1 - (1 - k/E)^B) per MoE layer: random weights route uniformly),"
  echo "and each stream's latent cache; it does B tokens' FLOPs; its time is the larger of bytes / bandwidth"
  echo "and FLOPs / the matmul peak (AMX, vdpbf16ps or fp32 FMAs, as the matmuls run; both probed in the same process), and the roofline is B / that time. Prefill"
  echo "steps of the arriving prompts share the time, so the first % understates decode efficiency at high load;"
  echo "the last two columns take only the steps that decoded every stream and prefilled nothing: their mean"
  echo "time against the roofline step time (B / step roofline). The \`(budget 256)\` row runs 64 streams with"
  echo "\`--max-num-batched-tokens 256\` instead of the default 512: a step that carries a prompt chunk is shorter,"
  echo "so the p99 inter-token latency drops, for a longer time to first token."
  echo "The rows are from the Zen 5 VM (2026-12-05, AVX-512 BF16). What limits them, from \`engine_bench --profile\` (the"
  echo "decode-only steps split by kind of op, same day, alternating runs of the builds before and after the day's panel changes):"
  echo "a 16-stream bf16 step (100-115 ms against a ~65 ms roofline) is the routed experts' 66-77 ms (4.4 GB of weights: ~50 of 64"
  echo "experts per layer, 1-3 rows each, on the decode tiles at 71-89% of the bandwidth) and the dense matmuls' 29-33 ms (868 MB"
  echo "at 16 tokens on packed panels, compute-bound at ~50% of the bf16 peak; 39-49 ms before: the panels' packing waited on"
  echo "memory because its prefetches, issued in one burst of 512 lines per block, mostly went nowhere; matmul_avx512bf16.cpp,"
  echo "run_panel). At 64 streams (compute-bound by the roofline) the dense matmuls took 106 ms of 260 and the experts 131 ms"
  echo "(5.5 GB at 57%) before those changes. FP8 steps of 16 streams are the weakest row (47% here, 34-40% before): the experts'"
  echo "1-3 rows decode e4m3 codes in registers once per token pair (39 ms, 70% of the bandwidth), and the dense matmuls take"
  echo "35 ms: the 420 MB bf16 lm_head on the panels (~16 ms) and the fp8 matrices on dequantized chunks (~18 ms, ~45% of the"
  echo "bf16 peak). Since (2026-12-05, after these rows) fp8 calls of 3-16 tokens fold each row block's scales into x and decode"
  echo "every code once per group of up to 4 tokens (tile_fp8_wide: the experts' 3-token calls and the dense fp8 matrices at 16"
  echo "tokens); alternating runs of the builds before and after, 16 streams: an fp8 step 101 -> 84 and 78 -> 66 ms (dense matmuls"
  echo "42.5 -> 35.5 / 34.3 -> 28.2 ms, routed experts 53 -> 43 / 39 -> 33 ms), output 92.6 -> 102.5 / 111.8 -> 123.8 tok/s; at 4"
  echo "streams 27 -> 25 ms in one pair, 27 -> 31 in the other (its experts' T = 1-2 calls, which did not change, slowed too)."
  echo "In the rows' run (2026-12-05, after that change) the FP8 rows of 1 and 4 streams fell in a slow phase of the VM"
  echo "(1 stream: ITL p50 21 ms, 50 tok/s of output, against 13-15 ms and 49-56 tok/s for both builds in alternating runs"
  echo "right after; the T = 1 path did not change); its 16- and 64-stream FP8 rows read 116.0 and 141.1 tok/s (108.3 and"
  echo "129.5 in the run before)."
  echo "The batched-decode kernels of 2026-12-04"
  echo "(BENCHMARKS' kernel rows T = 2-64; docs/architecture.md), alternating runs of the builds before and after: 3-4 token"
  echo "bf16 tiles that prefetch their rows and fp8 calls of 13-64 tokens on dequantized chunks took a 16-stream bf16 step"
  echo "117-124 -> 111-113 ms (routed experts 75-81 -> 70-71) and an fp8 one 80-83 -> 78-79; 5-12 token bf16 calls in one"
  echo "pass per group of up to 8 tokens took the dense matmuls of 8 / 12-stream steps 25-26 -> 22-24 / 35 -> 30-32 ms."
  echo "Zen 3 (2026-12-03, AVX2 only: fp32 FMAs at ~100 GFLOPS per core): at 64 streams (fp8: from 16) a step was"
  echo "compute-bound and output levelled at ~30 tok/s for both checkpoints; FP8 steps of 1-4 streams ran at 61-82% of their"
  echo "roofline since fp8 tiles decode each code once for two tokens (a 4-stream step 129 -> 104 ms in one A/B run)."
  echo
  echo "<!-- bench/run.sh section: engine (ONLY=serve bench/run.sh regenerates it with the serve section) -->"
  echo
  echo "$engine_rows"
  echo
  echo "<!-- end of section: engine -->"
  echo
  echo "## Speculative decoding (one stream)"
  echo
  echo "bench/spec_bench: greedy and temperature-0.7 decode of four prompts (the shipped tokenizer's text, or"
  echo "random tokens for the bench checkpoint), 128 tokens each (64 on the bench checkpoint), with and"
  echo "without each proposer, in one process. accepted % = accepted / guessed; tokens / step = tokens"
  echo "emitted per verification step (accepted + the target's own). The cost model: a step of k guesses"
  echo "costs k draft steps plus one target forward over k + 1 tokens; verify(k+1) / step is that forward's"
  echo "time over a plain decode step's, timed directly at the mean context. predicted = tokens / step /"
  echo "(k x draft step / target step + verify(k+1) / step). On a mixture of experts the verify forward"
  echo "reads the routed experts of k + 1 tokens, not one, and a model that fits in the caches (k3-nano) is"
  echo "compute-bound, so k + 1 tokens cost nearly k + 1 times one on AVX-512 (verify(7) / step 3.54 on the"
  echo "Zen 5 VM); AMX tiles take calls of 7 or more tokens and bring it to ~2.2 (Xeon, 2026-12-02), still far"
  echo "from the ~1 a bandwidth-bound step would give: speculation pays when one decode step is bandwidth-bound"
  echo "and the guesses are cheap and right."
  echo
  spec_section
  if [[ -n "$kimi_decode_rows" ]]; then
    kimi_section
  fi
  if [[ -n "$serve_rows" ]]; then
    echo
    serve_section
  fi
  if command -v mpirun >/dev/null && [[ -f checkpoints/bench-serve/tokenizer.json ]]; then
    echo
    tp_section
  fi
  if [[ -n "$cuda_rows" ]]; then
    echo
    cuda_section
  elif [[ -n "$previous_cuda_section" ]]; then
    echo
    echo "$previous_cuda_section"
  fi
} > "$OUT"
echo "wrote $OUT"
