"""kvcd.cluster's pure parts: block identity, member values, routing, the attention merge.
No server: these are the cases the C++ client (client/cluster/) is tested on too."""
from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest

from kvcd.cluster import (Load, MemberError, RoutingConfig, block_hash, block_hashes, decide,
                          event_id, merge_attention, merge_many, parse_member, to_hex)
from kvcd.cluster.routing import (HotPrefixes, bounded_members, consecutive_prefixes,
                                  load_value, rendezvous, rendezvous_weight)
from conftest import REPO

VECTORS = REPO / "tests" / "data" / "block_hash_vectors.json"


# -- block identity ---------------------------------------------------------------------------

def _by_hand(model: bytes, salt: bytes, fmt: bytes, parent: bytes, tokens) -> bytes:
    """The contract's formula written out field by field."""
    msg = b"kvcd-block-v1\0"
    for f in (model, salt, fmt):
        msg += len(f).to_bytes(4, "little") + f
    msg += parent + len(tokens).to_bytes(4, "little")
    msg += b"".join((t % (1 << 32)).to_bytes(4, "little") for t in tokens)
    return hashlib.sha256(msg).digest()


def test_block_hash_follows_the_contract_formula():
    toks = [5, 0, 2 ** 31 - 1, -1, 7, 8, 9, 10, 11]  # two full pages of 4, a partial tail
    hs = block_hashes("tiny", "tenant-a", "int2-oscar", 4, toks)
    assert len(hs) == 2  # the partial page has no name
    h0 = _by_hand(b"tiny", b"tenant-a", b"int2-oscar", bytes(32), toks[:4])
    assert hs[0] == h0
    assert hs[1] == _by_hand(b"tiny", b"tenant-a", b"int2-oscar", h0, toks[4:8])
    assert hs[1] == block_hash("tiny", "tenant-a", "int2-oscar", h0, 4, toks[4:8])
    assert to_hex(hs[0]) == h0.hex() and len(to_hex(hs[0])) == 64
    assert event_id(hs[0]) == struct.unpack(">q", h0[:8])[0]


def test_block_hash_separates_tenants_formats_models_and_chains():
    toks = list(range(32))
    base = block_hashes("tiny", "", "bf16", 16, toks)
    assert block_hashes("tiny", "t2", "bf16", 16, toks)[0] != base[0]
    assert block_hashes("tiny", "", "fsq", 16, toks)[0] != base[0]
    assert block_hashes("tiny2", "", "bf16", 16, toks)[0] != base[0]
    # The same second page after another first page is another block.
    other = block_hashes("tiny", "", "bf16", 16, [99] + toks[1:])
    assert other[1] != base[1]
    # Length-prefixed fields: moving a byte from model to salt changes the hash.
    assert block_hashes("ab", "c", "bf16", 16, toks) != block_hashes("a", "bc", "bf16", 16, toks)


@pytest.mark.parametrize("args,match", [
    (("tiny", "", "int3", 4, [1, 2, 3, 4]), "history format"),
    (("tiny", "", "bf16", 0, [1]), "page_size"),
    (("tiny", "", "bf16", 2, [1, 2 ** 32]), "token ids"),
    (("x" * 5000, "", "bf16", 2, [1, 2]), "model is 5000 bytes"),
])
def test_block_hash_refuses_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        block_hashes(*args)


def test_block_hash_vectors_shared_with_cpp():
    if not VECTORS.exists():
        pytest.skip(f"{VECTORS} is not in this tree (written by the daemon side)")
    data = json.loads(VECTORS.read_text())
    cases = data["vectors"] if isinstance(data, dict) else data
    assert cases, "the vector file holds no case"
    for c in cases:
        hs = block_hashes(c["model"], c["salt"], c["format"], c["page_size"], c["tokens"])
        assert [to_hex(h) for h in hs] == c["hashes"], c.get("name", c)
        if "event_ids" in c:
            assert [event_id(h) for h in hs] == c["event_ids"], c.get("name", c)


# -- member values ----------------------------------------------------------------------------

GOOD = {"member_id": "kvcd-0", "address": "127.0.0.1:50051", "backend": "cpu",
        "capacity_pages": 1000, "page_bytes": 8192, "incarnation": "0123456789abcdef",
        "started_unix_ms": 1, "version": "0.1.0", "events_endpoint": ""}


def test_member_value_is_parsed():
    m = parse_member("kvcd-0", json.dumps(GOOD).encode())
    assert (m.address, m.incarnation, m.capacity_pages) == ("127.0.0.1:50051",
                                                             "0123456789abcdef", 1000)


