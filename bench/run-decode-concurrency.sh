#!/usr/bin/env bash
# Does the per-layer decode loop through kvcd scale with independent workers (issue #19)?
# N decode workers (1, 2, 4), each driving its own sequence over its own decode channel,
# CUDA IPC tensors, pipelined, run at the same time against one daemon under MPS. If the
# loop were bound by the GPU, N workers would share its rate (sum of tokens/s flat); if by
# each worker's serial host chain (worker -> daemon -> worker), the sum grows with N.
#   here:   ./scripts/build.sh && ./scripts/pack-device.sh
#   device: bench/run-decode-concurrency.sh   (device tool, carry [".devbin", ".devlibs"])
# KVCD_MODEL (default qwen3-8b-int2), KVCD_TOKENS (32768), KVCD_STEPS (32), KVCD_WORKERS
# ("1 2 4"). Writes $OUT/decode-concurrency.txt. About 60 s.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kvcd-decode-concurrency}
mkdir -p "$out"
exec > >(tee "$out/decode-concurrency.txt") 2>&1
source scripts/daemon-lib.sh
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=$PWD/.devlibs KVCD_PHASE_TIMES=0
BIN=${KVCD_BIN:-.devbin}
MODEL=${KVCD_MODEL:-qwen3-8b-int2}
TOKENS=${KVCD_TOKENS:-32768}
STEPS=${KVCD_STEPS:-32}
nvidia-cuda-mps-control -d && echo "MPS on"
start_kvcd "$BIN/kvcd" deploy/config/kvcd-decode-step.yaml || exit 1
rc=0
max=1
for n in ${KVCD_WORKERS:-1 2 4}; do ((n > max)) && max=$n; done
for i in $(seq "$max"); do
  timeout 300 "$BIN/kvcd_prefill_worker" --target "$KVCD_GRPC" --model "$MODEL" \
    --tokens "$TOKENS" --salt "c$i" --repeat 1 | grep -E '^push|rror|cannot' || rc=1
done
for n in ${KVCD_WORKERS:-1 2 4}; do
  pids=()
  for i in $(seq "$n"); do
    timeout 300 "$BIN/kvcd_decode_worker" --target "$KVCD_GRPC" --model "$MODEL" \
      --tokens "$TOKENS" --salt "c$i" --steps "$STEPS" --io ipc >"$out/worker-$n-$i.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  sum=0
  for i in $(seq "$n"); do
    t=$(sed -n 's/^tokens\/s: \([0-9.]*\).*/\1/p' "$out/worker-$n-$i.log")
    echo "workers $n, worker $i: ${t:-?} tokens/s; $(grep -c MISMATCH "$out/worker-$n-$i.log") mismatches"
    sum=$(awk -v a="$sum" -v b="${t:-0}" 'BEGIN { print a + b }')
  done
  echo "workers $n: sum $sum tokens/s ($MODEL, $TOKENS tokens, $STEPS steps x 36 layers each)"
done
stop_kvcd; echo "daemon exit: $?"
exit $rc
