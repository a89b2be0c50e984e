#!/usr/bin/env bash
# Attention across daemons against pulling the pages (docs/cluster.md, issue 32), CPU backend:
# etcd and two daemons of one cluster (member ids a and b) on loopback ports chosen at run
# time, then bench/cluster_attention_bench.cc: for each history size, the history on a, the
# session's own tokens on b; "across" merges both daemons' answers every step, "pulled" first
# moves the history to b with PullPrefix. Every server is torn down on exit.
#   bench/run-cluster-attention.sh [--history 1024,8192,32768] [--steps 20] [--out FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVCD_BUILD_DIR:-build}
history=1024,8192,32768 steps=20 out=/dev/stdout
while (($#)); do
  case $1 in
    --history) history=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "run-cluster-attention.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
for b in "$build/server/kvcd" "$build/bench/cluster-attention-bench"; do
  [[ -x $b ]] || { echo "run-cluster-attention.sh: $b is not built" >&2; exit 1; }
done
command -v etcd >/dev/null || { echo "run-cluster-attention.sh: etcd is not installed" >&2; exit 77; }
work=$(mktemp -d)
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_for() {  # FILE PATTERN PID: bounded (60 s)
  for _ in $(seq 600); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    kill -0 "$3" 2>/dev/null || { cat "$1" >&2; return 1; }
    sleep 0.1
  done
  echo "not ready in 60 s: $1" >&2; return 1
}
etcd_port=$(free_port) peer_port=$(free_port)
etcd --name xattn --data-dir "$work/etcd" --listen-client-urls "http://127.0.0.1:$etcd_port" \
  --advertise-client-urls "http://127.0.0.1:$etcd_port" --listen-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-cluster "xattn=http://127.0.0.1:$peer_port" >"$work/etcd.log" 2>&1 &
pids+=($!); wait_for "$work/etcd.log" "ready to serve client requests" "$!"
declare -A addr
for m in a b; do
  port=$(free_port)
  cat >"$work/$m.yaml" <<YAML
listen: 127.0.0.1:$port
metrics_listen: ""
backend: cpu
memory_budget: 1GiB
worker_threads: 2
compute_threads: 1
max_message_bytes: 536870912
cluster:
  name: xattn
  member_id: $m
  membership: etcd
  etcd_endpoints: [127.0.0.1:$etcd_port]
YAML
  "$build/server/kvcd" serve --config "$work/$m.yaml" >"$work/$m.out" 2>"$work/$m.err" &
  pids+=($!); wait_for "$work/$m.out" "^kvcd ready" "$!"
  addr[$m]=127.0.0.1:$port
done
# b resolves a through etcd: wait until both are registered (bounded: 30 s).
for _ in $(seq 300); do
  n=$(ETCDCTL_API=3 etcdctl --endpoints "127.0.0.1:$etcd_port" get --prefix /kvcd/xattn/members/ --keys-only | grep -c members/ || true)
  ((n == 2)) && break
  sleep 0.1
done
((n == 2)) || { echo "run-cluster-attention.sh: the daemons did not register" >&2; exit 1; }
"$build/bench/cluster-attention-bench" --a "${addr[a]}" --b "${addr[b]}" --peer a \
  --history "$history" --steps "$steps" >"$out"
