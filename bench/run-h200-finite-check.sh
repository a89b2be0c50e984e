#!/usr/bin/env bash
# The device run of the non-finite check fused into the CUDA kernels (#21.3): the GPU tests
# (kernels against their scalar references; NaN/Inf through every device path of the real
# daemon; memcheck of the new kernel tests), the kernel cost with and without the check
# compiled in (same process), then the Put-over-IPC and decode-loop figures of
# bench/results/2026-12-03-h200-hardening.md with the checked daemon (MPS on), to compare
# with that file's "device tensors not checked" section.
#   here:   ./scripts/build.sh && ./scripts/pack-device.sh
#   device: bench/run-h200-finite-check.sh   (device tool, carry [".devbin", ".devlibs"])
set -uo pipefail
out=${OUT:-/tmp/kvcd-h200}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=$PWD/.devlibs
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
.devbin/kvcd_cuda_tests > "$out/cuda-tests.log" 2>&1
echo "kvcd_cuda_tests rc $?: $(grep -E '^\[  (PASSED|FAILED)' "$out/cuda-tests.log" | tr '\n' ' ')"
compute-sanitizer --tool memcheck .devbin/kvcd_cuda_tests \
  --gtest_filter='*FusedStoreCheck*:*QueryConversionCheck*:*MergePoisons*' > "$out/memcheck.log" 2>&1
echo "memcheck rc $?: $(tail -1 "$out/memcheck.log")"
KVCD_BINARY=.devbin/kvcd .devbin/kvcd_data_plane_tests > "$out/data-plane-tests.log" 2>&1
echo "kvcd_data_plane_tests rc $?: $(grep -E '^\[  (PASSED|FAILED)' "$out/data-plane-tests.log" | tr '\n' ' ')"
grep -E '^\[  FAILED|Failure|error' "$out/cuda-tests.log" "$out/data-plane-tests.log" | head -40
.devbin/cuda_finite_check_bench --tokens 32768 --reps 15
bench/run-h200-hardening.sh
