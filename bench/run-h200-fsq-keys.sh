#!/usr/bin/env bash
# Issue #37 on the H200, one lease (about 3.5 minutes): FSQ decode attention with the key
# rebuild on int8 tensor cores (cuda_fsq_i8.h), one CTA per SM (int8) and two (int8-2cta,
# session 25), beside the FP16 reference variant.
#   1. tests: the CUDA FSQ kernel tests (the three variants against the float64 oracle on
#      random geometries; the int8 key decoder's error against FSQ's rounding; the two-CTA
#      variant's split count from its residency), then the daemon's FSQ data-plane cases
#      (CUDA daemon against CPU daemon) with KVCD_FSQ_KERNEL=fp16, int8 and int8-2cta (an
#      int8 variant becomes the default only if these and the oracle pass);
#   2. compute-sanitizer memcheck and racecheck on the decode tests' small cases (the three
#      variants);
#   3. cuda_fsq_bench --kernel=int8,int8-2cta (G 256 / 84, contexts 2k / 32k / 100k, batch
#      1 / 8 / 64, the FP16 and int8 mma.sync ceilings, the error at the bench geometry; the
#      FP16 reference's timings are session 24's, its code unchanged: --kernel=all adds them
#      for ~25 s) and torch SDPA BF16 cuDNN (bench/sdpa_baseline.py) at the same contexts and
#      batches, same lease;
#   4. Nsight Compute at 100k, G 256: int8 at batch 1 and 8, int8-2cta at batch 1 (tensor
#      pipe, DRAM, issue, occupancy, the block limits), and the pipes' busy % of both int8
#      kernels at batch 1. The timeouts sum to 710 s; about 3.5 minutes expected (session
#      24's run took 87 s with the oracle test crashing at once and two bench variants).
#   here:   ./scripts/build.sh kvcd kvcd_data_plane_tests kvcd_cuda_tests cuda_fsq_bench &&
#           KVCD_PACK_ONLY="kvcd kvcd_data_plane_tests kvcd_cuda_tests cuda_fsq_bench" \
#           ./scripts/pack-device.sh &&
#           tar -cJf /tmp/pack.tar.xz .devbin .devlibs && rm -rf .devbin .devlibs &&
#           mkdir .devbin && mv /tmp/pack.tar.xz .devbin/
#           (52 MiB of binaries and libraries as 16 MiB: the carry stays under 50 MiB)
#   device: bench/run-h200-fsq-keys.sh   (device tool, carry [".devbin"]; unpacks
#           .devbin/pack.tar.xz first when it is there; carry [".devbin", ".devlibs"] works too)
# Writes $OUT/summary.txt and $OUT/logs.tgz (re-packed after every step).
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -f .devbin/pack.tar.xz ]]; then
  tar -xJf .devbin/pack.tar.xz || { echo "cannot unpack .devbin/pack.tar.xz"; exit 1; }
fi
source bench/device-steps.sh
device_steps fsq-keys

# 1. tests
step fsq-tests 80 "$BIN/kvcd_cuda_tests" --gtest_filter='CudaFsq*'
grep -E 'worst relative|int8 W_k|Failure|actual:|Which is|kernel=|d [0-9]+ G' "$out/fsq-tests.log" |
  head -30 |
  tee -a "$final/summary.txt"

for k in fp16 int8 int8-2cta; do
  KVCD_FSQ_KERNEL=$k KVCD_BINARY=$BIN/kvcd step "fsq-data-plane-$k" 45 \
    "$BIN/kvcd_data_plane_tests" --gtest_filter='Formats/*.*/fsq*'
  grep -hE 'CUDA vs CPU' "$out/fsq-data-plane-$k.log" | head -3 | tee -a "$final/summary.txt"
done

# 2. sanitizers (small cases: the first two decode geometries, contexts <= 70)
for tool in memcheck racecheck; do
  KVCD_FSQ_TEST_SMALL=1 step "fsq-$tool" 50 compute-sanitizer --tool $tool --error-exitcode 9 \
    "$BIN/kvcd_cuda_tests" --gtest_filter='CudaFsqTest.Decode*'
  grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/fsq-$tool.log" | tail -1 |
    tee -a "$final/summary.txt"
done

# 3. benches, same lease
step fsq-bench 150 "$BIN/cuda_fsq_bench" --kernel=int8,int8-2cta
grep -E '^(device|read ceiling|  (fp16|int8|int8-2cta) G)' "$out/fsq-bench.log" |
  tee -a "$final/summary.txt"
sed -n '/^kernel /,$p' "$out/fsq-bench.log" | tee -a "$final/summary.txt"
step sdpa 50 python3 bench/sdpa_baseline.py --backends cudnn --contexts 2048 32768 100000
grep -E '^(device| *cudnn)' "$out/sdpa.log" | tee -a "$final/summary.txt"

# 4. Nsight Compute, 100k tokens, G 256 (launch-skip: past the warm-up calls)
for run in "int8 1" "int8-2cta 1" "int8 8"; do
  set -- $run
  k=$1 b=$2
  timeout 35 ncu --clock-control none --kernel-name regex:FsqDecodeKernel --launch-skip 4 \
    --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section SchedulerStats --section Occupancy --section WarpStateStats \
    --section LaunchStats "$BIN/cuda_fsq_bench" --kernel=$k --one 256 100000 $b \
    > "$out/ncu-$k-b$b.log" 2>&1
  summary "ncu $k G 256 100k batch $b rc $?"
  grep -E 'FsqDecodeKernel|Duration|DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Issued Ipc Active|Achieved Occupancy|Theoretical Occupancy|Block Limit (Registers|Shared Mem)|Registers Per|Warp Cycles Per Issued|Stall' \
    "$out/ncu-$k-b$b.log" | sed 's/^ *//' | head -28 | tee -a "$final/summary.txt"
  pack
done
# The tensor pipes' and shared memory's busy % (metric names vary by ncu version: listed
# first, then asked for; a name this ncu lacks only fails this step).
timeout 20 ncu --query-metrics --chip gh100 2>&1 | grep -iE 'pipe_tensor|pipe_shared|imma|hmma' |
  head -40 > "$out/ncu-metric-names.log"
metrics=sm__pipe_tensor_op_imma_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,smsp__issue_active.avg.pct_of_peak_sustained_active
metrics+=,dram__throughput.avg.pct_of_peak_sustained_elapsed
for k in int8 int8-2cta; do
  b=1
  timeout 35 ncu --clock-control none --kernel-name regex:FsqDecodeKernel --launch-skip 4 \
    --launch-count 1 --metrics "$metrics" "$BIN/cuda_fsq_bench" --kernel=$k --one 256 100000 $b \
    > "$out/ncu-pipes-$k-b$b.log" 2>&1
  summary "ncu pipes $k G 256 100k batch $b rc $?"
  grep -E 'pct|ERROR' "$out/ncu-pipes-$k-b$b.log" | sed 's/^ *//' | head -8 |
    tee -a "$final/summary.txt"
done
pack
summary "done in $SECONDS s"
