#!/usr/bin/env bash
# Issue #32 "pages move between daemons" on the device (docs/cluster.md "Transports"):
# two CUDA daemons in one etcd membership on loopback; daemon A holds a 32k-token prefix of
# a Qwen3-8B-shaped model (INT2 history, then BF16 history); daemon B, restarted empty for
# each transport, pulls it with cluster.pull_transport forced to each transport in turn and
# then left on auto. cluster_xfer_bench times the PullPrefix call and checks that B holds
# the same page bytes as A and that attention over the prefix is bitwise equal on both.
#   1 GPU:  A and B on GPU 0: grpc, cuda_ipc, auto (expect cuda_ipc), and nccl forced (two
#           ranks on one GPU: must fail cleanly and store nothing).
#   2 GPUs: A on GPU 0, B on GPU 1: grpc, cuda_ipc, nccl, auto. Each daemon uses its device
#           0, so B runs with CUDA_VISIBLE_DEVICES=1,0 and A with 0,1: both see both GPUs,
#           as CUDA IPC across GPUs and NCCL's peer-to-peer path need.
# Also the CUDA pull tests (kvcd_data_plane_tests --gtest_filter='ClusterDevicePull*') and,
# with 2 GPUs, a daemon on cuda_device 1 driven from its gRPC, decode-channel and NCCL threads
# against the CPU backend ('CudaDeviceOne*', tests/integration/cuda_device_test.cc).
#   here:   KVCD_BUILD_DIR=build ./scripts/build.sh kvcd cluster_xfer_bench kvcd_data_plane_tests
#           && KVCD_PACK_ONLY="kvcd cluster_xfer_bench kvcd_data_plane_tests" \
#              ./scripts/pack-device.sh && xz -1 -c /usr/bin/etcd > .devbin/etcd.xz
#   device: bench/run-h200-cluster-xfer.sh  (carry [".devbin", ".devlibs"]; ~4 minutes)
# A dry run without a GPU (the script's own logic; device transports are refused):
#   KVCD_XFER_BACKEND=cpu KVCD_XFER_BUDGET=1GiB KVCD_XFER_INT2_MEM=128MiB KVCD_XFER_BF16_MEM=256MiB \
#   KVCD_XFER_TOKENS=512 OUT=/tmp/xfer bench/run-h200-cluster-xfer.sh
# Writes $OUT/summary.txt, $OUT/cluster-xfer.md (the table) and $OUT/logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
final=${OUT:-/tmp/kvcd-cluster-xfer}
out=/tmp/kvcd-cluster-xfer-logs
rm -rf "$out" && mkdir -p "$final" "$out"
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=$PWD/.devlibs
BIN=$PWD/.devbin
summary() { echo "$*" | tee -a "$final/summary.txt"; }
pack() { tar -czf "$final/logs.tgz" -C "$out" . 2>/dev/null; }
: > "$final/summary.txt"
summary "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
summary "GPUs: $gpus"
source bench/device-etcd.sh
summary "etcd: $(etcd --version 2>&1 | head -1)"

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  pack
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
# Waits (bounded) for a line matching $2 in file $1.
wait_line() {
  local i
  for ((i = 0; i < 600; i++)); do
    grep -qE "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}

# 1. tests
filter='ClusterDevicePull*'
((gpus >= 2)) && filter+=':CudaDeviceOne*'
KVCD_BINARY=$BIN/kvcd timeout 300 stdbuf -oL "$BIN/kvcd_data_plane_tests" \
  --gtest_filter="$filter" > "$out/tests.log" 2>&1
summary "tests rc $?: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\] [0-9]+ tests?' "$out/tests.log" | tr '\n' ' ')"
grep -E '^\[  FAILED  \] [A-Za-z]|Failure|expected' "$out/tests.log" | head -10 | tee -a "$final/summary.txt"
pack

# 2. the daemons
etcd_client=$(free_port)
etcd_peer=$(free_port)
etcd --name x --data-dir /tmp/kvcd-xfer-etcd --listen-client-urls "http://127.0.0.1:$etcd_client" \
  --advertise-client-urls "http://127.0.0.1:$etcd_client" \
  --listen-peer-urls "http://127.0.0.1:$etcd_peer" \
  --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" \
  --initial-cluster "x=http://127.0.0.1:$etcd_peer" --log-level warn > "$out/etcd.log" 2>&1 &
pids+=($!)
for ((i = 0; i < 200; i++)); do
  (exec 3<> "/dev/tcp/127.0.0.1/$etcd_client") 2>/dev/null && break
  sleep 0.1
done

config() {  # member transport
  cat <<EOF
listen: 127.0.0.1:0
metrics_listen: 127.0.0.1:0
backend: ${KVCD_XFER_BACKEND:-cuda}
memory_budget: ${KVCD_XFER_BUDGET:-30GiB}
max_message_bytes: 536870912
lease: {default_ms: 120000, max_ms: 600000}
models:
  - {builtin: qwen3-8b, name: q8-int2, history_format: int2-oscar, memory: ${KVCD_XFER_INT2_MEM:-4GiB}}
  - {builtin: qwen3-8b, name: q8-bf16, history_format: bf16, memory: ${KVCD_XFER_BF16_MEM:-12GiB}}
cluster:
  name: xfer
  member_id: $1
  membership: etcd
  etcd_endpoints: [127.0.0.1:$etcd_client]
  lease_ttl_s: 5
  pull_transport: $2
EOF
}
start_daemon() {  # name member transport gpus -> sets started_pid, started_grpc, started_metrics
  config "$2" "$3" > "$out/$1.yaml"
  CUDA_VISIBLE_DEVICES=$4 "$BIN/kvcd" serve --config "$out/$1.yaml" > "$out/$1.out" \
    2> "$out/$1.err" &
  started_pid=$!
  pids+=("$started_pid")
  if ! wait_line "$out/$1.out" 'kvcd ready'; then
    summary "daemon $1 did not start: $(tail -3 "$out/$1.err")"
    return 1
  fi
  started_grpc=$(grep -oE 'grpc=[^ ]+' "$out/$1.out" | head -1 | cut -d= -f2)
  started_metrics=$(grep -oE 'metrics=[^ ]+' "$out/$1.out" | head -1 | cut -d= -f2)
}
stop_daemon() {
  kill "$1" 2>/dev/null
  wait "$1" 2>/dev/null
}

a_gpus=0
b_gpus=0
transports="grpc cuda_ipc auto nccl"
if ((gpus >= 2)); then
  a_gpus=0,1
  b_gpus=1,0
  transports="grpc cuda_ipc nccl auto"
fi
start_daemon a a auto "$a_gpus" || exit 1
a_grpc=$started_grpc
table=$final/cluster-xfer.md
{
  echo "GPUs: $gpus; A sees $a_gpus, B sees $b_gpus (each uses the first); $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  echo
  echo "| transport set | moved by (B's metrics) | model | tokens | bytes | pull time | GB/s | bytes A vs B | attention A vs B | result |"
  echo "|---|---|---|---:|---:|---:|---:|---|---|---|"
} > "$table"
n=0
for model in q8-int2 q8-bf16; do
  fill=--fill
  for t in $transports; do
    n=$((n + 1))
    start_daemon "b$n" b "$t" "$b_gpus" || continue
    # B sees A once its membership watch has A's key (bounded by the bench's retries).
    timeout 300 "$BIN/cluster_xfer_bench" --a "$a_grpc" --b "$started_grpc" --peer a \
      --model "$model" --tokens "${KVCD_XFER_TOKENS:-32768}" $fill --transport "$t" --b_metrics "$started_metrics" \
      --results "$table" > "$out/bench-$model-$t.log" 2>&1
    rc=$?
    fill=
    summary "$model $t rc $rc: $(tail -2 "$out/bench-$model-$t.log" | tr '\n' ' ')"
    grep -hE 'PullPrefix|fall|WARN|ERROR' "$out/b$n.err" | head -3 | tee -a "$final/summary.txt"
    stop_daemon "$started_pid"
    pack
  done
done
cat "$table" | tee -a "$final/summary.txt"
