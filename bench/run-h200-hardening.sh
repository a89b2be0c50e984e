#!/usr/bin/env bash
# The run behind bench/results/2026-12-03-h200-hardening.md: Put / push / fetch over CUDA
# IPC and the INT2 decode loop (MPS) against the daemon built from this tree.
#   here:   ./scripts/build.sh && ./scripts/pack-device.sh
#   device: bench/run-h200-hardening.sh   (device tool, carry [".devbin", ".devlibs"])
set -uo pipefail
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=$PWD/.devlibs
source scripts/daemon-lib.sh
nvidia-cuda-mps-control -d
start_kvcd .devbin/kvcd deploy/config/kvcd-dataplane.yaml || { cat "$KVCD_LOG_DIR/err"; exit 1; }
for m in qwen3-8b-int2 qwen3-8b; do
  timeout 120 .devbin/kvcd_prefill_worker --target "$KVCD_GRPC" --model $m --tokens 32768 --salt "push-$m" --repeat 3 | grep -E 'push|fetch'
  timeout 240 .devbin/kvcd_prefill_worker --target "$KVCD_GRPC" --model $m --tokens 32768 --salt "put-$m" --mode put --repeat 3 | grep -E 'put \(|identical'
done
timeout 120 .devbin/kvcd_decode_worker --target "$KVCD_GRPC" --model qwen3-8b-int2 --tokens 32768 --salt push-qwen3-8b-int2 --steps 16 2>&1 | tail -3
stop_kvcd; echo "daemon exit: $?"
echo quit | nvidia-cuda-mps-control
