#!/usr/bin/env bash
# The per-layer decode step through kvcd, step by step (issue #19): the 36-layer decode loop
# of kvcd_decode_worker against a daemon started with KVCD_PHASE_TIMES=1, so that both
# sides print where the host time of every call goes (common/phase_times.h: p50/p90 per
# phase, kernel launches / copies / event records / stream waits per call), beside the
# in-process cuDNN loop (bench/sdpa_baseline.py, 36 x one per-layer call) in the same run.
#
# Device (default; under MPS, binaries from scripts/pack-device.sh):
#   here:   ./scripts/build.sh && ./scripts/pack-device.sh
#   device: bench/run-decode-step.sh      (device tool, carry [".devbin", ".devlibs"])
#   runs INT2 and BF16 history at 32k and 100k at batch 1 (the worker drives one sequence):
#   pipelined (--wait device), the result on the host each call (--sync), then the gRPC
#   stream, then kvcd_data_plane_tests (IPC results bit-identical to inline ones), the
#   decode-step kernels alone (cuda_finite_check_bench), the cross-process dependency costs
#   (cuda_doorbell_bench) and the in-process cuDNN loop; ends with a summary table
#   ($OUT/decode-step-summary.md). About 90 s on the H200.
# CPU (no GPU; the same loop with inline tensors, --io host, on the cpu backend):
#   bench/run-decode-step.sh --cpu        (binaries from ./build)
# The raw log goes to $OUT/decode-step-MODE.log (or bench/results/raw/ when OUT is unset).
# KVCD_RUNS="model:tokens ..." and KVCD_STEPS choose the runs; KVCD_DATA_PLANE_TESTS=0 skips
# the tests (to split the run over two device calls of at most 10 minutes if needed);
# KVCD_DECODE_EXTRAS=0 skips the kernels-alone, doorbell and cuDNN benches (the summary then
# reads an sdpa.txt already in $OUT, as bench/run-h200-bf16-split.sh leaves it).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=device
[[ ${1:-} == --cpu ]] && mode=cpu
out_dir=${OUT:-bench/results/raw}
mkdir -p "$out_dir"
log="$out_dir/decode-step-$mode.log"
exec > >(tee "$log") 2>&1
source scripts/daemon-lib.sh
export KVCD_PHASE_TIMES=1
if [[ $mode == device ]]; then
  export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=${KVCD_LIBS:-$PWD/.devlibs}
  BIN=${KVCD_BIN:-.devbin}
  CONFIG=${KVCD_CONFIG:-deploy/config/kvcd-decode-step.yaml}
  RUNS=${KVCD_RUNS:-"qwen3-8b-int2:32768 qwen3-8b-int2:99968 qwen3-8b:32768 qwen3-8b:99968"}
  STEPS=${KVCD_STEPS:-32}
  IO=ipc
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvidia-cuda-mps-control -d && echo "MPS on"
else
  BIN=${KVCD_BIN:-build}
  CONFIG=${KVCD_CONFIG:-deploy/config/kvcd-demo.yaml}
  RUNS=${KVCD_RUNS:-"qwen3-8b-int2:4096 qwen3-8b:4096"}
  STEPS=${KVCD_STEPS:-2}
  IO=host
