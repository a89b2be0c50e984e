#!/usr/bin/env bash
# The device run of FSQ models served from GPU memory (#16, serving half; < 2 minutes):
#   1. the FSQ data-plane tests: the real daemon (backend cuda) and a second one (backend
#      cpu) with the same FSQ model, driven by the real client: Put inline and over CUDA
#      IPC, the fused per-layer decode loop past two demotions (inline, and everything on
#      the device), PushPages over IPC, NaN/Inf residuals, an unsupported geometry;
#      stored bytes must be equal to the CPU backend's, attention close (the test prints
#      the largest error it saw);
#   2. the CUDA FSQ kernel tests against their CPU oracles (kvcd_cuda_tests *Fsq*);
#   3. the existing data-plane tests (INT2 / BF16 through the same backend code),
#      the NCCL and the lease-expiry tests left out.
#   here:   ./scripts/build.sh kvcd kvcd_data_plane_tests kvcd_cuda_tests && ./scripts/pack-device.sh
#           (pack-device.sh packs every binary it lists: build them all, or the full build)
#   device: bench/run-h200-fsq-daemon.sh   (device tool, carry [".devbin", ".devlibs"])
# Writes $OUT/fsq-data-plane.log, fsq-kernels.log, data-plane.log and summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kvcd-h200-fsq}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=$PWD/.devlibs
BIN=${KVCD_BIN:-.devbin}
summary() { echo "$*" | tee -a "$out/summary.txt"; }
: > "$out/summary.txt"
summary "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
result() {  # name log rc
  summary "$1 rc $3: $(grep -E '^\[  (PASSED|FAILED|SKIPPED)' "$2" | tr '\n' ' ')"
}
KVCD_BINARY=$BIN/kvcd timeout 100 "$BIN/kvcd_data_plane_tests" --gtest_filter='*FsqDataPlane*' \
  > "$out/fsq-data-plane.log" 2>&1
result "FSQ data plane (cuda daemon vs cpu daemon)" "$out/fsq-data-plane.log" $?
grep -E '^fsq .*CUDA vs CPU' "$out/fsq-data-plane.log" | tee -a "$out/summary.txt"
timeout 30 "$BIN/kvcd_cuda_tests" --gtest_filter='*Fsq*' > "$out/fsq-kernels.log" 2>&1
result "FSQ kernels" "$out/fsq-kernels.log" $?
KVCD_BINARY=$BIN/kvcd timeout 60 "$BIN/kvcd_data_plane_tests" \
  --gtest_filter='Models/DataPlaneTest.*:-*Nccl*:*LeaseExpiry*' > "$out/data-plane.log" 2>&1
result "data plane (int2, bf16)" "$out/data-plane.log" $?
grep -hE '^\[  FAILED|Failure|rror' "$out/fsq-data-plane.log" "$out/fsq-kernels.log" \
  "$out/data-plane.log" | head -30