@pytest.mark.parametrize("change,match", [
    ({"member_id": "kvcd-1"}, "differs from the key"),
    ({"address": "127.0.0.1"}, "host:port"),
    ({"address": "127.0.0.1:70000"}, "host:port"),
    ({"address": "evil host:1"}, "host:port"),
    ({"backend": "tpu"}, "backend"),
    ({"incarnation": "0123"}, "incarnation"),
    ({"incarnation": "0123456789ABCDEF"}, "incarnation"),
    ({"capacity_pages": -1}, "capacity_pages"),
    ({"capacity_pages": True}, "capacity_pages"),
    ({"capacity_pages": "10"}, "capacity_pages"),
    ({"events_endpoint": "ipc:///tmp/x"}, "events_endpoint"),
    ({"version": "v" * 65}, "version"),
])
def test_member_value_breaking_a_rule_is_refused(change, match):
    with pytest.raises(MemberError, match=match):
        parse_member("kvcd-0", json.dumps({**GOOD, **change}).encode())


def test_member_value_not_json_too_big_or_bad_key_is_refused():
    with pytest.raises(MemberError, match="not JSON"):
        parse_member("kvcd-0", b"{")
    with pytest.raises(MemberError, match="JSON object"):
        parse_member("kvcd-0", b"[1]")
    with pytest.raises(MemberError, match="at most 4096"):
        parse_member("kvcd-0", b" " * 5000)
    with pytest.raises(MemberError, match="member id"):
        parse_member("../x", json.dumps(GOOD).encode())


# -- routing ----------------------------------------------------------------------------------

def test_consecutive_prefixes_count_from_page_zero_without_gaps():
    holders = [{"a": "host", "b": "host"}, {"a": "host"}, {"b": "host", "a": "host"}, {}]
    assert consecutive_prefixes(holders) == {"a": 3, "b": 1}
    assert consecutive_prefixes([{}, {"a": "host"}]) == {}
    assert consecutive_prefixes([]) == {}


def test_load_value_and_score_follow_the_contract():
    l = Load(pages_used=50, pages_capacity=100, open_sequences=2, queued_decode=1)
    # 0.5 * 16 * 4 + beta * 3, beta defaults to a page
    assert load_value(l, 16, 4, None) == pytest.approx(32 + 48)
    assert load_value(l, 16, 4, 2.0) == pytest.approx(32 + 6)
    assert load_value(None, 16, 4, None) == 0.0
    assert load_value(Load(pages_used=5, pages_capacity=0), 16, 4, None) == 0.0


def test_index_hits_beat_an_idle_member_until_load_outweighs_them():
    hashes = [bytes([i]) * 32 for i in range(4)]
    holders = [{"a": "host"}] * 4
    cfg = RoutingConfig(replicate_after=0)
    idle = {"a": Load(50, 100), "b": Load(0, 100)}
    d = decide(hashes, holders, ["a", "b"], idle, 16, cfg)
    assert (d.member_id, d.hit_pages, d.reason) == ("a", 4, "index")
    # a is drowning in queued work: 64 hit tokens < 1 * (16 * 10) load
    busy = {"a": Load(50, 100, open_sequences=10), "b": Load(0, 100)}
    d = decide(hashes, holders, ["a", "b"], busy, 16, cfg)
    assert (d.member_id, d.reason) == ("b", "rendezvous")  # a is above the bounded-load cap


def test_excluded_and_unknown_holders_are_not_chosen():
    hashes = [bytes([1]) * 32]
    d = decide(hashes, [{"a": "host", "ghost": "host"}], ["a", "b"], {}, 16, RoutingConfig(),
               exclude=["a"])
    assert d.member_id == "b" and d.reason == "rendezvous"
    with pytest.raises(LookupError):
        decide(hashes, [{}], ["a"], {}, 16, RoutingConfig(), exclude=["a"])


