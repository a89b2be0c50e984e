#!/usr/bin/env bash
# Device-side (after bench/run-h200.sh build and copying kvcd, kvcd_demo, kvcd_load, kvctl
# and their non-system shared libraries into .devbin / .devlibs): the daemon on the CUDA backend, the main-job workload against it, and the
# loopback load tool (attend) with the RPC/kernel split.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.devlibs
cd "$(dirname "$0")/.."
source scripts/daemon-lib.sh
start_kvcd .devbin/kvcd deploy/config/kvcd-h200.yaml || { cat "$KVCD_LOG_DIR/err"; exit 1; }
echo "daemon: $KVCD_GRPC"
.devbin/kvcd_demo --target "$KVCD_GRPC" "$@" 2>&1 | tail -16
for m in qwen3-8b-int2 qwen3-8b; do
  echo "--- load: $m"
  .devbin/kvcd_load --target "$KVCD_GRPC" --model $m --benchmarks attend --clients 1,8 --seconds 3 --context-tokens 32768 2>&1 | tail -6
done
.devbin/kvctl --target "$KVCD_GRPC" stats | head -20
stop_kvcd; echo "daemon exit: $?"
tail -5 "$KVCD_LOG_DIR/err"
