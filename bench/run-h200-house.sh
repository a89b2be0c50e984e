#!/usr/bin/env bash
# The device check of issue #30's restructuring and #36's int2-transform tensor-core kernel,
# in one lease (< 10 minutes), most important first:
#   1. every CUDA kernel test (kvcd_cuda_tests: the INT2 kernels split by concept, the one
#      error type, the int2-transform FP32 and tensor-core variants against the float64 oracle);
#   2. every data-plane test (kvcd_data_plane_tests: the CUDA daemon against the CPU daemon
#      for each format through the format registry, IPC, decode channels, NCCL);
#   3. cuda_transform_bench: FP32 variant, tensor-core variant and the INT2 kernel
#      (Qwen3-8B and SmolLM2-135M layers, batch 1 and 8, 32k and 100k tokens);
#   4. the INT2 kernel after the split beside the binary built before it (.devbin/*_prev,
#      commit b1cc2ef), same lease, the pass-3 sizes: the timings must match;
#   5. the tensor-core variant's small cases under compute-sanitizer memcheck and racecheck;
#   6. the int2-transform daemon test with KVCD_TRANSFORM_KERNEL=tc (the tensor-core variant;
#      step 2 ran the default, fp32);
#   7. Nsight Compute of the tensor-core call at 100k, Qwen3-8B, batch 1 and 8.
#   here:   ./scripts/build.sh && ./scripts/pack-device.sh && cp <prev>/cuda_*_bench_prev .devbin/
#   device: bench/run-h200-house.sh   (device tool, carry [".devbin", ".devlibs"])
# Writes $OUT/summary.txt and $OUT/logs.tgz (re-packed after every step, so a run cut short
# still returns what it did).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device-steps.sh
device_steps house

step cuda-tests 150 "$BIN/kvcd_cuda_tests"
KVCD_BINARY=$BIN/kvcd step data-plane 200 "$BIN/kvcd_data_plane_tests"
grep -hE 'CUDA vs CPU|largest|max err' "$out/data-plane.log" | head -12 | tee -a "$final/summary.txt"

step xform-bench 60 "$BIN/cuda_transform_bench" --out "$out/xform-bench.md"
sed -n '/^|/p' "$out/xform-bench.log" | tee -a "$final/summary.txt"

for nb in "100000 8" "100000 1" "32768 8" "32768 1"; do
  set -- $nb
  for v in "" _prev; do
    [ -x "$BIN/cuda_int2_bench$v" ] || continue
    timeout 30 "$BIN/cuda_int2_bench$v" --one "$1" "$2" 4 > "$out/int2-$1-$2$v.log" 2>&1
    summary "int2 $1/$2${v:- (split)}: $(grep -E "^ +$1 " "$out/int2-$1-$2$v.log" | head -1)"
  done
done
pack

for tool in memcheck racecheck; do
  KVCD_TRANSFORM_TEST_SMALL=1 step "xform-$tool" 45 compute-sanitizer --tool $tool \
    --error-exitcode 9 "$BIN/kvcd_cuda_tests" --gtest_filter='CudaTransformTest.*Decode*'
  grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/xform-$tool.log" | tail -1 |
    tee -a "$final/summary.txt"
done

KVCD_TRANSFORM_KERNEL=tc KVCD_BINARY=$BIN/kvcd step data-plane-xform-tc 45 \
  "$BIN/kvcd_data_plane_tests" --gtest_filter='Formats/*.*/int2_transform'
grep -hE 'CUDA vs CPU' "$out/data-plane-xform-tc.log" | head -3 | tee -a "$final/summary.txt"

for b in 1 8; do
  args=("$BIN/cuda_transform_bench" --tc-only --layer Qwen3-8B --batch $b --context 100000)
  timeout 60 ncu --clock-control none --kernel-name regex:'Transform(DecodeKernelTc|QueryFragments)' \
    --launch-skip 4 --launch-count 2 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section SchedulerStats --section Occupancy "${args[@]}" > "$out/ncu-b$b.log" 2>&1
  summary "ncu Qwen3-8B 100k batch $b rc $?"
  grep -E 'Transform|Duration|DRAM Throughput|Memory Throughput|Issue Slots Busy|Issued Ipc|Achieved Occupancy|Registers Per' \
    "$out/ncu-b$b.log" | sed 's/^ *//' | head -24 | tee -a "$final/summary.txt"
  pack
done
summary "done in $SECONDS s"
