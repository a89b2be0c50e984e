#!/usr/bin/env bash
# A kvcd cluster on one machine, in network namespaces this script makes (docs/cluster.md
# "Running a cluster"): etcd, Redis and N daemons (CPU backend), each in a namespace of its
# own, joined by veth pairs to a bridge in one more namespace, on 10.<net>.0.0/24 with no
# route beyond it (scripts/netns-lib.sh). Runs COMMAND in a "client" namespace of the same
# subnet, then tears everything down: on every exit path, SIGINT and SIGTERM included, and
# at the latest after --timeout seconds.
#
#   scripts/cluster-topology.sh [options] [-- COMMAND ARGS...]
#     --daemons N         daemons (default 4), member ids member-0 .. member-(N-1)
#     --membership M      etcd (default) or none (independent daemons: the per-daemon
#                         baseline; no etcd, no Redis)
#     --lease-ttl S       cluster.lease_ttl_s of the daemons (default 10)
#     --load-interval MS  cluster.load_interval_ms (default 500)
#     --memory-budget B   each daemon's memory_budget (default 96MiB)
#     --timeout S         the whole run, start-up and teardown included (default 170)
#     --name NAME         the cluster's name (default topo)
#   Without COMMAND it prints the topology and waits for SIGINT or the timeout.
#   scripts/cluster-topology.sh ctl VERB [NAME]   (from COMMAND, which gets $KVCD_TOPO_DIR)
#     kill NAME           SIGKILL (a daemon, etcd or redis) and wait until it is gone
#     start NAME          start it again (a daemon: a new incarnation, same address) and
#                         wait until it is ready
#     restart NAME        kill + start (redis comes back empty: it never persists)
#     wipe-etcd           etcd's data directory removed (between kill and start: an empty etcd)
#     cut NAME / restore NAME   its link down / up
#     pid NAME / addr NAME      its pid / its address (host:port)
#
# COMMAND's environment: KVCD_TOPO_DIR (state and logs), KVCD_TOPO_CTL (this script's path:
# "$KVCD_TOPO_CTL ctl VERB NAME"), KVCD_TOPO_MEMBERS ("member-0=10.N.0.10:50051 ..."),
# KVCD_TOPO_ETCD (http://host:port), KVCD_TOPO_REDIS (redis://host:port), KVCD_TOPO_CLUSTER
# (the name), KVCD_TOPO_LEASE_TTL_S, KVCD_TOPO_LOAD_INTERVAL_MS. The exit status is COMMAND's
# (124 when the timeout ended it). Needs root and permission to make network namespaces;
# where there is none it prints why and exits 0 with "SKIP" (77 with --strict-skip).
set -uo pipefail
self=$(readlink -f "$0")
root=$(cd "$(dirname "$self")/.." && pwd)
source "$root/scripts/netns-lib.sh"
build=${KVCD_BUILD_DIR:-build}
[[ $build == /* ]] || build=$root/$build
kvcd_bin=${KVCD_BIN:-$build/server/kvcd}

etcd_port=2379 redis_port=6379 grpc_port=50051 events_port=5557 replay_port=5558

# --- state (the environment of COMMAND, and of `ctl` run from it) ---------------------------
load_state() {
  [[ -n ${KVCD_TOPO_DIR:-} && -r $KVCD_TOPO_DIR/topology.env ]] ||
    { echo "cluster-topology: ctl needs KVCD_TOPO_DIR (run it from the topology's COMMAND)" >&2; exit 2; }
  source "$KVCD_TOPO_DIR/topology.env"
}

# node NAME -> index (addresses: etcd .2, redis .3, member-i .(10+i), client .100)
node_index() {
  case $1 in
    etcd) echo 2 ;;
    redis) echo 3 ;;
    client) echo 100 ;;
    member-*) echo $((10 + ${1#member-})) ;;
    *) return 1 ;;
  esac
}

is_member() { [[ $1 == member-* ]] && ((${1#member-} < NDAEMONS)) 2>/dev/null; }

# Waits (bounded) until CMD succeeds; TIMEOUT in tenths of a second.
wait_until() {  # TENTHS WHAT CMD...
  local tenths=$1 what=$2 i
  shift 2
  for ((i = 0; i < tenths; i++)); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "cluster-topology: $what not ready after $((tenths / 10)) s" >&2
  return 1
}

write_member_config() {  # NAME
  local name=$1 addr
  addr=$(netns_addr "$(node_index "$name")")
  {
    cat <<YAML
listen: $addr:$grpc_port
metrics_listen: ""
backend: cpu
memory_budget: $MEMORY_BUDGET
high_watermark: 1.0
low_watermark: 0.99
worker_threads: 2
compute_threads: 1
drain_timeout_ms: 1000
YAML
    if [[ $MEMBERSHIP == etcd ]]; then
      cat <<YAML
cluster:
  name: $CLUSTER
  member_id: $name
  membership: etcd
  etcd_endpoints: ["$(netns_addr 2):$etcd_port"]
  lease_ttl_s: $LEASE_TTL
  redis_url: redis://$(netns_addr 3):$redis_port
  load_interval_ms: $LOAD_INTERVAL
  advertise_address: $addr:$grpc_port
  events_endpoint: tcp://$addr:$events_port
  events_replay_endpoint: tcp://$addr:$replay_port
YAML
    fi
  } >"$KVCD_TOPO_DIR/$name.yaml"
}

# Starts NAME in its namespace, output in logs/NAME.{out,err}, pid in pids/NAME.
spawn() {  # NAME CMD...
  local name=$1
  shift
  : >"$KVCD_TOPO_DIR/logs/$name.out"
  echo "--- start $(date -u +%T.%N)" >>"$KVCD_TOPO_DIR/logs/$name.err"
  # A simple command: $! is the process that `ip netns exec` turns into the server.
  ip netns exec "$(netns_name "$name")" "$@" </dev/null >"$KVCD_TOPO_DIR/logs/$name.out" \
    2>>"$KVCD_TOPO_DIR/logs/$name.err" &
  echo $! >"$KVCD_TOPO_DIR/pids/$name"
  disown $!  # ended by pid (teardown, ctl kill), without a job notice
}

# Succeeds once NAME printed its ready line or exited (start_node then tells which).
ready_or_dead() { grep -q '^kvcd ready' "$KVCD_TOPO_DIR/logs/$1.out" || ! alive "$1"; }

# A process that exited but is not reaped yet (a zombie: its parent may be gone) is not running.
running() {  # PID
  local st
  st=$(sed -n 's/^[0-9]* (.*) \([A-Z]\).*/\1/p' "/proc/$1/stat" 2>/dev/null)
  [[ -n $st && $st != Z && $st != X ]]
}
alive() { [[ -r $KVCD_TOPO_DIR/pids/$1 ]] && running "$(cat "$KVCD_TOPO_DIR/pids/$1")"; }

start_node() {  # NAME: starts it and waits until it serves
  local name=$1 addr
  addr=$(netns_addr "$(node_index "$name")")
  alive "$name" && { echo "cluster-topology: $name is already running" >&2; return 1; }
  case $name in
    etcd)
      spawn etcd etcd --name topo-etcd --data-dir "$KVCD_TOPO_DIR/etcd-data" \
        --listen-client-urls "http://$addr:$etcd_port" --advertise-client-urls "http://$addr:$etcd_port" \
        --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
        --initial-cluster topo-etcd=http://127.0.0.1:2380 --log-level warn
      wait_until 200 etcd netns_exec client etcdctl --endpoints "$addr:$etcd_port" \
        --command-timeout=1s endpoint health
      ;;
    redis)
      # Never persists: a restart is a Redis that comes back empty.
      spawn redis redis-server --bind "$addr" --port "$redis_port" --save "" --appendonly no \
        --protected-mode no --daemonize no --loglevel warning
      wait_until 100 redis netns_exec client redis-cli -h "$addr" -p "$redis_port" ping
      ;;
    member-*)
      # --insecure: the veth subnet is the topology's own, reachable from nowhere else.
      spawn "$name" "$kvcd_bin" serve --insecure --config "$KVCD_TOPO_DIR/$name.yaml"
      wait_until 300 "$name" ready_or_dead "$name" && alive "$name" || return 1
      ;;
    *) echo "cluster-topology: no node $name" >&2; return 2 ;;
  esac
  alive "$name" || { echo "cluster-topology: $name exited at start:" >&2; tail -20 "$KVCD_TOPO_DIR/logs/$name.err" >&2; return 1; }
}

