"""kvcd.cluster: several daemons as one prefix cache (docs/cluster.md).

    from kvcd.cluster import BlockIndex, ClusterClient, EtcdMembership
    members = EtcdMembership("127.0.0.1:2379", "/kvcd/prod")
    with ClusterClient(members, BlockIndex("prod", url="redis://127.0.0.1:6379/0")) as cc:
        with cc.open("tiny", tokens, k=k, v=v) as s:
            o, lse = s.attention_decode(0, q)

Modules: block_hash (block identity v1), member and membership (etcd JSON gateway, DNS),
index (the Redis block index, redis-py: the ``cluster`` extra), routing (scores,
rendezvous, bounded load, hot prefixes), session (failover), merge (attention across
daemons), client (ClusterClient).
"""
from .block_hash import block_hash, block_hashes, event_id, to_hex
from .client import ClusterClient, history_format_name
from .index import BlockIndex, Load
from .member import Member, MemberError, parse_member
from .membership import DnsMembership, EtcdMembership, default_prefix
from .merge import merge_attention, merge_many
from .routing import Decision, HotPrefixes, RoutingConfig, decide
from .session import ClusterSession

__all__ = ["block_hash", "block_hashes", "event_id", "to_hex", "ClusterClient",
           "history_format_name", "BlockIndex", "Load", "Member", "MemberError",
           "parse_member", "DnsMembership", "EtcdMembership", "default_prefix",
           "merge_attention", "merge_many", "Decision", "HotPrefixes", "RoutingConfig",
           "decide", "ClusterSession"]
