#!/usr/bin/env bash
# Issue #36 on the H200, one lease (< 5 minutes), most important first:
#   1. tests: every CUDA kernel test (kvcd_cuda_tests: the int2-transform tensor-core kernel
#      with three query digits against the float64 oracle and the CPU kernel; the INT2
#      quantizer's -0 fix from main), every data-plane test (CUDA daemon vs CPU daemon per
#      format), and the int2-transform data-plane test with KVCD_TRANSFORM_KERNEL=tc;
#   2. the tensor-core kernel's small cases under compute-sanitizer memcheck and racecheck;
#   3. benches: cuda_transform_bench (tensor-core and FP32 int2-transform against the INT2
#      kernel, same lease), then the job-level throughput under a 60 GB pool budget
#      (cuda_job_bench: BF16, INT2, int2-transform history; job_baseline.py: cuDNN BF16 in
#      process under the same memory, same lease);
#   4. Nsight Compute of the tensor-core call at 100k, Qwen3-8B, batch 1 and 8.
#   here:   ./scripts/build.sh && KVCD_PACK_ONLY="kvcd kvcd_cuda_tests kvcd_data_plane_tests
#           cuda_transform_bench cuda_job_bench" ./scripts/pack-device.sh   (~50 MB of 64 MiB)
#   device: bench/run-h200-s21.sh   (device tool, carry [".devbin", ".devlibs"])
# The trace's prompt lengths: .devbin/trace-lengths.jsonl (scripts/pack-device.sh writes it
# from ../shared/data/traces/mooncake_synthetic_trace.jsonl); KVCD_TRACE overrides.
# Writes $OUT/summary.txt and $OUT/logs.tgz (re-packed after every step).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device-steps.sh
device_steps s21

# 1. tests
step cuda-tests 150 "$BIN/kvcd_cuda_tests"
grep -E 'Failure|actual:|exceeds' "$out/cuda-tests.log" | head -12 | tee -a "$final/summary.txt"
KVCD_BINARY=$BIN/kvcd step data-plane 200 "$BIN/kvcd_data_plane_tests"
grep -hE 'CUDA vs CPU' "$out/data-plane.log" | head -8 | tee -a "$final/summary.txt"
KVCD_TRANSFORM_KERNEL=tc KVCD_BINARY=$BIN/kvcd step data-plane-xform-tc 45 \
  "$BIN/kvcd_data_plane_tests" --gtest_filter='Formats/*.*/int2_transform'
grep -hE 'CUDA vs CPU' "$out/data-plane-xform-tc.log" | head -3 | tee -a "$final/summary.txt"

# 2. sanitizers
for tool in memcheck racecheck; do
  KVCD_TRANSFORM_TEST_SMALL=1 step "xform-$tool" 60 compute-sanitizer --tool $tool \
    --error-exitcode 9 "$BIN/kvcd_cuda_tests" --gtest_filter='CudaTransformTest.*Decode*'
  grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/xform-$tool.log" | tail -1 |
    tee -a "$final/summary.txt"
done

# 3. benches
step xform-bench 60 "$BIN/cuda_transform_bench" --out "$out/xform-bench.md"
sed -n '/^|/p' "$out/xform-bench.log" | tee -a "$final/summary.txt"
trace=${KVCD_TRACE:-}
for t in $BIN/trace-lengths.jsonl ../shared/data/traces/mooncake_synthetic_trace.jsonl; do
  [[ -z $trace && -f $t ]] && trace=$t
done
if [[ -z $trace ]]; then
  summary "job bench: no trace file (set KVCD_TRACE)"
else
  step job-bench 90 "$BIN/cuda_job_bench" --trace "$trace" --budget_gb 60 --out "$out/job-bench.md"
  sed -n '/^device/p;/^|/p' "$out/job-bench.log" | tee -a "$final/summary.txt"
  step job-bench-fp32 60 "$BIN/cuda_job_bench" --trace "$trace" --budget_gb 60 \
    --formats int2-transform --transform_kernel fp32
  grep -E '^\| int2' "$out/job-bench-fp32.log" | sed 's/^/fp32 kernel: /' | tee -a "$final/summary.txt"
  step job-baseline 120 python3 bench/job_baseline.py --trace "$trace" --budget_gb 60 \
    --out "$out/job-baseline.json"
  grep -E '^(device|\||graph|cuDNN|no )' "$out/job-baseline.log" | tee -a "$final/summary.txt"
fi

# 4. ncu of the tensor-core call
for b in 1 8; do
  args=("$BIN/cuda_transform_bench" --tc-only --layer Qwen3-8B --batch $b --context 100000)
  timeout 60 ncu --clock-control none --kernel-name regex:'Transform(DecodeKernelTc|QueryFragments)' \
    --launch-skip 4 --launch-count 2 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section SchedulerStats --section Occupancy --section WarpStateStats "${args[@]}" \
    > "$out/ncu-b$b.log" 2>&1
  summary "ncu Qwen3-8B 100k batch $b rc $?"
  grep -E 'Transform|Duration|DRAM Throughput|Issue Slots Busy|Issued Ipc|Achieved Occupancy|Registers Per|Warp Cycles Per Issued' \
    "$out/ncu-b$b.log" | sed 's/^ *//' | head -24 | tee -a "$final/summary.txt"
  pack
done
summary "done in $SECONDS s"