kill_node() {  # NAME: SIGKILL and wait until it is gone (bounded)
  local name=$1 pid
  alive "$name" || { echo "cluster-topology: $name is not running" >&2; return 1; }
  pid=$(cat "$KVCD_TOPO_DIR/pids/$name")
  kill -KILL "$pid"
  # Our child when started by this process; a grandchild of the topology otherwise.
  wait "$pid" 2>/dev/null
  wait_until 100 "the end of $name" eval "! running $pid"
  rm -f "$KVCD_TOPO_DIR/pids/$name"
}

ctl() {
  load_state
  local verb=${1:-} name=${2:-}
  case $verb in
    kill | start | restart | cut | restore | pid | addr)
      node_index "$name" >/dev/null && { [[ $name != member-* ]] || is_member "$name"; } ||
        { echo "cluster-topology: no node '$name' (etcd, redis, member-0..member-$((NDAEMONS - 1)))" >&2; exit 2; } ;;
    wipe-etcd) ;;
    *) echo "cluster-topology: unknown ctl verb '$verb' (kill start restart wipe-etcd cut restore pid addr)" >&2; exit 2 ;;
  esac
  case $verb in
    kill) kill_node "$name" ;;
    start) start_node "$name" ;;
    restart) kill_node "$name" && start_node "$name" ;;
    wipe-etcd)
      alive etcd && { echo "cluster-topology: kill etcd before wiping it" >&2; exit 1; }
      rm -rf "$KVCD_TOPO_DIR/etcd-data" ;;
    cut) netns_cut "$name" ;;
    restore) netns_restore "$name" ;;
    pid) cat "$KVCD_TOPO_DIR/pids/$name" ;;
    addr)
      case $name in
        etcd) echo "$(netns_addr 2):$etcd_port" ;;
        redis) echo "$(netns_addr 3):$redis_port" ;;
        *) echo "$(netns_addr "$(node_index "$name")"):$grpc_port" ;;
      esac ;;
  esac
}

