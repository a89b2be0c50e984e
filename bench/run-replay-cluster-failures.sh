#!/usr/bin/env bash
# The cluster trace replay through failures (docs/cluster.md "When a part fails", issue 32):
# the public Mooncake trace replayed over 4 kvcd daemons on the CPU backend (etcd membership,
# Redis block index, index routing with peer pulls, all on loopback ports chosen at run time)
# twice on fresh daemons:
#   steady    nothing fails: the reference, and the overhead per stored page (Redis memory
#             of the index; ZeroMQ event bytes on the wire, read by bench/kvcd_events_meter.cc
#             subscribed to every daemon)
#   failures  the same trace while, at fixed points of it (kvcd-replay --hook): member m0 is
#             SIGKILLed (30% of the requests; the kill lands 20 ms later, while requests are
#             in flight), started again with a new incarnation (50%), and Redis is killed and
#             started empty (70%). Starts run in the background: the replay goes on while
#             the member or Redis comes up.
# kvcd-replay follows membership (--etcd-endpoints): a request whose member answers
# UNAVAILABLE is served again from its start on another member, a member whose key left
# etcd is out of routing, one back under a new incarnation rejoins. Every request's attention
# over its whole sequence is checked against a float64 reference of the K/V the replay sent
# (--verify-every 1): a page served with rows of another page is a wrong result.
#   bench/run-replay-cluster-failures.sh [--out FILE.md] [--requests N] [--capacity PAGES]
#                                        [--keep DIR]
# The replay goes on throughout: every kill and start runs in the background of the hook.
# Defaults: all requests, 1953 pages per daemon (as bench/run-replay-cluster.sh). Every server
# is torn down on exit, even on failure. Needs etcd, etcdctl, redis-server, redis-cli and the
# build's kvcd, kvcd-replay and kvcd-events-meter; the trace from ../shared/data/traces/ (or
# KVCD_TRACE).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVCD_BUILD_DIR:-build}
out=/dev/stdout requests=0 cap=1953 keep=""
while (($#)); do
  case $1 in
    --out) out=$2; shift 2 ;;
    --requests) requests=$2; shift 2 ;;
    --capacity) cap=$2; shift 2 ;;
    --keep) keep=$2; shift 2 ;;
    *) echo "run-replay-cluster-failures.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
trace=${KVCD_TRACE:-}
for t in ../shared/data/traces/mooncake_synthetic_trace.jsonl \
  ../../shared/data/traces/mooncake_synthetic_trace.jsonl; do
  [[ -n $trace ]] || { [[ -r $t ]] && trace=$t; }
done
[[ -r $trace ]] || { echo "run-replay-cluster-failures.sh: no trace (set KVCD_TRACE)" >&2; exit 77; }
for b in "$build/server/kvcd" "$build/bench/kvcd-replay" "$build/bench/kvcd-events-meter"; do
  [[ -x $b ]] || {
    echo "run-replay-cluster-failures.sh: $b is not built (scripts/build.sh kvcd kvcd-replay kvcd-events-meter)" >&2
    exit 1
  }
done
for b in etcd etcdctl redis-server redis-cli; do
  command -v "$b" >/dev/null || { echo "run-replay-cluster-failures.sh: $b is not installed" >&2; exit 77; }
