"""kvcd.cluster against real etcd and Redis servers: membership through etcd's JSON gateway
(range, watch, leases ending), hostile values refused, and the Redis block index fenced by
incarnation."""
from __future__ import annotations

import json

import pytest

from kvcd.cluster import BlockIndex, EtcdMembership, Load, block_hashes, to_hex
from cluster_services import Etcd, Redis


def member_value(member_id: str, port: int, incarnation: str = "0123456789abcdef") -> bytes:
    return json.dumps({"member_id": member_id, "address": f"127.0.0.1:{port}",
                       "backend": "cpu", "capacity_pages": 64, "page_bytes": 4096,
                       "incarnation": incarnation, "started_unix_ms": 1,
                       "version": "test", "events_endpoint": ""}).encode()


@pytest.fixture(scope="module")
def etcd():
    e = Etcd()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def redis_server():
    r = Redis()
    yield r
    r.stop()


def test_membership_ranges_then_watches_and_forgets_an_ended_lease(etcd):
    prefix = "/kvcd/watch-test"
    etcd.put(f"{prefix}/members/a", member_value("a", 1001))
    with EtcdMembership(etcd.endpoint, prefix) as ms:
        assert set(ms.members()) == {"a"}  # the first range
        lease = etcd.grant(30)
        etcd.put(f"{prefix}/members/b", member_value("b", 1002), lease)
        assert ms.wait_until(lambda m: "b" in m, 10)
        assert ms.members()["b"].address == "127.0.0.1:1002"
        etcd.revoke(lease)  # what a lost daemon's expiry does
        assert ms.wait_until(lambda m: "b" not in m, 10)
        # A restart: same id, another incarnation.
        etcd.put(f"{prefix}/members/a", member_value("a", 1001, "fedcba9876543210"))
        assert ms.wait_until(lambda m: m["a"].incarnation == "fedcba9876543210", 10)
        etcd.delete(f"{prefix}/members/a")
        assert ms.wait_until(lambda m: not m, 10)
        # Keys outside the prefix are not members.
        etcd.put("/kvcd/other/members/c", member_value("c", 1003))
        etcd.put(f"{prefix}/members/d", member_value("d", 1004))
        assert ms.wait_until(lambda m: set(m) == {"d"}, 10)


def test_membership_refuses_hostile_values(etcd):
    prefix = "/kvcd/hostile"
    with EtcdMembership(etcd.endpoint, prefix) as ms:
        etcd.put(f"{prefix}/members/x", b"not json")
        etcd.put(f"{prefix}/members/y", member_value("z", 1))  # id differs from the key
        etcd.put(f"{prefix}/members/w", b"{" + b" " * 10000 + b"}")
        etcd.put(f"{prefix}/members/ok", member_value("ok", 1005))
        assert ms.wait_until(lambda m: "ok" in m, 10)
        assert set(ms.members()) == {"ok"} and ms.rejected >= 3
        # A member whose value turns bad is no longer a member.
        etcd.put(f"{prefix}/members/ok", b"[]")
        assert ms.wait_until(lambda m: not m, 10)


def test_membership_needs_a_reachable_etcd():
    from cluster_services import free_port
    with pytest.raises(ConnectionError, match="etcd range"):
        EtcdMembership(f"127.0.0.1:{free_port()}", "/kvcd/x", timeout=2)
    with pytest.raises(ValueError, match="http://host:port"):
        EtcdMembership("https://127.0.0.1:1", "/kvcd/x")


def test_index_holders_are_fenced_by_incarnation(etcd, redis_server):
    prefix = "/kvcd/idx"
    etcd.put(f"{prefix}/members/a", member_value("a", 1001, "aaaaaaaaaaaaaaaa"))
    etcd.put(f"{prefix}/members/b", member_value("b", 1002, "bbbbbbbbbbbbbbbb"))
    r = redis_server.client()
    hs = block_hashes("tiny", "", "bf16", 4, list(range(12)))
    key = "kvcd:{idx}:blk:"
    r.hset(key + to_hex(hs[0]), mapping={"a": "aaaaaaaaaaaaaaaa:host",
                                         "b": "bbbbbbbbbbbbbbbb:device",
                                         "c": "cccccccccccccccc:host"})  # not a member
    r.hset(key + to_hex(hs[1]), mapping={"a": "aaaaaaaaaaaaaaaa:host",
                                         "b": "0000000000000000:host"})  # old incarnation
    r.hset(key + to_hex(hs[2]), mapping={"a": "aaaaaaaaaaaaaaaa:floppy",  # bad tier
                                         b"\xff": "x"})
    r.hset("kvcd:{idx}:load:a", mapping={"incarnation": "aaaaaaaaaaaaaaaa", "pages_used": 5,
                                         "pages_capacity": 64, "open_sequences": 1,
                                         "queued_decode": 0, "updated_ms": 7})
    r.hset("kvcd:{idx}:load:b", mapping={"incarnation": "0000000000000000", "pages_used": 1})
    with EtcdMembership(etcd.endpoint, prefix) as ms:
        index = BlockIndex("idx", url=redis_server.url)
        got = index.holders(hs, ms.members())
        assert got == [{"a": "host", "b": "device"}, {"a": "host"}, {}]
        assert index.rejected == 4
        assert index.loads(ms.members()) == {"a": Load(5, 64, 1, 0, 7)}
        r.hset("kvcd:{idx}:load:a", "pages_used", "-3")
        assert index.loads(ms.members()) == {}
        index.close()
    with pytest.raises(ValueError, match="cluster name"):
        BlockIndex("bad name", url=redis_server.url)