if [[ ${1:-} == ctl ]]; then
  shift
  ctl "$@"
  exit
fi

# --- the topology -----------------------------------------------------------------------------
NDAEMONS=4 MEMBERSHIP=etcd LEASE_TTL=10 LOAD_INTERVAL=500 MEMORY_BUDGET=96MiB CLUSTER=topo
timeout_s=170 strict_skip=0 cmd=()
usage() { sed -n '2,/^set -uo/p' "$self" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
while (($#)); do
  case $1 in
    --daemons) NDAEMONS=$2; shift 2 ;;
    --membership) MEMBERSHIP=$2; shift 2 ;;
    --lease-ttl) LEASE_TTL=$2; shift 2 ;;
    --load-interval) LOAD_INTERVAL=$2; shift 2 ;;
    --memory-budget) MEMORY_BUDGET=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    --name) CLUSTER=$2; shift 2 ;;
    --strict-skip) strict_skip=1; shift ;;
    --) shift; cmd=("$@"); break ;;
    -h | --help) usage ;;
    *) echo "cluster-topology: unknown argument '$1'" >&2; usage ;;
  esac
done
[[ $NDAEMONS =~ ^[0-9]+$ ]] && ((NDAEMONS >= 1 && NDAEMONS <= 80)) ||
  { echo "cluster-topology: --daemons must be 1..80, got '$NDAEMONS'" >&2; exit 2; }
[[ $MEMBERSHIP == etcd || $MEMBERSHIP == none ]] ||
  { echo "cluster-topology: --membership must be etcd or none, got '$MEMBERSHIP'" >&2; exit 2; }
[[ $timeout_s =~ ^[0-9]+$ ]] && ((timeout_s >= 10)) ||
  { echo "cluster-topology: --timeout must be >= 10 seconds, got '$timeout_s'" >&2; exit 2; }
[[ -x $kvcd_bin ]] || { echo "cluster-topology: $kvcd_bin is not built (scripts/build.sh kvcd)" >&2; exit 1; }
if ! why=$(netns_check); then
  echo "cluster-topology: SKIP: $why"
  exit $((strict_skip ? 77 : 0))
fi
if [[ $MEMBERSHIP == etcd ]]; then
  for b in etcd etcdctl redis-server redis-cli; do
    command -v $b >/dev/null || { echo "cluster-topology: $b is missing (scripts/install-deps.sh)" >&2; exit 1; }
  done
fi

deadline=$((SECONDS + timeout_s))
export KVCD_TOPO_DIR
KVCD_TOPO_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvcd-topology.XXXXXX")
mkdir -p "$KVCD_TOPO_DIR/logs" "$KVCD_TOPO_DIR/pids"
# A namespace prefix and subnet of this run's own: two runs at once never meet.
NETNS_PREFIX="kt$(printf %05d $(($$ % 100000)))"
NET=$((($$ % 250) + 2))
cmd_pid="" status=0

