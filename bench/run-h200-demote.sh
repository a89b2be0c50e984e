#!/usr/bin/env bash
# The device run of #20's demote goal: the GPU tests of the demote and paged INT2 store
# kernels (bit-identical to the CPU codec, Hadamard by butterflies and dense rotations) and
# compute-sanitizer memcheck on them, then cuda_demote_bench: the read ceiling, demote
# throughput (no rotation / Hadamard / dense; grouped vs warp-per-row kernel; K and V clips)
# and the paged INT2 store that Put over CUDA IPC launches, all in one process. < 3 minutes.
#   here:   ./scripts/build.sh kvcd_cuda_tests cuda_demote_bench && ./scripts/pack-device.sh
#   device: bench/run-h200-demote.sh   (device tool, carry [".devbin", ".devlibs"])
set -uo pipefail
out=${OUT:-/tmp/kvcd-demote}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.devlibs
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
filter='*Demote*:*PagedRowStores*:*FusedStoreCheck*'
timeout 60 .devbin/kvcd_cuda_tests --gtest_filter="$filter" > "$out/cuda-tests.log" 2>&1
echo "kvcd_cuda_tests ($filter) rc $?: $(grep -E '^\[  (PASSED|FAILED)' "$out/cuda-tests.log" | tr '\n' ' ')"
grep -E '^\[  FAILED|Failure' "$out/cuda-tests.log" | head -20
timeout 100 compute-sanitizer --tool memcheck .devbin/kvcd_cuda_tests \
  --gtest_filter='*Demote*:*PagedRowStores*' > "$out/memcheck.log" 2>&1
echo "memcheck rc $?: $(tail -1 "$out/memcheck.log")"
timeout 60 .devbin/cuda_demote_bench --reps 5 2>&1 | tee "$out/demote-bench.md"
