#!/usr/bin/env bash
# Issue #37, session 25: the FSQ merge kernel spread over D / 16 blocks per (kv head, batch
# entry) and the splits rule of one tile a warp, checked and timed on the device (~1.5 min):
# the CUDA FSQ kernel tests (every variant against the float64 oracle, through the merge),
# memcheck on their small cases, the daemon's FSQ data-plane cases, and cuda_fsq_bench --one
# for int8-2cta (the default until session 27) at G 256 (2k / 32k / 100k tokens, batch 1 and 8) and
# G 84 (100k, batch 1). Session 26 adds int8-2cta-fixed (the code size compiled in at d 128,
# G 255-256; opt-in): the tests cover it, the data-plane FSQ cases run again with it as the
# daemon's kernel, and each G 256 row is timed for both kernels in turn (~+40 s). Session 27
# adds batch 64 at 100k, torch SDPA (cuDNN) in the same lease and Nsight Compute's issue and
# tensor-pipe figures for both kernels at G 256, 100k, batch 1 (~+60 s).
#   here:   ./scripts/build.sh kvcd kvcd_cuda_tests kvcd_data_plane_tests cuda_fsq_bench &&
#           KVCD_PACK_ONLY="kvcd kvcd_cuda_tests kvcd_data_plane_tests cuda_fsq_bench"
#           ./scripts/pack-device.sh && xz -1 -c /usr/bin/etcd > .devbin/etcd.xz &&
#           tar -cJf .devrun/pack.tar.xz .devbin .devlibs
#   device: tar -xJf .devrun/pack.tar.xz && bench/run-h200-fsq-merge.sh   (carry [".devrun"])
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=$PWD/.devlibs NCCL_NVLS_ENABLE=0
BIN=${KVCD_BIN:-.devbin}
source bench/device-etcd.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 90 "$BIN/kvcd_cuda_tests" --gtest_filter='CudaFsq*' 2>&1 |
  grep -E '^\[  (PASSED|FAILED)|Failure|worst relative|Which is|actual:' | head -20
KVCD_FSQ_TEST_SMALL=1 timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 \
  "$BIN/kvcd_cuda_tests" --gtest_filter='CudaFsqTest.Decode*' 2>&1 |
  grep -E 'ERROR SUMMARY|^\[  (PASSED|FAILED)'
KVCD_BINARY=$BIN/kvcd timeout 60 "$BIN/kvcd_data_plane_tests" --gtest_filter='*fsq*' 2>&1 |
  grep -E 'CUDA vs CPU|^\[  (PASSED|FAILED)|Failure'
echo "data plane with KVCD_FSQ_KERNEL=int8-2cta-fixed:"
KVCD_FSQ_KERNEL=int8-2cta-fixed KVCD_BINARY=$BIN/kvcd timeout 60 "$BIN/kvcd_data_plane_tests" \
  --gtest_filter='*fsq*' 2>&1 | grep -E 'CUDA vs CPU|^\[  (PASSED|FAILED)|Failure'
echo "kernel    G  context  batch  splits  single us     b2b us       MB    GFLOP      TB/s  TFLOP/s    bound"
for run in "256 2048 1" "256 2048 8" "256 32768 1" "256 32768 8" "256 100000 1" "256 100000 8" \
  "256 100000 64" "84 100000 1"; do
  timeout 30 "$BIN/cuda_fsq_bench" --kernel=int8-2cta --one $run | grep -E '^ *int8-2cta '
  [[ $run == 256* ]] && timeout 30 "$BIN/cuda_fsq_bench" --kernel=int8-2cta-fixed --one $run |
    grep -E '^ *int8-2cta-fixed '
done
# Session 27: cuDNN in the same lease (the kernel rows' baseline), then Nsight Compute on
# both kernels at G 256, 100k, batch 1 (issue slots and the IMMA pipe: what binds).
timeout 60 python3 bench/sdpa_baseline.py --backends cudnn --contexts 2048 32768 100000 \
  --batches 1 8 64 2>&1 | grep -E '^(device| *cudnn)'
metrics=sm__pipe_tensor_op_imma_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,smsp__issue_active.avg.pct_of_peak_sustained_active
metrics+=,smsp__inst_executed.sum,gpu__time_duration.sum
for k in int8-2cta int8-2cta-fixed; do
  echo "ncu $k G 256 100k batch 1:"
  timeout 40 ncu --clock-control none --kernel-name regex:FsqDecodeKernel --launch-skip 4 \
    --launch-count 1 --metrics "$metrics" "$BIN/cuda_fsq_bench" --kernel=$k --one 256 100000 1 \
    2>&1 | grep -E 'pct|sum|ERROR' | sed 's/^ *//' | head -8
done
