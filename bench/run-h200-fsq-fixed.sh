#!/usr/bin/env bash
# Issue #37's "32k tokens, batch 1: report, with the fixed cost of a call (2k-token call)
# broken down": what a short FSQ decode call spends, on the device (about 1 minute).
#   1. cuda_fsq_bench --one G 2048 1 at 4 / 8 / 16 / 32 splits (4 is the kernels' own count at
#      2k tokens: FsqDecodeSplits gives each warp of a split at least 4 tiles), int8-2cta (the
#      default) and fp16; and at 32k tokens the default count (33) against 16 and 66;
#   2. Nsight Compute of two whole calls (the decode kernel and the merge kernel) at 2k
#      tokens, 4 and 16 splits: each kernel's duration, issue and occupancy.
#   here:   ./scripts/build.sh cuda_fsq_bench && KVCD_PACK_ONLY=cuda_fsq_bench
#           ./scripts/pack-device.sh && tar -cJf .devrun/pack.tar.xz .devbin .devlibs
#   device: tar -xJf .devrun/pack.tar.xz && bench/run-h200-fsq-fixed.sh   (carry [".devrun"])
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=$PWD/.devlibs
BIN=${KVCD_BIN:-.devbin}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "kernel    G  context  batch  splits  single us     b2b us       MB    GFLOP      TB/s  TFLOP/s    bound"
for k in int8-2cta fp16; do
  for s in 4 8 16 32; do
    timeout 30 "$BIN/cuda_fsq_bench" --kernel=$k --one 256 2048 1 --splits $s | grep -E "^ *$k "
  done
done
for s in 16 33 66; do
  timeout 30 "$BIN/cuda_fsq_bench" --kernel=int8-2cta --one 256 32768 1 --splits $s |
    grep -E '^ *int8-2cta '
done
for s in 4 16; do
  echo "== ncu, int8-2cta, G 256, 2048 tokens, batch 1, $s splits: two calls"
  timeout 60 ncu --clock-control none --kernel-name regex:Fsq --launch-skip 10 --launch-count 4 \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    "$BIN/cuda_fsq_bench" --kernel=int8-2cta --one 256 2048 1 --splits $s 2>&1 |
    grep -E '^  [a-zA-Z_]+.*Fsq|Fsq[A-Za-z]+Kernel<|Duration|Issue Slots Busy|Achieved Occupancy|Grid Size|Warp Cycles Per Issued' |
    sed 's/^ *//'
done