def test_rendezvous_moves_only_the_keys_of_a_removed_member():
    keys = [hashlib.sha256(str(i).encode()).digest() for i in range(2000)]
    four = ["m0", "m1", "m2", "m3"]
    before = {k: rendezvous(k, four) for k in keys}
    after = {k: rendezvous(k, four[:3]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "m3" for k in moved)
    counts = {m: sum(1 for k in keys if before[k] == m) for m in four}
    assert min(counts.values()) > 400  # spread evenly (500 each expected)
    assert rendezvous_weight("m0", keys[0]) == struct.unpack(
        ">Q", hashlib.sha256(b"m0\0" + keys[0]).digest()[:8])[0]


def test_bounded_load_keeps_every_member_under_the_cap():
    # Keys skewed onto few rendezvous winners: the cap spreads them.
    members = [f"m{i}" for i in range(4)]
    load = {m: 0.0 for m in members}
    for i in range(4000):
        key = hashlib.sha256(str(i % 7).encode()).digest()  # 7 distinct keys only
        m = rendezvous(key, bounded_members(load, 1.25))
        load[m] += 1
    mean = sum(load.values()) / 4
    assert max(load.values()) <= 1.25 * mean + 1
    assert bounded_members({"a": 0.0, "b": 0.0}, 1.25) == ["a", "b"]
    assert bounded_members({"a": 10.0, "b": 0.0}, 1.25) == ["b"]
    assert bounded_members({}, 1.25) == []


def test_hot_prefix_is_replicated_to_the_rendezvous_second():
    now = [0.0]
    cfg = RoutingConfig(replicate_after=3, window_s=10.0)
    hot = HotPrefixes(cfg, clock=lambda: now[0])
    hashes = [bytes([i]) * 32 for i in range(8)]
    holders = [{"a": "host"}] * 8  # 128 hit tokens outweigh a's load (59.2)
    loads = {"a": Load(90, 100, open_sequences=1), "b": Load(10, 100), "c": Load(10, 100)}
    ds = [decide(hashes, holders, ["a", "b", "c"], loads, 16, cfg, hot) for _ in range(4)]
    assert [d.reason for d in ds] == ["index", "index", "index", "replicate"]
    assert ds[0].member_id == "a"
    assert ds[3].pull_from == "a" and ds[3].member_id == rendezvous(hashes[0], ["b", "c"])
    d = decide(hashes, holders, ["a", "b", "c"], loads, 16, cfg, hot)
    assert d.reason == "index"  # the window starts over after a replication
    for _ in range(3):
        decide(hashes, holders, ["a", "b", "c"], loads, 16, cfg, hot)
    now[0] = 100.0  # the window passed: the old routings no longer count
    assert decide(hashes, holders, ["a", "b", "c"], loads, 16, cfg, hot).reason == "index"
    # A holder at or below the mean load is not relieved.
    even = {m: Load(10, 100) for m in "abc"}
    hot2 = HotPrefixes(cfg, clock=lambda: now[0])
    assert {decide(hashes, holders, ["a", "b", "c"], even, 16, cfg, hot2).reason
            for _ in range(10)} == {"index"}
    d = [decide(hashes, holders, ["a", "b", "c"], loads, 16, cfg,
                HotPrefixes(RoutingConfig(replicate_after=0))) for _ in range(5)]
    assert {x.reason for x in d} == {"index"}


def test_hot_prefix_tracking_is_bounded():
    hot = HotPrefixes(RoutingConfig(max_tracked_prefixes=10))
    for i in range(100):
        hot.record(bytes([i]) * 32, "a")
    assert len(hot._hits) == 10


# -- the attention merge ----------------------------------------------------------------------

def _attend(q, k, v):
    """Reference: softmax attention of q [H, D] over k/v [n, H, D] (float64)."""
    s = np.einsum("hd,nhd->hn", q, k) / np.sqrt(q.shape[-1])
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    lse = np.log(p.sum(axis=1)) + m[:, 0]
    return np.einsum("hn,nhd->hd", p / p.sum(axis=1, keepdims=True), v), lse


@pytest.mark.parametrize("seed", range(5))
def test_merge_of_two_parts_equals_attention_over_the_whole(seed):
    rng = np.random.default_rng(seed)
    n, split = int(rng.integers(2, 200)), 0
    split = int(rng.integers(1, n))
    q = rng.standard_normal((4, 32)) * 3
    k, v = rng.standard_normal((n, 4, 32)), rng.standard_normal((n, 4, 32))
    o_all, lse_all = _attend(q, k, v)
    o_a, lse_a = _attend(q, k[:split], v[:split])
    o_b, lse_b = _attend(q, k[split:], v[split:])
    o, lse = merge_attention(o_a, lse_a, o_b, lse_b)
    np.testing.assert_allclose(o, o_all, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, lse_all, rtol=1e-5, atol=1e-5)
    thirds = [_attend(q, k[i::3], v[i::3]) for i in range(3)] if n >= 3 else []
    if thirds:
        o3, lse3 = merge_many(thirds)
        np.testing.assert_allclose(o3, o_all, rtol=1e-5, atol=1e-5)


def test_merge_with_an_empty_part_and_bad_input():
    o = np.ones((2, 8), np.float32)
    lse = np.zeros(2, np.float32)
    empty = np.full(2, -np.inf, np.float32)
    got, got_lse = merge_attention(o, lse, np.zeros_like(o), empty)
    np.testing.assert_array_equal(got, o)
    np.testing.assert_array_equal(got_lse, lse)
    both, both_lse = merge_attention(o, empty, o, empty)
    assert np.isneginf(both_lse).all() and np.isfinite(both).all()
    with pytest.raises(ValueError, match="shapes"):
        merge_attention(o, lse, o[:, :4], lse)
    with pytest.raises(ValueError, match="NaN"):
        merge_attention(o, np.array([0.0, np.nan]), o, lse)
    with pytest.raises(ValueError, match="at least one"):
        merge_many([])