teardown() {
  local rc=$? f
  trap '' INT TERM
  ((status == 0)) && status=$rc
  [[ -n $cmd_pid ]] && kill -TERM "$cmd_pid" 2>/dev/null
  # Daemons first (SIGKILL: nothing of a test topology needs to be kept), then etcd and Redis,
  # then the namespaces with anything still in them.
  {
    for f in "$KVCD_TOPO_DIR"/pids/*; do
      [[ -e $f ]] && kill -KILL "$(cat "$f")"
    done
    wait
  } 2>/dev/null
  netns_teardown
  if ((status != 0 && status != 130)) && [[ -d $KVCD_TOPO_DIR/logs ]]; then
    for f in "$KVCD_TOPO_DIR"/logs/*.err; do
      [[ -s $f ]] || continue
      echo "--- cluster-topology: last lines of $(basename "$f")" >&2
      tail -15 "$f" >&2
    done
  fi
  rm -rf "$KVCD_TOPO_DIR"
  echo "cluster-topology: torn down ($((SECONDS)) s)" >&2
  exit "$status"
}
trap teardown EXIT
trap 'status=130; exit 130' INT
trap 'status=143; exit 143' TERM

cat >"$KVCD_TOPO_DIR/topology.env" <<ENV
NETNS_PREFIX=$NETNS_PREFIX
NETNS_NET=$NET
NDAEMONS=$NDAEMONS
MEMBERSHIP=$MEMBERSHIP
LEASE_TTL=$LEASE_TTL
LOAD_INTERVAL=$LOAD_INTERVAL
MEMORY_BUDGET=$MEMORY_BUDGET
CLUSTER=$CLUSTER
kvcd_bin=$kvcd_bin
ENV
NETNS_NET=$NET
netns_init "$NETNS_PREFIX" "$NET" || { echo "cluster-topology: the bridge namespace failed" >&2; exit 1; }
nodes=(client)
[[ $MEMBERSHIP == etcd ]] && nodes+=(etcd redis)
members=()
for ((i = 0; i < NDAEMONS; i++)); do members+=("member-$i"); done
nodes+=("${members[@]}")
for n in "${nodes[@]}"; do
  netns_node "$n" "$(node_index "$n")" || { echo "cluster-topology: namespace $n failed" >&2; exit 1; }
done
if [[ $MEMBERSHIP == etcd ]]; then
  start_node etcd || exit 1
  start_node redis || exit 1
fi
member_list=()
for m in "${members[@]}"; do
  write_member_config "$m"
  start_node "$m" || exit 1
  member_list+=("$m=$(netns_addr "$(node_index "$m")"):$grpc_port")
done
export KVCD_TOPO_CTL=$self KVCD_TOPO_MEMBERS="${member_list[*]}" KVCD_TOPO_CLUSTER=$CLUSTER
export KVCD_TOPO_LEASE_TTL_S=$LEASE_TTL KVCD_TOPO_LOAD_INTERVAL_MS=$LOAD_INTERVAL
if [[ $MEMBERSHIP == etcd ]]; then
  export KVCD_TOPO_ETCD=http://$(netns_addr 2):$etcd_port KVCD_TOPO_REDIS=redis://$(netns_addr 3):$redis_port
  # Ready: every member's key is in etcd.
  members_in_etcd() {
    local n
    n=$(netns_exec client etcdctl --endpoints "$(netns_addr 2):$etcd_port" --command-timeout=1s \
      get --prefix "/kvcd/$CLUSTER/members/" --keys-only | grep -c .)
    ((n == NDAEMONS))
  }
  wait_until 200 "membership (all $NDAEMONS members in etcd)" members_in_etcd || exit 1
fi
echo "cluster-topology: up in $SECONDS s: ${nodes[*]} on 10.$NET.0.0/24 (namespaces ${NETNS_PREFIX}*)"
echo "cluster-topology: members $KVCD_TOPO_MEMBERS${KVCD_TOPO_ETCD:+, etcd $KVCD_TOPO_ETCD, redis $KVCD_TOPO_REDIS}"

left=$((deadline - SECONDS))
((left > 5)) || { echo "cluster-topology: no time left for the command" >&2; exit 124; }
if ((${#cmd[@]} == 0)); then
  echo "cluster-topology: waiting (SIGINT ends it; at the latest in $left s)."
  echo "  e.g. ip netns exec $(netns_name client) $build/client/kvctl --target ${member_list[0]#*=} stats"
  sleep "$left" &
  cmd_pid=$!
  wait "$cmd_pid"
  exit 0
fi
# COMMAND in the client namespace, bounded by what is left of the timeout.
netns_exec client timeout -k 5 "$left" "${cmd[@]}" &
cmd_pid=$!
wait "$cmd_pid"
status=$?
cmd_pid=""
((status == 124)) && echo "cluster-topology: the command ran past the timeout (${timeout_s} s)" >&2
exit "$status"
