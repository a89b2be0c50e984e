#!/usr/bin/env bash
# The device run of the split tensor-core BF16 decode kernel (issue #19; results in
# bench/results/2026-12-06-h200-bf16-split.md):
#   1. kvcd_cuda_tests (the split kernel against the scalar CPU kernel, raw queries bit for
#      bit, both BF16 kernels in the mixed INT2 + BF16 test, every other CUDA kernel test);
#   2. cuda_bf16_split_bench: split vs first BF16 kernel (check, then us and TB/s at Qwen3-8B
#      geometry, 32k and 100k tokens, batch 1 and 8);
#   3. torch SDPA cuDNN BF16 at the same sizes (bench/sdpa_baseline.py), same run;
#   4. the BF16-history decode step through the daemon at 32k and 100k
#      (bench/run-decode-step.sh, BF16 runs only, with the data-plane tests, under MPS) and
#      its summary table against the cuDNN loop of step 3;
#   5. compute-sanitizer memcheck and racecheck of the split kernel tests.
# KVCD_BF16_OLD_STEP=1 adds step 4 again with the first kernel (daemon KVCD_BF16_KERNEL=warp).
# About 2 minutes on the H200.
#   here:   ./scripts/build.sh && ./scripts/pack-device.sh
#   device: bench/run-h200-bf16-split.sh     (device tool, carry [".devbin", ".devlibs"])
# Files in $OUT: cuda-tests.log, sanitizer.log, bf16-split-bench.txt, sdpa.txt,
# decode-step-device.log, data-plane-tests.log, decode-step-summary.md, summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kvcd-h200-bf16-split}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=${KVCD_LIBS:-$PWD/.devlibs}
BIN=${KVCD_BIN:-.devbin}
rc=0
summary="$out/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
note "git $(git rev-parse --short HEAD 2>/dev/null || echo '?'); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
start=$SECONDS

echo; echo "=================== 1. kvcd_cuda_tests"
timeout 180 "$BIN/kvcd_cuda_tests" >"$out/cuda-tests.log" 2>&1 || rc=1
note "kvcd_cuda_tests: $(grep -E '^\[  (PASSED|FAILED)' "$out/cuda-tests.log" | tr '\n' ' ')"
grep -E '^\[  FAILED|Failure' "$out/cuda-tests.log" | head -20

echo; echo "=================== 2. split vs first BF16 kernel (cuda_bf16_split_bench)"
timeout 150 "$BIN/cuda_bf16_split_bench" | tee "$out/bf16-split-bench.txt" || rc=1
grep -E '^check|^read ceiling' "$out/bf16-split-bench.txt" >>"$summary"
grep -E '^(split|warp) ' "$out/bf16-split-bench.txt" >>"$summary"

echo; echo "=================== 3. torch SDPA cuDNN BF16, same sizes"
timeout 120 python3 bench/sdpa_baseline.py --backends cudnn --batches 1 8 |
  tee "$out/sdpa.txt" || note "sdpa_baseline.py failed (no torch?)"
grep -E '^ *cudnn' "$out/sdpa.txt" >>"$summary"
note "step 1-3 took $((SECONDS - start)) s"

echo; echo "=================== 4. BF16-history decode step through the daemon"
runs="qwen3-8b:32768 qwen3-8b:99968"
OUT=$out KVCD_RUNS=$runs KVCD_DECODE_EXTRAS=0 bench/run-decode-step.sh || rc=1
cat "$out/decode-step-summary.md" >>"$summary"
if [[ ${KVCD_BF16_OLD_STEP:-0} == 1 ]]; then
  mkdir -p "$out/old"
  cp "$out/sdpa.txt" "$out/old/"
  OUT=$out/old KVCD_BF16_KERNEL=warp KVCD_RUNS=$runs KVCD_DECODE_EXTRAS=0 \
    KVCD_DATA_PLANE_TESTS=0 bench/run-decode-step.sh || rc=1
  note "first kernel (KVCD_BF16_KERNEL=warp):"
  cat "$out/old/decode-step-summary.md" >>"$summary"
fi

echo; echo "=================== 5. compute-sanitizer on the split kernel tests"
# Last, so that a slow sanitizer cannot cost the figures above; they do not change rc.
sanitize() {  # TOOL FILTER
  timeout 30 compute-sanitizer --tool "$1" "$BIN/kvcd_cuda_tests" --gtest_filter="$2" \
    >>"$out/sanitizer.log" 2>&1
  note "compute-sanitizer $1 ($2) rc $?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer.log" | tail -1)"
}
sanitize memcheck 'CudaBf16SplitTest.*'
sanitize racecheck 'CudaBf16SplitTest.RawQueries*'
note "total $((SECONDS - start)) s, rc $rc"
echo; echo "=================== summary ($summary)"
cat "$summary"
exit $rc
