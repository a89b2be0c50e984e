#!/usr/bin/env bash
# Cluster trace replay (docs/cluster.md, issue 32): the public Mooncake trace replayed over 4
# kvcd daemons on the CPU backend (etcd membership, Redis block index, all on loopback ports
# chosen at run time) with each routing mode of kvcd-replay's cluster target, beside one daemon
# with 4x the capacity. Pages are scaled as in bench/run-replay.sh (one 512-token block = one
# 16-token page of 8 KiB). Every server is torn down on exit, even on failure.
#   bench/run-replay-cluster.sh [--out FILE.md] [--requests N] [--capacity PAGES_PER_DAEMON]
#                               [--modes "random rendezvous index"] [--keep DIR] [--check]
# Defaults: all requests, 1953 pages per daemon (1M trace tokens; the big daemon 7812).
# --check: fail unless every request was served, every answer checked against a float64
# reference of the K/V sent was right (kvcd-replay --verify-every 1) and every other routing
# beats random (the CI-sized run of tests/CMakeLists.txt: a few hundred requests).
# Needs etcd, etcdctl, redis-server, redis-cli (scripts/install-deps.sh) and the build's kvcd
# and kvcd-replay. The trace is read from ../shared/data/traces/ (or KVCD_TRACE).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVCD_BUILD_DIR:-build}
out=/dev/stdout requests=0 cap=1953 modes="random rendezvous index" keep="" check=""
while (($#)); do
  case $1 in
    --out) out=$2; shift 2 ;;
    --requests) requests=$2; shift 2 ;;
    --capacity) cap=$2; shift 2 ;;
    --modes) modes=$2; shift 2 ;;
    --keep) keep=$2; shift 2 ;;
    --check) check=--check; shift ;;
    *) echo "run-replay-cluster.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
trace=${KVCD_TRACE:-}
for t in ../shared/data/traces/mooncake_synthetic_trace.jsonl \
  ../../shared/data/traces/mooncake_synthetic_trace.jsonl; do
  [[ -n $trace ]] || { [[ -r $t ]] && trace=$t; }
done
# Exit 77 (a skip for CTest) when the trace or a server binary is missing.
[[ -r $trace ]] || { echo "run-replay-cluster.sh: no trace (set KVCD_TRACE)" >&2; exit 77; }
for b in "$build/server/kvcd" "$build/bench/kvcd-replay"; do
  [[ -x $b ]] || { echo "run-replay-cluster.sh: $b is not built (scripts/build.sh kvcd kvcd-replay)" >&2; exit 1; }
done
for b in etcd etcdctl redis-server redis-cli; do
  command -v "$b" >/dev/null || { echo "run-replay-cluster.sh: $b is not installed (scripts/install-deps.sh)" >&2; exit 77; }
done
work=$(mktemp -d)
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  [[ -n $keep ]] && { mkdir -p "$keep"; cp -r "$work"/. "$keep"/; }
  rm -rf "$work"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# wait_for FILE PATTERN PID: bounded wait (60 s) for a process's ready line.
wait_for() {
  for _ in $(seq 600); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    kill -0 "$3" 2>/dev/null || { cat "$1" >&2; echo "process $3 exited before it was ready" >&2; return 1; }
    sleep 0.1
  done
  cat "$1" >&2; echo "not ready in 60 s: $1" >&2; return 1
}
etcd_port=$(free_port) peer_port=$(free_port) redis_port=$(free_port)
etcd --name replay --data-dir "$work/etcd" --listen-client-urls "http://127.0.0.1:$etcd_port" \
  --advertise-client-urls "http://127.0.0.1:$etcd_port" --listen-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-cluster "replay=http://127.0.0.1:$peer_port" >"$work/etcd.log" 2>&1 &
