#!/usr/bin/env bash
# The device run of int2-transform decode attention on int8 tensor cores (#36; ~4 minutes):
#   1. the CUDA int2-transform kernel tests (kvcd_cuda_tests *Transform*): the FP32 and the
#      tensor-core decode variants against the float64 oracle AttendTransformPagesReference
#      (and the tensor-core one against the CPU kernel AttendTransformPages), random
#      geometries; then the small cases (KVCD_TRANSFORM_TEST_SMALL) under compute-sanitizer
#      memcheck and racecheck;
#   2. the int2-transform daemon test (cuda daemon vs cpu daemon, SmolLM2-135M's heads) with
#      the tensor-core variant (KVCD_TRANSFORM_KERNEL=tc), then with the FP32 one (fp32, the
#      daemon's default until this run passes) for the error beside it;
#   3. cuda_transform_bench: FP32 variant, tensor-core variant and the INT2 kernel, Qwen3-8B
#      and SmolLM2-135M layers, batch 1 and 8, 32k and 100k tokens (us, GB/s, x INT2);
#   4. ncu of the tensor-core calls at 100k, Qwen3-8B, batch 1 and 8 (duration, DRAM
#      throughput, pipe utilization incl. the tensor pipe, issue slots busy).
#   here:   ./scripts/build.sh && ./scripts/pack-device.sh
#   device: bench/run-h200-xform-tc.sh   (device tool, carry [".devbin", ".devlibs"])
# Writes $OUT/xform-kernels.log, xform-memcheck.log, xform-racecheck.log,
# xform-data-plane-tc.log, xform-data-plane-fp32.log, xform-bench.log, xform-bench.md,
# ncu-b1.log, ncu-b8.log, ncu-metrics-b1.log, ncu-metrics-b8.log and summary.txt. Revert the daemon to the FP32 kernel with
# KVCD_TRANSFORM_KERNEL=fp32 (the default was fp32 until this run passed on a device).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kvcd-h200-xform-tc}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=$PWD/.devlibs
BIN=${KVCD_BIN:-.devbin}
summary() { echo "$*" | tee -a "$out/summary.txt"; }
: > "$out/summary.txt"
summary "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
result() {  # name log rc
  summary "$1 rc $3: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\] [0-9]+ tests?' "$2" | tr '\n' ' ')"
}
timeout 40 "$BIN/kvcd_cuda_tests" --gtest_filter='*Transform*' > "$out/xform-kernels.log" 2>&1
result "int2-transform kernels (fp32 + tc)" "$out/xform-kernels.log" $?
for tool in memcheck racecheck; do  # small cases (KVCD_TRANSFORM_TEST_SMALL)
  KVCD_TRANSFORM_TEST_SMALL=1 timeout 40 compute-sanitizer --tool $tool --error-exitcode 9 \
    "$BIN/kvcd_cuda_tests" --gtest_filter='CudaTransformTest.*Decode*' \
    > "$out/xform-$tool.log" 2>&1
  result "int2-transform decode under compute-sanitizer $tool" "$out/xform-$tool.log" $?
  grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/xform-$tool.log" | tail -1 |
    tee -a "$out/summary.txt"
done
for k in tc fp32; do
  KVCD_TRANSFORM_KERNEL=$k KVCD_BINARY=$BIN/kvcd timeout 45 "$BIN/kvcd_data_plane_tests" \
    --gtest_filter='Formats/*.*/int2_transform' > "$out/xform-data-plane-$k.log" 2>&1
  result "int2-transform data plane, KVCD_TRANSFORM_KERNEL=$k (cuda daemon vs cpu daemon)" \
    "$out/xform-data-plane-$k.log" $?
  grep -E '^int2-transform: CUDA vs CPU' "$out/xform-data-plane-$k.log" | tee -a "$out/summary.txt"
done
grep -hE '^\[  FAILED|Failure|rror' "$out/xform-kernels.log" "$out/xform-data-plane-tc.log" |
  head -30 | tee -a "$out/summary.txt"
timeout 60 "$BIN/cuda_transform_bench" --out "$out/xform-bench.md" > "$out/xform-bench.log" 2>&1
summary "cuda_transform_bench rc $?"
cat "$out/xform-bench.log" | tee -a "$out/summary.txt"
# ncu: the preparation and the decode kernel of one tensor-core call (the third: warm), by
# sections, then the named metrics (the tensor-pipe names this ncu knows, looked up first).
tensor=$(ncu --query-metrics --chip gh100 2>/dev/null | awk '{print $1}' |
  grep -E '^sm__(pipe_tensor_op_imma_cycles_active|inst_executed_pipe_tensor_op_imma|pipe_tensor_cycles_active|pipe_tensor_op_hmma_cycles_active)$' |
  sed 's/$/.avg.pct_of_peak_sustained_active/' | paste -sd, -)
summary "ncu tensor-pipe metrics found: ${tensor:-none}"
metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,sm__inst_issued.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active${tensor:+,$tensor}
for b in 1 8; do
  args=("$BIN/cuda_transform_bench" --tc-only --layer Qwen3-8B --batch $b --context 100000)
  timeout 60 ncu --clock-control none --kernel-name regex:'Transform(DecodeKernelTc|QueryFragments)' \
    --launch-skip 4 --launch-count 2 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section SchedulerStats --section Occupancy "${args[@]}" > "$out/ncu-b$b.log" 2>&1
  summary "ncu sections, Qwen3-8B 100k batch $b rc $?"
  grep -E 'Transform|Duration|DRAM Throughput|Memory Throughput|Issue Slots Busy|Issued Ipc|Achieved Occupancy|Registers Per' \
    "$out/ncu-b$b.log" | sed 's/^ *//' | head -24 | tee -a "$out/summary.txt"
  timeout 45 ncu --clock-control none --kernel-name regex:'TransformDecodeKernelTc' --launch-skip 2 --launch-count 1 \
    --metrics "$metrics" "${args[@]}" > "$out/ncu-metrics-b$b.log" 2>&1
  summary "ncu metrics, Qwen3-8B 100k batch $b rc $?"
  grep -E '__' "$out/ncu-metrics-b$b.log" | sed 's/^ *//' | tee -a "$out/summary.txt"
done
