"""kvcd.cluster with real daemons, etcd and Redis on loopback: sessions routed by the index,
a member killed (SIGKILL) under a session (re-opened elsewhere, re-prefilled, right answers),
fork and commit through the session, and attention across two daemons merged exactly
against one daemon holding everything.

The daemons register themselves in etcd and write the block index (the cluster section of
their config); the test waits on those writes, bounded in time."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from kvcd.cluster import (BlockIndex, ClusterClient, EtcdMembership, RoutingConfig,
                          block_hashes, to_hex)
from conftest import (Daemon, bf16_round, random_kv, random_tokens, reference_attention,
                      wait_until)
from cluster_services import Etcd, Redis, free_port

CLUSTER = "sessions"
PREFIX = f"/kvcd/{CLUSTER}"
CONFIG = """
listen: 127.0.0.1:0
metrics_listen: ""
memory_budget: 64MiB
lease: {{default_ms: 5000, max_ms: 60000}}
drain_timeout_ms: 300
models:
  - builtin: tiny
    memory: 1MiB
cluster:
  name: {cluster}
  member_id: {member}
  membership: etcd
  etcd_endpoints: [{etcd}]
  lease_ttl_s: 3
  redis_url: {redis}
  load_interval_ms: 100
"""


class Member:
    def __init__(self, etcd: Etcd, redis: Redis, member_id: str) -> None:
        self.id = member_id
        self.daemon = Daemon(CONFIG.format(cluster=CLUSTER, member=member_id,
                                           etcd=etcd.endpoint, redis=f"redis://127.0.0.1:{redis.port}"))


@pytest.fixture
def cluster():
    etcd, redis = Etcd(), Redis()
    members = []
    try:
        members = [Member(etcd, redis, "m0"), Member(etcd, redis, "m1")]
        ms = EtcdMembership(etcd.endpoint, PREFIX)
        assert ms.wait_until(lambda m: len(m) == 2, 20)
        for m in members:
            m.incarnation = ms.members()[m.id].incarnation
        cc = ClusterClient(ms, BlockIndex(CLUSTER, url=redis.url),
                           config=RoutingConfig(replicate_after=0), timeout=10)
        yield cc, members, redis.client(), etcd
        cc.close()
        ms.close()
    finally:
        for m in members:
            m.daemon.stop()
        redis.stop()
        etcd.stop()


def stored(r, member, tokens, page_size) -> None:
    """Index entries as a daemon writes them, for pages it does not hold (a stale entry)."""
    for h in block_hashes("tiny", "", "bf16", page_size, tokens):
        r.hset(f"kvcd:{{{CLUSTER}}}:blk:{to_hex(h)}", member.id, f"{member.incarnation}:host")


def test_session_is_routed_to_the_holder_and_hits(cluster):
    cc, members, r, _ = cluster
    c1 = cc.client("m1")
    p = c1.profile("tiny")
    toks = random_tokens(40, 1)
    k, v = random_kv(p, 40, 1)
    prefix = 4 * p.page_size
    # Before anything is stored nobody is credited: rendezvous decides.
    assert cc.route("tiny", toks).reason == "rendezvous"
    c1.put("tiny", toks[:prefix], k[:, :prefix], v[:, :prefix])
    # m1 writes the index from a background thread: wait (bounded) for the route to follow.
    assert wait_until(lambda: cc.route("tiny", toks).reason == "index", 20)
    d = cc.route("tiny", toks)
    assert (d.member_id, d.hit_pages, d.reason) == ("m1", 4, "index")
    with cc.open("tiny", toks, k=k, v=v) as s:
        assert s.member_id == "m1" and s.sequence.matched_tokens == prefix
        q = np.random.default_rng(1).standard_normal((1, p.num_q_heads, p.head_dim),
                                                    ).astype(np.float32)
        o, lse = s.attention_decode(0, q)
        ro, rl = reference_attention(q[0], bf16_round(k[0]), bf16_round(v[0]))
        np.testing.assert_allclose(o[0], ro, rtol=1e-4, atol=1e-5)
    # A stale entry (the page is gone from m0, or never was) costs a miss, not an error.
    other = random_tokens(20, 2)
    stored(r, members[0], other, p.page_size)
    ko, vo = random_kv(p, 20, 2)
    with cc.open("tiny", other, k=ko, v=vo) as s:
        assert s.member_id == "m0" and s.sequence.matched_tokens == 0 and s.sequence.length == 20


def test_a_killed_member_is_replaced_and_the_session_re_prefilled(cluster):
    cc, members, _, _ = cluster
    p = cc.client("m0").profile("tiny")
    toks = random_tokens(37, 3)
    k, v = random_kv(p, 40, 3)
    s = cc.open("tiny", toks, k=k[:, :37], v=v[:, :37])
    first = s.member_id
    victim = next(m for m in members if m.id == first)
    os.kill(victim.daemon.proc.pid, signal.SIGKILL)
    victim.daemon.proc.wait()
    # The next call meets UNAVAILABLE: the session moves and re-sends every token.
    assert s.append(random_tokens(3, 4), k[:, 37:], v[:, 37:]) == 40
    assert s.member_id != first and s.failovers == 1 and s.reprefilled_tokens == 37
    rng = np.random.default_rng(3)
    for layer in range(p.num_layers):
        q = rng.standard_normal((1, p.num_q_heads, p.head_dim)).astype(np.float32)
        o, lse = s.attention_decode(layer, q)
        ro, rl = reference_attention(q[0], bf16_round(k[layer]), bf16_round(v[layer]))
        np.testing.assert_allclose(o[0], ro, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lse[0], rl, rtol=1e-5, atol=1e-5)
    # New sessions avoid the dead member (still in etcd until its lease ends).
    t = cc.open("tiny", random_tokens(5, 9), k=k[:, :5], v=v[:, :5])
    assert t.member_id == s.member_id
    t.close()
    assert s.close(commit=True) == 40


def test_an_unreachable_index_routes_by_rendezvous(cluster):
    """The index is a hint: with its Redis not answering (nothing listens on the port),
    routing falls back to rendezvous and sessions still open and answer right."""
    cc, members, _, _ = cluster
    dead = BlockIndex(CLUSTER, url=f"redis://127.0.0.1:{free_port()}/0", timeout=0.5)
    with ClusterClient(cc.membership, dead, timeout=10) as blind:
        p = blind.client("m0").profile("tiny")
        toks = random_tokens(24, 11)
        k, v = random_kv(p, 24, 11)
        d = blind.route("tiny", toks)
        assert d.reason == "rendezvous" and blind.index_errors == 1
        with blind.open("tiny", toks, k=k, v=v) as s:
            assert s.member_id in {m.id for m in members} and blind.index_errors == 2
            q = np.random.default_rng(11).standard_normal(
                (1, p.num_q_heads, p.head_dim)).astype(np.float32)
            o, _ = s.attention_decode(0, q)
            ro, _ = reference_attention(q[0], bf16_round(k[0]), bf16_round(v[0]))
            np.testing.assert_allclose(o[0], ro, rtol=1e-4, atol=1e-5)


def test_fork_and_commit_through_the_session(cluster):
    cc, _, _, _ = cluster
    p = cc.client("m0").profile("tiny")
    toks = random_tokens(2 * p.page_size, 5)
    k, v = random_kv(p, len(toks), 5)
    with cc.open("tiny", toks, k=k, v=v) as s:
        twin = s.fork()
        assert twin.member_id == s.member_id and twin.sequence.length == len(toks)
        assert s.commit().inserted_pages == 2
        twin.close()
        m = cc.client(s.member_id).match("tiny", toks)
        assert m.matched_tokens == len(toks)
    with pytest.raises(ValueError, match="closed"):
        s.commit()
    with cc.open("tiny", toks) as again:  # no K/V needed: the member holds every page
        assert again.sequence.matched_tokens == len(toks)


def test_attention_across_two_daemons_equals_one_daemon(cluster):
    cc, _, _, _ = cluster
    a, b = cc.client("m0"), cc.client("m1")
    p = a.profile("tiny")
    n_hist, n_own = 5 * p.page_size + 3, 11
    toks = random_tokens(n_hist + n_own, 6)
    k, v = random_kv(p, n_hist + n_own, 6)
    rng = np.random.default_rng(6)
    with a.open_sequence("tiny", toks[:n_hist], k=k[:, :n_hist], v=v[:, :n_hist]) as hist, \
            b.open_sequence("tiny", toks[n_hist:], k=k[:, n_hist:], v=v[:, n_hist:],
                            cache_salt="split-own-turns") as own, \
            a.open_sequence("tiny", toks, k=k, v=v, cache_salt="whole") as whole:
        for layer in range(p.num_layers):
            q = rng.standard_normal((1, p.num_q_heads, p.head_dim)).astype(np.float32)
            o, lse = cc.attend_across(layer, q, hist, own)
            wo, wl = whole.attention_decode(layer, q)
            np.testing.assert_allclose(o, wo, rtol=2e-5, atol=2e-6)
            np.testing.assert_allclose(lse, wl, rtol=1e-5, atol=1e-5)