pids+=($!); wait_for "$work/etcd.log" "ready to serve client requests" "$!"
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no >"$work/redis.log" 2>&1 &
pids+=($!); wait_for "$work/redis.log" "Ready to accept connections" "$!"
export ETCDCTL_API=3
etcdctl_() { etcdctl --endpoints "127.0.0.1:$etcd_port" "$@"; }
page_bytes=8192  # page 16 tokens x 2 layers x 2 kv heads x head_dim 32, K and V, BF16
# start_daemon NAME CAPACITY [CLUSTER_YAML]: a daemon; sets port_NAME and pid_NAME.
start_daemon() {
  local name=$1 capacity=$2 port
  port=$(free_port)
  cat >"$work/$name.yaml" <<YAML
listen: 127.0.0.1:$port
metrics_listen: ""
backend: cpu
memory_budget: $((capacity * page_bytes + (16 << 20)))
high_watermark: 1.0
low_watermark: 0.99
worker_threads: 2
compute_threads: 1
${3:-}
YAML
  "$build/server/kvcd" serve --config "$work/$name.yaml" >"$work/$name.out" 2>"$work/$name.err" &
  local pid=$!
  pids+=("$pid")
  wait_for "$work/$name.out" "^kvcd ready" "$pid"
  printf -v "port_$name" %s "$port"
  printf -v "pid_$name" %s "$pid"
}
stop_daemon() {
  local pid_var="pid_$1"
  kill -TERM "${!pid_var}" 2>/dev/null || true
  wait "${!pid_var}" 2>/dev/null || true
}
common=(--trace "$trace" --requests "$requests" --capacity-pages "$cap" --high-watermark 1
  --low-watermark 0.99 --json --progress=false)
[[ -n $check ]] && common+=(--verify-every 1)
for mode in $modes; do
  redis-cli -p "$redis_port" flushall >/dev/null
  members=()
  for i in 0 1 2 3; do
    start_daemon "m$i" "$cap" "cluster:
  name: replay
  member_id: m$i
  membership: etcd
  etcd_endpoints: [127.0.0.1:$etcd_port]
  lease_ttl_s: 5
  redis_url: redis://127.0.0.1:$redis_port
  load_interval_ms: 200"
    port_var="port_m$i"
    members+=("127.0.0.1:${!port_var}")
  done
  registered() { etcdctl_ get --prefix /kvcd/replay/members/ --keys-only | grep -c members/ || true; }
  if [[ $mode == index ]]; then  # the index needs every member registered (bounded: 30 s)
    for _ in $(seq 300); do (($(registered) == 4)) && break; sleep 0.1; done
    (($(registered) == 4)) ||
      { echo "run-replay-cluster.sh: the members did not register in etcd" >&2; exit 1; }
  fi
  "$build/bench/kvcd-replay" "${common[@]}" --members "$(IFS=,; echo "${members[*]}")" \
    --routing "$mode" --redis-url "redis://127.0.0.1:$redis_port" --cluster-name replay \
    --cluster-json "$work/$mode.cluster.json" >"$work/$mode.json"
  redis-cli -p "$redis_port" info memory | tr -d '\r' | sed -n 's/^used_memory:\(.*\)/\1/p' >"$work/$mode.redis_bytes"
  redis-cli -p "$redis_port" eval "return #redis.call('keys', KEYS[1])" 1 'kvcd:{replay}:blk:*' \
    >"$work/$mode.redis_blocks"
  redis-cli -p "$redis_port" info commandstats | tr -d '\r' | grep -E '^cmdstat_(hset|hdel|sadd|srem|hgetall)' \
    >"$work/$mode.redis_cmds" || true
  for i in 0 1 2 3; do stop_daemon "m$i"; done
done
redis-cli -p "$redis_port" flushall >/dev/null
start_daemon big $((4 * cap))
"$build/bench/kvcd-replay" "${common[@]}" --capacity-pages $((4 * cap)) --target "127.0.0.1:$port_big" \
  >"$work/big.json"
stop_daemon big
python3 bench/replay-cluster-table.py $check "$work" "$trace" "$cap" $modes >"$out"
