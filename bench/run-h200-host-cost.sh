#!/usr/bin/env bash
# Host cost of the CUDA calls of a per-layer decode call (issue #19): cuda_host_cost_bench
# without MPS, then under MPS (the daemon and its same-GPU workers run under MPS), then the
# two-process ping-pong with the daemon side's host time split by step. ~30 s.
#   here:   ./scripts/build.sh cuda_host_cost_bench && ./scripts/pack-device.sh
#   device: bench/run-h200-host-cost.sh   (device tool, carry [".devbin", ".devlibs"])
# Writes $OUT/host-cost-no-mps.md, $OUT/host-cost-mps.md and $OUT/doorbell-split.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kvcd-host-cost}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.devlibs
BIN=${KVCD_BIN:-.devbin}
echo "== without MPS"
timeout 120 "$BIN/cuda_host_cost_bench" | tee "$out/host-cost-no-mps.md"
if nvidia-cuda-mps-control -d; then
  echo "== under MPS"
  timeout 120 "$BIN/cuda_host_cost_bench" | tee "$out/host-cost-mps.md"
  # Two processes: the daemon side's host time per round split into wait / launches / signal
  # (4 daemon launches as in an INT2 call; 5 µs kernels keep the GPU busy).
  echo "== two processes under MPS (cuda_doorbell_bench, 3 + 4 kernels of 5 us)"
  timeout 120 "$BIN/cuda_doorbell_bench" --rounds 2000 --worker-kernels 3 --daemon-kernels 4 \
    --kernel-us 5 | tee "$out/doorbell-split.txt"
  echo quit | nvidia-cuda-mps-control
fi
