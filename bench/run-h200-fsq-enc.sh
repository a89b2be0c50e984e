#!/usr/bin/env bash
# Issue #37 part 2 on the H200, one lease (~3 minutes), most important first: the FSQ
# prefill encoder on tensor cores (kernels/cuda/fsq_encode_tc.cu) against the float64
# encoder.
#   1. tests: the FSQ encoder tests (kvcd_cuda_tests: the tensor-core encoder within
#      its bound of the float64 oracle on random geometries, the float64 encoder bit for
#      bit); the FSQ data-plane tests (CUDA daemon vs CPU daemon) with the float64 encoder
#      (KVCD_FSQ_ENCODER=exact: stored codes equal) and with tc-fp16 (the default since
#      session 25: stored codes may differ near a threshold; the test says how many);
#   2. compute-sanitizer memcheck and racecheck on the small encoder cases;
#   3. cuda_fsq_encode_bench: the float64 encoder and the tensor-core one (BF16, FP16, split
#      BF16 operands) at 8,192 tokens x 1 layer (G 256 and 84) and a 32k-token prompt x 36
#      layers (G 256), the BF16 mma.sync ceiling, the fraction of codes that differ and the
#      effect on attention; the tensor-core timings again with one block per SM;
#   4. Nsight Compute of the tensor-core encoder (FP16 operands, 8,192 tokens, one layer, G 256).
#   here:   ./scripts/build.sh kvcd kvcd_cuda_tests kvcd_data_plane_tests cuda_fsq_encode_bench &&
#           KVCD_PACK_ONLY="kvcd_cuda_tests cuda_fsq_encode_bench" ./scripts/pack-device.sh
#           (add "kvcd kvcd_data_plane_tests" for the data-plane steps: ~45 MiB with the
#           daemon's libraries, so the kernel steps and the daemon steps may go in two runs)
#   device: bench/run-h200-fsq-enc.sh   (device tool, carry [".devbin", ".devlibs"])
# Writes $OUT/summary.txt and $OUT/logs.tgz (re-packed after every step).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device-steps.sh
device_steps fsq-enc

# 1. tests
step cuda-tests 120 "$BIN/kvcd_cuda_tests" --gtest_filter='CudaFsqEncodeTc*:CudaFsqTest.Encode*'
grep -E 'Failure|actual:|allowed|of codes differ' "$out/cuda-tests.log" | head -24 |
  tee -a "$final/summary.txt"
if [[ -x $BIN/kvcd_data_plane_tests && -x $BIN/kvcd ]]; then  # packed for the second run
  KVCD_FSQ_ENCODER=exact KVCD_BINARY=$BIN/kvcd step data-plane-fsq 120 \
    "$BIN/kvcd_data_plane_tests" --gtest_filter='*fsq*'
  grep -hE 'CUDA vs CPU|differ' "$out/data-plane-fsq.log" | head -8 | tee -a "$final/summary.txt"
  KVCD_FSQ_ENCODER=tc-fp16 KVCD_BINARY=$BIN/kvcd step data-plane-fsq-tc-fp16 120 \
    "$BIN/kvcd_data_plane_tests" --gtest_filter='*fsq*'
  grep -hE 'CUDA vs CPU|differ|Failure' "$out/data-plane-fsq-tc-fp16.log" | head -8 |
    tee -a "$final/summary.txt"
fi

# 2. sanitizers
for tool in memcheck racecheck; do
  KVCD_FSQ_TEST_SMALL=1 step "enc-$tool" 90 compute-sanitizer --tool $tool \
    --error-exitcode 9 "$BIN/kvcd_cuda_tests" --gtest_filter='CudaFsqEncodeTc*'
  grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/enc-$tool.log" | tail -1 |
    tee -a "$final/summary.txt"
done

# 3. bench
step enc-bench 150 "$BIN/cuda_fsq_encode_bench"
grep -E '^(device|mma|\||  )' "$out/enc-bench.log" | tee -a "$final/summary.txt"
KVCD_FSQ_TC_BLOCKS_PER_SM=1 step enc-bench-1block 60 "$BIN/cuda_fsq_encode_bench" --tc-timings
grep -E '^\| [0-9]' "$out/enc-bench-1block.log" | sed 's/^/1 block per SM: /' | tee -a "$final/summary.txt"

# 4. ncu of the tensor-core encoder
timeout 90 ncu --clock-control none --kernel-name regex:'FsqEncodeTcKernel' --launch-skip 1 \
  --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
  --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active \
  "$BIN/cuda_fsq_encode_bench" --one fp16 8192 1 > "$out/ncu-enc.log" 2>&1
summary "ncu rc $?"
grep -E 'Duration|Compute \(SM\) Throughput|Memory Throughput|hmma|Registers Per|Achieved Occupancy|Theoretical Occupancy|Shared Memory Configuration Size|L2 Hit' \
  "$out/ncu-enc.log" | head -20 | tee -a "$final/summary.txt"
pack
summary "done in $SECONDS s"