done
work=$(mktemp -d)
mkdir -p "$work/pids"
cleanup() {
  local f
  for f in "$work"/pids/*; do [[ -e $f ]] && kill -KILL "$(cat "$f")" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [[ -n $keep ]] && { mkdir -p "$keep"; cp -r "$work"/. "$keep"/; }
  rm -rf "$work"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
etcd_port=$(free_port) peer_port=$(free_port) redis_port=$(free_port)
cat >"$work/env.sh" <<ENV
work=$work build=$PWD/$build etcd_port=$etcd_port peer_port=$peer_port redis_port=$redis_port
ENV
# The servers' starts and stops: used here and, during the replay, by its hook (ctl.sh).
cat >"$work/ctl.sh" <<'CTL'
#!/usr/bin/env bash
# ctl.sh VERB NAME: start a server in the background (pid in pids/NAME) and wait until it is
# ready (bounded: 60 s); kill (SIGKILL) one and wait until it is gone.
set -euo pipefail
source "$(dirname "$0")/env.sh"
ready() {  # LOG PATTERN PID
  for _ in $(seq 600); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    kill -0 "$3" 2>/dev/null || { cat "$1" >&2; echo "$1: the process exited before it was ready" >&2; return 1; }
    sleep 0.1
  done
  echo "$1: not ready in 60 s" >&2; return 1
}
verb=$1 name=$2
case $verb in
  start)
    case $name in
      etcd)
        etcd --name replay --data-dir "$work/etcd" --listen-client-urls "http://127.0.0.1:$etcd_port" \
          --advertise-client-urls "http://127.0.0.1:$etcd_port" --listen-peer-urls "http://127.0.0.1:$peer_port" \
          --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
          --initial-cluster "replay=http://127.0.0.1:$peer_port" >>"$work/etcd.log" 2>&1 &
        log=$work/etcd.log pattern="ready to serve client requests" ;;
      redis)  # never persists: every start is an empty Redis
        redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no >"$work/redis.log" 2>&1 &
        log=$work/redis.log pattern="Ready to accept connections" ;;
      *)
        "$build/server/kvcd" serve --config "$work/$name.yaml" >"$work/$name.out" 2>>"$work/$name.err" &
        log=$work/$name.out pattern="^kvcd ready" ;;
    esac
    echo $! >"$work/pids/$name"
    ready "$log" "$pattern" "$!" ;;
  kill)
    pid=$(cat "$work/pids/$name")
    kill -KILL "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    rm -f "$work/pids/$name" ;;
  *) echo "ctl.sh: unknown verb $verb" >&2; exit 2 ;;
esac
CTL
chmod +x "$work/ctl.sh"
ctl() { "$work/ctl.sh" "$@"; }
export ETCDCTL_API=3
etcdctl_() { etcdctl --endpoints "127.0.0.1:$etcd_port" "$@"; }
registered() { etcdctl_ get --prefix /kvcd/replay/members/ --keys-only | grep -c members/ || true; }
page_bytes=8192  # page 16 tokens x 2 layers x 2 kv heads x head_dim 32, K and V, BF16
ctl start etcd
ctl start redis

# start_members: 4 fresh daemons (new ports each time); sets members and events.
start_members() {
  members=() events=()
  local i port ev
  for i in 0 1 2 3; do
    port=$(free_port) ev=$(free_port)
    cat >"$work/m$i.yaml" <<YAML
listen: 127.0.0.1:$port
metrics_listen: ""
backend: cpu
memory_budget: $((cap * page_bytes + (16 << 20)))
high_watermark: 1.0
low_watermark: 0.99
worker_threads: 2
compute_threads: 1
cluster:
  name: replay
  member_id: m$i
  membership: etcd
  etcd_endpoints: [127.0.0.1:$etcd_port]
  lease_ttl_s: 3
  redis_url: redis://127.0.0.1:$redis_port
  load_interval_ms: 250
  events_endpoint: tcp://127.0.0.1:$ev
YAML
    ctl start "m$i"
    members+=("127.0.0.1:$port")
    events+=("tcp://127.0.0.1:$ev")
  done
  for _ in $(seq 300); do (($(registered) == 4)) && break; sleep 0.1; done
  (($(registered) == 4)) || { echo "run-replay-cluster-failures.sh: the members did not register" >&2; exit 1; }
}
stop_members() {
  local i
  for i in 0 1 2 3; do
    [[ -e $work/pids/m$i ]] || continue
    kill -TERM "$(cat "$work/pids/m$i")" 2>/dev/null || true
    for _ in $(seq 200); do kill -0 "$(cat "$work/pids/m$i")" 2>/dev/null || break; sleep 0.05; done
    ctl kill "m$i"
  done
}
replay() {  # NAME [kvcd-replay flags...]
  local name=$1
  shift
  "$build/bench/kvcd-replay" --trace "$trace" --requests "$requests" --capacity-pages "$cap" \
    --high-watermark 1 --low-watermark 0.99 --json --progress=false \
    --members "$(IFS=,; echo "${members[*]}")" --routing index --redis-url "redis://127.0.0.1:$redis_port" \
    --cluster-name replay --etcd-endpoints "127.0.0.1:$etcd_port" --verify-every 1 \
    --cluster-json "$work/$name.cluster.json" "$@" >"$work/$name.json"
}

# 1. steady, with the events meter on every daemon's publisher.
start_members
"$build/bench/kvcd-events-meter" --endpoints "$(IFS=,; echo "${events[*]}")" >"$work/events.json" &
meter=$!
echo $meter >"$work/pids/meter"
for _ in $(seq 100); do grep -q subscribed "$work/events.json" && break; sleep 0.1; done
grep -q subscribed "$work/events.json" || { echo "run-replay-cluster-failures.sh: the events meter did not subscribe" >&2; exit 1; }
replay steady
kill -TERM "$meter"
wait "$meter" || true
sed -i '/^subscribed$/d' "$work/events.json"
redis-cli -p "$redis_port" info memory | tr -d '\r' | sed -n 's/^used_memory:\(.*\)/\1/p' >"$work/steady.redis_bytes"
redis-cli -p "$redis_port" eval "return #redis.call('keys', KEYS[1])" 1 'kvcd:{replay}:blk:*' >"$work/steady.redis_blocks"
stop_members
redis-cli -p "$redis_port" flushall >/dev/null

# 2. failures at fixed points of the trace.
n=$requests
((n > 0)) || n=$(wc -l <"$trace")
kill_at=$((n * 30 / 100)) start_at=$((n * 50 / 100)) redis_at=$((n * 70 / 100))
start_members
# The hook: its number and the request's position as arguments; it logs what it did and when
# (the replay's records carry their own times).
cat >"$work/hook.sh" <<HOOK
#!/usr/bin/env bash
set -euo pipefail
t=\$(date +%s.%N)
case \$1 in
  0) inc() {  # m0's incarnation in etcd ("" without a key); fails when etcd does not answer
       local v
       v=\$(ETCDCTL_API=3 etcdctl --endpoints 127.0.0.1:$etcd_port get /kvcd/replay/members/m0 --print-value-only) || return 1
       grep -o '"incarnation":"[0-9a-f]*"' <<<"\$v" || true
     }
     killed=\$(inc)
     (sleep 0.02; "$work/ctl.sh" kill m0) >/dev/null 2>&1 &
     # When etcd dropped the killed incarnation's key (its lease ended), or a restart replaced
     # it first: polled, bounded (20 s).
     (for _ in \$(seq 400); do
        now=\$(inc) || { sleep 0.05; continue; }
        [[ -z \$now ]] && { echo "lease_gone \$(date +%s.%N)" >>"$work/hook.log"; break; }
        [[ \$now != "\$killed" ]] && { echo "replaced \$(date +%s.%N)" >>"$work/hook.log"; break; }
        sleep 0.05
      done) >/dev/null 2>&1 &
     echo "kill m0 \$2 \$t" >>"$work/hook.log" ;;
  1) # In the background: the replay goes on while m0 starts; it rejoins once registered.
     ("$work/ctl.sh" start m0 && echo "m0_ready \$(date +%s.%N)" >>"$work/hook.log") >/dev/null 2>&1 &
     echo "start m0 \$2 \$t" >>"$work/hook.log" ;;
  2) # Killed and started again in the background: requests meet Redis down, then empty.
     (echo "redis_kill \$(date +%s.%N)" >>"$work/hook.log" && "$work/ctl.sh" kill redis &&
      "$work/ctl.sh" start redis && echo "redis_ready \$(date +%s.%N)" >>"$work/hook.log") >/dev/null 2>&1 &
     echo "restart redis \$2 \$t" >>"$work/hook.log" ;;
esac
HOOK
chmod +x "$work/hook.sh"
replay failures --hook "$work/hook.sh" --hook-at "$kill_at,$start_at,$redis_at"
stop_members
python3 bench/replay-failures-table.py "$work" "$trace" "$cap" >"$out"
