#!/usr/bin/env bash
# The GPU run behind bench/results/2026-12-02-h200-int2-decode.md. Build here (CUDA 13,
# sm_90), then run on the H200 machine: the binary needs only libc/libstdc++ (CUDA runtime
# linked statically); the baseline needs the machine's PyTorch.
#   here:   bench/run-h200.sh build      -> .devbin/cuda_int2_bench
#   device: bench/run-h200.sh run        (torch SDPA cuDNN/flash baseline, then INT2 check + timing)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  build)
    ./scripts/build.sh cuda_int2_bench
    mkdir -p .devbin && cp "${KVCD_BUILD_DIR:-build}/bench/cuda_int2_bench" .devbin/
    ;;
  run)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 bench/sdpa_baseline.py
    ./.devbin/cuda_int2_bench
    ;;
  *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
