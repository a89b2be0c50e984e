#!/usr/bin/env bash
# A decode worker that dies mid-loop must not wedge the daemon or the other workers (issue
# #19, "correctness and safety"). On one GPU under MPS, against the real daemon (cuda
# backend): worker A runs a long per-layer decode loop over its decode channel with CUDA
# IPC tensors (2000 steps x 36 layers); once A's loop has started, worker B starts its own and kills itself with
# SIGKILL as its 100th layer call starts (request in flight, its GPU work queued; a second
# thread raises the signal). Then:
#   - B died of SIGKILL (exit status 137) while A was still running;
#   - A completes every step and its IPC result matches the inline one ("match");
#   - the daemon is still serving: worker C runs a fresh loop to the end;
#   - B's sequence, IPC buffer and decode channel are reclaimed when their 3 s leases run
#     out (kvcd_active_sequences and kvcd_registered_buffers drop back, polled on /metrics
#     with a 60 s bound);
#   - the daemon exits 0 on SIGTERM and never reported an unrecoverable device error.
#   here:   ./scripts/build.sh && ./scripts/pack-device.sh
#   device: bench/run-h200-worker-death.sh   (device tool, carry [".devbin", ".devlibs"])
# Exit status 0 when every check holds. Writes $OUT/worker-death.txt and the workers' logs.
# KVCD_HOPS: the workers' --hops (events, the default, or memops: device signal words over
# the decode channel, issue #36: a dead worker's unwritten ready word is released when its
# buffer's lease ends).
# About 30 s.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kvcd-worker-death}
mkdir -p "$out"
exec > >(tee "$out/worker-death.txt") 2>&1
source scripts/daemon-lib.sh
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=$PWD/.devlibs KVCD_PHASE_TIMES=0
BIN=${KVCD_BIN:-.devbin}
MODEL=qwen3-8b-int2
TOKENS=${KVCD_TOKENS:-4096}
failures=0
check() {  # CONDITION-STATUS DESCRIPTION
  if [[ $1 == 0 ]]; then echo "ok: $2"; else echo "FAILED: $2"; failures=$((failures + 1)); fi
}
metric() {  # NAME: the sum of the metric's samples on /metrics
  python3 -c 'import sys, urllib.request
text = urllib.request.urlopen("http://" + sys.argv[1] + "/metrics", timeout=5).read().decode()
print(int(sum(float(l.split()[-1]) for l in text.splitlines()
              if l.split() and (l.split()[0] == sys.argv[2] or l.startswith(sys.argv[2] + "{")))))' \
    "$KVCD_METRICS" "$1"
}
nvidia-cuda-mps-control -d && echo "MPS on"
cat > "$out/kvcd.yaml" <<YAML
listen: 127.0.0.1:0
metrics_listen: 127.0.0.1:0
backend: cuda
memory_budget: 8GiB
lease: {default_ms: 3000, max_ms: 600000}
models:
  - builtin: qwen3-8b
    name: $MODEL
    history_format: int2-oscar
    memory: 4GiB
YAML
start_kvcd "$BIN/kvcd" "$out/kvcd.yaml" || exit 1
echo "daemon: $KVCD_GRPC, metrics $KVCD_METRICS"
for s in a b c; do
  timeout 120 "$BIN/kvcd_prefill_worker" --target "$KVCD_GRPC" --model "$MODEL" \
    --tokens "$TOKENS" --salt "death-$s" --repeat 1 | grep -E '^push|rror|cannot'
done
worker() {  # SALT STEPS [extra flags]: the decode worker in the background, log in $out
  local salt=$1 steps=$2
  shift 2
  timeout 300 "$BIN/kvcd_decode_worker" --target "$KVCD_GRPC" --model "$MODEL" \
    --tokens "$TOKENS" --salt "death-$salt" --steps "$steps" --io ipc --lease-ms 3000 \
    --hops "${KVCD_HOPS:-events}" "$@" \
    >"$out/worker-$salt.log" 2>&1 &
}
wait_line() {  # FILE PATTERN PID: until the line appears (or the process ends)
  while ! grep -q "$2" "$1" 2>/dev/null; do kill -0 "$3" 2>/dev/null || return 1; done
}
base_seq=$(metric kvcd_active_sequences)
base_buf=$(metric kvcd_registered_buffers)
worker a 2000
pid_a=$!
wait_line "$out/worker-a.log" "decode loop started" "$pid_a"
check $? "worker A's loop started"
worker b 400 --die-after-calls 100
pid_b=$!
wait "$pid_b"
status_b=$?
kill -0 "$pid_a" 2>/dev/null
a_alive=$?
check $((status_b == 137 ? 0 : 1)) "worker B was killed by SIGKILL mid-loop (exit status $status_b)"
check "$a_alive" "worker A was still running when B died"
wait "$pid_a"
check $? "worker A finished (exit status 0)"
grep -q "IPC vs inline output.*: match" "$out/worker-a.log"
check $? "worker A's IPC result matches the inline one"
grep -E "^tokens/s" "$out/worker-a.log"
worker c 16
pid_c=$!
wait "$pid_c"
check $? "worker C, started after B died, ran its loop to the end"
grep -q "IPC vs inline output.*: match" "$out/worker-c.log"
check $? "worker C's IPC result matches the inline one"
# B's leases (sequence, buffer, channel: 3 s) run out; the reaper reclaims them.
reclaimed=1
for _ in $(seq 600); do
  if [[ $(metric kvcd_active_sequences) -le $base_seq && $(metric kvcd_registered_buffers) -le $base_buf ]]; then
    reclaimed=0
    break
  fi
  sleep 0.1
done
check $reclaimed "B's sequence and IPC buffer were reclaimed (active sequences $(metric kvcd_active_sequences), buffers $(metric kvcd_registered_buffers); before: $base_seq, $base_buf)"
"$BIN/kvctl" --target "$KVCD_GRPC" health | grep -q SERVING
check $? "the daemon still answers health SERVING"
stop_kvcd
check $? "the daemon exited 0 on SIGTERM"
! grep -q "unrecoverable" "$KVCD_LOG_DIR/err"
check $? "the daemon never reported an unrecoverable device error"
echo "--- daemon stderr (last lines)"; tail -5 "$KVCD_LOG_DIR/err"
echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
echo "worker death: $failures check(s) failed"
exit $((failures > 0))
