#!/usr/bin/env bash
# The GPU check, in one run, on a machine with an NVIDIA GPU: every cuda kernel against the
# reference (tests/ops/cuda_ops_test.cpp and the cuda quantized-matmul test), the decode-op
# benchmark (bench/cuda_bench.cpp), then the same tests under compute-sanitizer's memcheck and
# racecheck where it is installed. Build on any machine with nvcc (cmake --build build --target
# test_ops cuda_bench); the two binaries need only the CUDA driver and cuBLAS (libcublas.so.13,
# opened at first use) where they run.
#   [SANITIZERS="memcheck racecheck"] bench/cuda_device_check.sh [BIN_DIR=build] [OUT_DIR=cuda-check]
# writes OUT_DIR/test_ops.log, cuda_bench.md (for ONLY=cuda CUDA_BENCH_OUTPUT=... bench/run.sh),
# memcheck.log and racecheck.log, and prints a summary. Exit status: non-zero if a test failed or
# memcheck found an error.
set -uo pipefail
BIN=${1:-build}
OUT_DIR=${2:-cuda-check}
mkdir -p "$OUT_DIR"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64
FILTER='CudaOps*:QuantCuda*:CudaOpsRegistry*'
SANITIZERS=${SANITIZERS-memcheck racecheck}
status=0

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout 300 "$BIN/test_ops" --gtest_filter="$FILTER" >"$OUT_DIR/test_ops.log" 2>&1 || status=1
grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$OUT_DIR/test_ops.log"
grep -q "SKIPPED" "$OUT_DIR/test_ops.log" && { echo "cuda tests skipped: no usable device" >&2; exit 77; }

timeout 300 "$BIN/cuda_bench" >"$OUT_DIR/cuda_bench.md" 2>"$OUT_DIR/cuda_bench.err" || status=1
head -1 "$OUT_DIR/cuda_bench.md"

if command -v compute-sanitizer >/dev/null && [[ "$SANITIZERS" == *memcheck* ]]; then
  timeout 300 compute-sanitizer --tool memcheck --print-limit 20 "$BIN/test_ops" --gtest_filter="$FILTER" \
    >"$OUT_DIR/memcheck.log" 2>&1
  grep "ERROR SUMMARY" "$OUT_DIR/memcheck.log" || echo "memcheck: no summary (timed out?)"
  grep -q "ERROR SUMMARY: 0 errors" "$OUT_DIR/memcheck.log" || status=1
fi
if command -v compute-sanitizer >/dev/null && [[ "$SANITIZERS" == *racecheck* ]]; then
  # cuBLAS's own kernels (nvjet_*) report hazards here; moat's kernels must not.
  timeout 300 compute-sanitizer --tool racecheck --print-limit 20 "$BIN/test_ops" --gtest_filter="$FILTER" \
    >"$OUT_DIR/racecheck.log" 2>&1
  grep "RACECHECK SUMMARY" "$OUT_DIR/racecheck.log" || echo "racecheck: no summary (timed out?)"
  grep -E "access at " "$OUT_DIR/racecheck.log" | grep -v nvjet_ | sort | uniq -c | head
fi
exit $status
