# Network namespaces for test topologies (sourced; scripts/cluster-topology.sh uses it).
#
# One "bridge" namespace holds a Linux bridge; every node is a namespace of its own with one
# veth whose peer is a port of that bridge. Nodes get 10.<net>.0.<index>/24 and no route
# beyond that subnet; the bridge namespace has no address and no forwarding, and nothing is
# attached to the root namespace, so no packet of a topology can leave it. Cutting a node off
# sets its bridge port down: its processes keep running but reach nobody and nobody reaches
# them, as when a host's link fails.
#
# State lives in shell variables (NETNS_PREFIX, NETNS_NET) and the kernel's namespace list;
# netns_teardown removes every namespace whose name starts with the prefix, after killing the
# processes still inside them (all of them started in these namespaces by the topology).
#
#   netns_check                    0 when namespaces can be made here, else prints why
#   netns_init PREFIX NET          the bridge namespace (PREFIX: <= 8 chars; NET: 1..254)
#   netns_node NAME INDEX          a node namespace at 10.NET.0.INDEX
#   netns_name NAME / netns_addr INDEX    its namespace name / its address
#   netns_exec NAME CMD...         CMD inside the node's namespace
#   netns_cut NAME / netns_restore NAME   link down / up (the bridge side of its veth)
#   netns_teardown                 kills what runs inside, deletes every namespace

netns_check() {
  if ((EUID != 0)); then
    echo "network namespaces need root (running as uid $EUID)"
    return 1
  fi
  command -v ip >/dev/null || { echo "no ip(8) (iproute2)"; return 1; }
  local probe="kvcdprobe$$" err
  if ! err=$(ip netns add "$probe" 2>&1); then
    echo "ip netns add is not permitted here: $err"
    return 1
  fi
  if ! err=$(ip -n "$probe" link add kvcdprobe0 type veth peer name kvcdprobe1 2>&1); then
    ip netns del "$probe" 2>/dev/null
    echo "veth pairs cannot be made here: $err"
    return 1
  fi
  ip netns del "$probe"
}

netns_init() {  # PREFIX NET
  NETNS_PREFIX=$1 NETNS_NET=$2
  ip netns add "${NETNS_PREFIX}br" || return 1
  ip -n "${NETNS_PREFIX}br" link add br0 type bridge || return 1
  ip -n "${NETNS_PREFIX}br" link set br0 up || return 1
  # No address on the bridge and forwarding off: it switches between the nodes, nothing else.
  ip netns exec "${NETNS_PREFIX}br" sysctl -qw net.ipv4.ip_forward=0 net.ipv6.conf.all.disable_ipv6=1
}

netns_name() { echo "${NETNS_PREFIX}$1"; }
netns_addr() { echo "10.${NETNS_NET}.0.$1"; }

netns_node() {  # NAME INDEX
  local ns="${NETNS_PREFIX}$1" port="p-$1"
  ip netns add "$ns" || return 1
  ip link add eth0 netns "$ns" type veth peer name "$port" netns "${NETNS_PREFIX}br" || return 1
  ip -n "${NETNS_PREFIX}br" link set "$port" master br0 || return 1
  ip -n "${NETNS_PREFIX}br" link set "$port" up || return 1
  ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1
  ip -n "$ns" addr add "$(netns_addr "$2")/24" dev eth0 || return 1
  ip -n "$ns" link set lo up || return 1
  ip -n "$ns" link set eth0 up  # the /24 is the only route: no default route
}

netns_exec() {  # NAME CMD...
  local ns="${NETNS_PREFIX}$1"
  shift
  ip netns exec "$ns" "$@"
}

netns_cut() { ip -n "${NETNS_PREFIX}br" link set "p-$1" down; }
netns_restore() { ip -n "${NETNS_PREFIX}br" link set "p-$1" up; }

netns_teardown() {
  [[ -n ${NETNS_PREFIX:-} ]] || return 0
  local ns pid
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    [[ $ns == "${NETNS_PREFIX}"* ]] || continue
    # Only processes this topology started live in its namespaces.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null
  done
}