fi
bin() {  # .devbin is flat; the build tree is not
  case $mode:$1 in
    device:*) echo "$BIN/$1" ;;
    cpu:kvcd) echo "$BIN/server/kvcd" ;;
    cpu:*) echo "$BIN/client/workers/$1" ;;
  esac
}
echo "git $(git rev-parse --short HEAD 2>/dev/null || echo '?'), mode $mode, config $CONFIG"
start_kvcd "$(bin kvcd)" "$CONFIG" || { cat "$KVCD_LOG_DIR/err"; exit 1; }
echo "daemon: $KVCD_GRPC"
rc=0
# The daemon prints its side of a channel when the channel closes; show the new lines.
err_seen=0
daemon_side() {
  local n
  n=$(wc -l <"$KVCD_LOG_DIR/err")
  sed -n "$((err_seen + 1)),${n}p" "$KVCD_LOG_DIR/err" | grep -vE '(INFO|WARNING) [a-z_]+\.cc:[0-9]+\] (sequence|lease|closed [0-9]+ sequence)' || true
  err_seen=$n
}
for mt in $RUNS; do
  m=${mt%%:*}; t=${mt##*:}
  echo; echo "=================== $m, $t tokens, batch 1"
  if [[ $IO == ipc ]]; then
    timeout 300 "$(bin kvcd_prefill_worker)" --target "$KVCD_GRPC" --model "$m" --tokens "$t" \
      --salt "p$t" --repeat 1 | grep -E '^push|rror|cannot' || rc=1
  fi
  echo "--- channel, pipelined"
  timeout 300 "$(bin kvcd_decode_worker)" --target "$KVCD_GRPC" --model "$m" --tokens "$t" \
    --salt "p$t" --steps "$STEPS" --io "$IO" || rc=1
  daemon_side
  if [[ $IO == ipc ]]; then
    echo "--- channel, host waits for every result"
    timeout 300 "$(bin kvcd_decode_worker)" --target "$KVCD_GRPC" --model "$m" --tokens "$t" \
      --salt "p$t" --steps 4 --sync | grep -E 'tokens/s|per call|match' || rc=1
    daemon_side >/dev/null
  fi
  echo "--- gRPC stream"
  timeout 300 "$(bin kvcd_decode_worker)" --target "$KVCD_GRPC" --model "$m" --tokens "$t" \
    --salt "p$t" --steps 2 --io "$IO" --transport stream | grep -E 'tokens/s|per call|match' || rc=1
  daemon_side >/dev/null
done
stop_kvcd; echo "daemon exit: $?"
if [[ $mode == device && ${KVCD_DATA_PLANE_TESTS:-1} == 1 ]]; then
  echo; echo "=================== kvcd_data_plane_tests (IPC results vs inline, every path)"
  # Without KVCD_PHASE_TIMES: the tests read the daemon's stderr for their own lines.
  KVCD_PHASE_TIMES=0 KVCD_BINARY=$BIN/kvcd timeout 300 "$BIN/kvcd_data_plane_tests" \
    >"$out_dir/data-plane-tests.log" 2>&1 || rc=1
  grep -E '^\[  (PASSED|FAILED)|^\[  FAILED' "$out_dir/data-plane-tests.log"
fi
if [[ $mode == device && ${KVCD_DECODE_EXTRAS:-1} == 1 ]]; then
  echo; echo "=================== decode-step kernels alone (cuda_finite_check_bench)"
  timeout 120 "$BIN/cuda_finite_check_bench" >"$out_dir/kernels.txt" 2>&1 || rc=1
  grep -E 'batch 1:' "$out_dir/kernels.txt"
  echo; echo "=================== cross-process dependencies under MPS (cuda_doorbell_bench)"
  timeout 60 "$BIN/cuda_doorbell_bench" --rounds 2000 | tee "$out_dir/doorbell.txt" || rc=1
  timeout 60 "$BIN/cuda_doorbell_bench" --rounds 2000 --worker-kernels 1 --daemon-kernels 1 |
    tee -a "$out_dir/doorbell.txt" || rc=1
  echo; echo "=================== in-process cuDNN loop (36 x one per-layer SDPA call, batch 1)"
  python3 bench/sdpa_baseline.py | tee "$out_dir/sdpa.txt"
  awk '$1 == "cudnn" && $3 == 1 && $5 + 0 > 0 {
         printf "cudnn loop %s tokens: %.1f us per layer (b2b) -> %.1f tokens/s over 36 layers\n",
                $2, $5, 1e6 / (36 * $5) }' "$out_dir/sdpa.txt"
fi
if [[ $mode == device ]]; then
  echo quit | nvidia-cuda-mps-control
  echo; echo "=================== summary (batch 1, 36 layers)"
  bench/decode-step-summary.sh "$log" "$out_dir/sdpa.txt" "$out_dir/kernels.txt" |
    tee "$out_dir/decode-step-summary.md"
fi
echo "raw log: $log"
exit $rc
