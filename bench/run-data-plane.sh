#!/usr/bin/env bash
# Device-side data-plane run: the daemon (backend cuda) and the example prefill / decode
# workers sharing pages through CUDA IPC on one GPU, then the NCCL path. Expects the
# binaries in .devbin and their non-system shared libraries in .devlibs (see
# bench/results/2026-12-02-h200-data-plane.md for how they were made). NCCL is taken from
# the machine (libnccl.so.2 of the Python nvidia-nccl package, or NCCL_LIB).
# Usage: bench/run-data-plane.sh [model:tokens ...]
#   (default: qwen3-8b-int2:32768 qwen3-8b-int2:100000 qwen3-8b:32768)
# KVCD_DECODE_WAITS="device host" runs the pipelined decode loop with both --wait modes.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
NCCL_LIB=${NCCL_LIB:-$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0] + "/lib")' 2>/dev/null)}
export LD_LIBRARY_PATH=$PWD/.devlibs${NCCL_LIB:+:$NCCL_LIB}
BIN=${KVCD_BIN:-.devbin}
CONFIG=${KVCD_CONFIG:-deploy/config/kvcd-dataplane.yaml}
source scripts/daemon-lib.sh
start_kvcd "$BIN/kvcd" "$CONFIG" || { cat "$KVCD_LOG_DIR/err"; exit 1; }
echo "daemon: $KVCD_GRPC (config $CONFIG); NCCL from ${NCCL_LIB:-nowhere}"
rc=0
# model:tokens pairs; each: push/fetch through IPC, then the decode loop over the
# shared-memory channel (pipelined, and with the host waiting for every result) and over
# the gRPC stream.
for run in "${@:-qwen3-8b-int2:32768 qwen3-8b-int2:100000 qwen3-8b:32768}"; do
  for mt in $run; do
    m=${mt%%:*}; t=${mt##*:}
    echo "=== $m, $t tokens"
    "$BIN/kvcd_prefill_worker" --target "$KVCD_GRPC" --model "$m" --tokens "$t" --salt "p$t" --repeat 2 || rc=1
    for w in ${KVCD_DECODE_WAITS:-device}; do  # "device host": both ways of ordering by events
      "$BIN/kvcd_decode_worker" --target "$KVCD_GRPC" --model "$m" --tokens "$t" --salt "p$t" --steps 16 --wait "$w" || rc=1
    done
    "$BIN/kvcd_decode_worker" --target "$KVCD_GRPC" --model "$m" --tokens "$t" --salt "p$t" --steps 2 --sync || rc=1
    "$BIN/kvcd_decode_worker" --target "$KVCD_GRPC" --model "$m" --tokens "$t" --salt "p$t" --steps 4 --transport stream || rc=1
  done
done
echo "=== NCCL (worker on device ${NCCL_WORKER_DEVICE:-0})"
"$BIN/kvcd_prefill_worker" --target "$KVCD_GRPC" --model qwen3-8b-int2 --tokens 4096 --salt nccl \
  --transport nccl --repeat 2 --timeout-ms 8000 --device "${NCCL_WORKER_DEVICE:-0}"
echo "nccl prefill worker exit: $?"
"$BIN/kvctl" --target "$KVCD_GRPC" stats | head -12
stop_kvcd; echo "daemon exit: $?"
tail -5 "$KVCD_LOG_DIR/err"
exit $rc
