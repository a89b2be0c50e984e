"""The blocking client against the real daemon: every call, the traps, chunking, leases."""

import grpc
import numpy as np
import pytest

import kvcd
from conftest import (bf16_round, fsq_codec_blob, random_kv, random_tokens, reference_attention,
                      wait_until)


def test_version_matches_cmake():
    import re
    from conftest import REPO

    m = re.search(r"project\(kvcd VERSION ([0-9.]+)", (REPO / "CMakeLists.txt").read_text())
    assert kvcd.__version__ == m.group(1)


def test_models_register_list_get(client):
    names = {m.profile.name for m in client.list_models()}
    assert {"tiny", "qwen3-8b", "tiny-int2"} <= names
    info = client.register_model(name="py-reg", num_layers=2, num_q_heads=4, num_kv_heads=2,
                                 head_dim=16, page_size=4, sink_tokens=4, recent_tokens=8,
                                 history_format="bf16", memory_bytes=1 << 20)
    assert info.profile.name == "py-reg" and info.profile.head_dim == 16
    assert info.pools[0].format == "bf16" and info.pools[0].pages_total > 0
    # Identical profile again: idempotent.
    again = client.register_model(info.profile)
    assert again.profile == info.profile
    assert client.get_model("py-reg").profile.num_layers == 2
    with pytest.raises(kvcd.NotFound):
        client.get_model("no-such-model")


def test_put_reports_the_ignored_partial_page(client):
    p = client.profile("tiny")
    toks = random_tokens(10, 1)  # page 4: two full pages, 2 tokens ignored
    k, v = random_kv(p, 10, 1)
    r = client.put("tiny", toks, k, v)
    assert (r.cached_tokens, r.inserted_tokens, r.ignored_tokens, r.requests) == (0, 8, 2, 1)
    again = client.put("tiny", toks, k, v)  # idempotent
    assert (again.cached_tokens, again.inserted_tokens) == (8, 0)
    assert client.match("tiny", toks) == kvcd.MatchResult(8, 2)


def test_put_checks_shapes_before_sending(client):
    p = client.profile("tiny")
    k, v = random_kv(p, 8, 2)
    with pytest.raises(ValueError, match=r"k has shape \[2, 8, 2, 16\], expected \[2, 7, 2, 16\]"):
        client.put("tiny", random_tokens(7, 2), k, v)
    with pytest.raises(ValueError, match="v has shape"):
        client.put("tiny", random_tokens(8, 2), k, v[:, :, :1])
    with pytest.raises(TypeError):
        client.put("tiny", random_tokens(8, 2), k.astype(np.int32), v)
    assert client.match("tiny", random_tokens(8, 2)).matched_tokens == 0  # nothing sent


def test_chunked_put_under_the_message_limit(daemon):
    # 2 layers x 2 heads x 16 dims x 4 B x (K+V) = 512 B per token: 64 KiB + 4 pages of
    # headroom forces chunks of 4 pages (16 tokens) for a 50-token prompt.
    limit = (64 << 10) + 16 * 512 + 400
    with kvcd.Client(daemon.grpc, max_message_bytes=limit) as c:
        p = c.profile("tiny")
        toks = random_tokens(50, 3)
        k, v = random_kv(p, 50, 3)
        r = c.put("tiny", toks, k, v)
        assert r.requests == 4  # 16 + 16 + 16 + 2 tokens
        assert (r.inserted_tokens, r.ignored_tokens, r.cached_tokens) == (48, 2, 0)
        assert c.match("tiny", toks).matched_tokens == 48
        # What the chunks stored is the prompt's K/V.
        with c.open_sequence("tiny", toks, auto_renew=False) as seq:
            f = seq.fetch_pages(expand_to_bf16=True)
            np.testing.assert_array_equal(f.k, bf16_round(k[:, :48]))
            np.testing.assert_array_equal(f.v, bf16_round(v[:, :48]))


def test_append_is_split_under_the_message_limit(daemon):
    limit = (64 << 10) + 10 * 512 + 400  # ~10 tokens of tiny K/V per message
    with kvcd.Client(daemon.grpc, max_message_bytes=limit) as c:
        p = c.profile("tiny")
        toks = random_tokens(45, 15)
        k, v = random_kv(p, 45, 15)
        assert len(kvcd._core.append_requests(p, 1, list(toks), k, v, None, limit)) == 5
        with c.open_sequence("tiny", toks[:1], auto_renew=False) as seq:
            assert seq.length == 0
            assert seq.append(toks, k, v) == 45  # 5 Append calls
            f = seq.fetch_pages(expand_to_bf16=True, first_token=0, num_tokens=20)
            np.testing.assert_array_equal(f.k, bf16_round(k[:, :20]))
            f = seq.fetch_pages(expand_to_bf16=True, first_token=20)
            np.testing.assert_array_equal(f.v, bf16_round(v[:, 20:]))


def test_chunk_smaller_than_a_page_is_refused(daemon):
    with kvcd.Client(daemon.grpc, max_message_bytes=(64 << 10) + 1000) as c:
        p = c.profile("qwen3-8b")
        k = np.zeros((p.num_layers, 64, p.num_kv_heads, p.head_dim), np.float32)
        with pytest.raises(ValueError, match="does not fit in max_message_bytes"):
            c.put("qwen3-8b", random_tokens(64, 4), k, k)


def test_open_sequence_appends_the_unmatched_rest(client):
    p = client.profile("tiny")
    toks = random_tokens(11, 5)
    k, v = random_kv(p, 11, 5)
    client.put("tiny", toks, k, v)
    # Without K/V: the daemon keeps only the matched prefix; the rest is pending.
    with client.open_sequence("tiny", toks) as seq:
        assert seq.matched_tokens == 8 and seq.length == 8
        assert seq.pending_tokens == [int(t) for t in toks[8:]]
        assert seq.append(toks[8:], k[:, 8:], v[:, 8:]) == 11
        assert seq.pending_tokens == []
    # With K/V of the whole prompt: appended by the helper.
    with client.open_sequence("tiny", toks, k=k, v=v) as seq:
        assert seq.matched_tokens == 8 and seq.length == 11 and seq.pending_tokens == []
        f = seq.fetch_pages(expand_to_bf16=True)
        assert f.num_tokens == 11
        np.testing.assert_array_equal(f.k, bf16_round(k))


def test_attention_matches_float64_reference(client):
    p = client.profile("tiny")
    n = 13
    toks = random_tokens(n, 6)
    k, v = random_kv(p, n, 6)
    client.put("tiny", toks, k, v)
    rng = np.random.default_rng(6)
    with client.open_sequence("tiny", toks, k=k, v=v) as seq:
        for layer in range(p.num_layers):
            q = rng.standard_normal((1, p.num_q_heads, p.head_dim)).astype(np.float32)
            o, lse = client.attention_decode(layer, seq, q)
            assert o.shape == (1, p.num_q_heads, p.head_dim) and o.dtype == np.float32
            ro, rl = reference_attention(q[0], bf16_round(k[layer]), bf16_round(v[layer]))
            np.testing.assert_allclose(o[0], ro, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(lse[0], rl, rtol=1e-5, atol=1e-5)
        # softmax_scale is honoured
        q = rng.standard_normal((1, p.num_q_heads, p.head_dim)).astype(np.float32)
        r = client.attention_decode(0, seq, q, softmax_scale=0.5)
        ro, rl = reference_attention(q[0], bf16_round(k[0]), bf16_round(v[0]), 0.5)
        np.testing.assert_allclose(r.o[0], ro, rtol=1e-4, atol=1e-5)
        assert r.lengths == (n,)


def test_bf16_wire_dtype_sends_bf16(client):
    p = client.profile("tiny")
    toks = random_tokens(8, 7)
    k, v = random_kv(p, 8, 7)
    client.put("tiny", toks, k, v, wire_dtype="bf16")
    with client.open_sequence("tiny", toks) as seq:
        f = seq.fetch_pages(expand_to_bf16=True)
        np.testing.assert_array_equal(f.k, bf16_round(k))


def test_decode_session_fused_loop_and_per_request_errors(client):
    p = client.profile("tiny")
    toks = random_tokens(8, 8)
    k, v = random_kv(p, 12, 8)  # 8 prompt tokens + 4 decode steps
    client.put("tiny", toks, k[:, :8], v[:, :8])
    rng = np.random.default_rng(8)
    with client.open_sequence("tiny", toks) as seq, client.decode_session() as s:
        for step in range(4):
            pos = 8 + step
            for layer in range(p.num_layers):
                q = rng.standard_normal((1, p.num_q_heads, p.head_dim)).astype(np.float32)
                o, lse = s.attend(layer, seq, q, k_new=k[layer, pos][None], v_new=v[layer, pos][None],
                                  new_tokens=[100 + step])
                ro, _ = reference_attention(q[0], bf16_round(k[layer, :pos + 1]),
                                            bf16_round(v[layer, :pos + 1]))
                np.testing.assert_allclose(o[0], ro, rtol=1e-4, atol=1e-5)
        # A second token at layer 0 before layer 1 has the first: FAILED_PRECONDITION for
        # that request only; the stream keeps serving.
        q = np.zeros((1, p.num_q_heads, p.head_dim), np.float32)
        kn = k[0, 0][None]
        s.attend(0, seq, q, k_new=kn, v_new=kn, new_tokens=[1])
        with pytest.raises(kvcd.FailedPrecondition, match="layer 0 already holds"):
            s.attend(0, seq, q, k_new=kn, v_new=kn, new_tokens=[2])
        r = s.attend(1, seq, q, k_new=kn, v_new=kn, new_tokens=[1])
        assert r.lengths == (13,) and seq.length == 13
        with pytest.raises(kvcd.NotFound):
            s.attend(0, [987654321], q)
        assert s.attend(0, seq, q).lengths == (13,)


def test_batch_of_sequences(client):
    p = client.profile("tiny")
    seqs, kvs = [], []
    try:
        for i in range(3):
            toks = random_tokens(6 + i, 20 + i)
            k, v = random_kv(p, 6 + i, 20 + i)
            seqs.append(client.open_sequence("tiny", toks, k=k, v=v))
            kvs.append((k, v))
        q = np.random.default_rng(9).standard_normal((3, p.num_q_heads, p.head_dim)).astype(np.float32)
        o, lse = client.attention_decode(1, seqs, q)
        assert o.shape == (3, p.num_q_heads, p.head_dim) and lse.shape == (3, p.num_q_heads)
        for i, (k, v) in enumerate(kvs):
            ro, rl = reference_attention(q[i], bf16_round(k[1]), bf16_round(v[1]))
            np.testing.assert_allclose(o[i], ro, rtol=1e-4, atol=1e-5)
    finally:
        for s in seqs:
            s.close()


def test_context_manager_closes_on_exception(client):
    p = client.profile("tiny")
    toks = random_tokens(8, 10)
    k, v = random_kv(p, 8, 10)
    client.put("tiny", toks, k, v)
    before = client.stats().active_sequences
    with pytest.raises(RuntimeError, match="boom"):
        with client.open_sequence("tiny", toks) as seq:
            assert client.stats().active_sequences == before + 1
            raise RuntimeError("boom")
    assert seq.closed
    assert client.stats().active_sequences == before
    with pytest.raises(kvcd.NotFound):
        client.renew_lease(seq)


def test_lease_is_renewed_in_the_background(client):
    p = client.profile("tiny")
    toks = random_tokens(8, 11)
    k, v = random_kv(p, 8, 11)
    client.put("tiny", toks, k, v)
    expired0 = client.stats().expired_leases
    # Lease 150 ms, renewed every 50 ms; wait for 8 renewals (> 2 leases).
    with client.open_sequence("tiny", toks, lease_ms=150) as seq:
        assert seq.lease_ms == 150
        assert seq.wait_renewals(8, timeout=30), seq.renew_error
        assert seq.renew_error is None
        assert client.renew_lease(seq) == 150  # still open
    assert client.stats().expired_leases == expired0
    # Control: without renewal the same lease runs out and the daemon closes it.
    seq = client.open_sequence("tiny", toks, lease_ms=150, auto_renew=False)
    assert wait_until(lambda: client.stats().expired_leases > expired0)
    with pytest.raises(kvcd.NotFound):
        client.renew_lease(seq)


def test_fetch_and_push_pages_into_another_tenant(client):
    p = client.profile("tiny-int2")
    toks = random_tokens(20, 12)
    k, v = random_kv(p, 20, 12)
    client.put("tiny-int2", toks, k, v, cache_salt="alice")
    with client.open_sequence("tiny-int2", toks, cache_salt="alice") as seq:
        stored = seq.fetch_pages()
        assert stored.page_formats == ["bf16"] + ["int2-oscar"] * 4
        assert client.match("tiny-int2", toks, cache_salt="bob").matched_tokens == 0
        assert client.push_pages("tiny-int2", toks, stored, cache_salt="bob") == 20
        assert client.match("tiny-int2", toks, cache_salt="bob").matched_tokens == 20
        with client.open_sequence("tiny-int2", toks, cache_salt="bob") as bob:
            again = bob.fetch_pages()
            assert [pg.data for pg in again.pages] == [pg.data for pg in stored.pages]
            q = np.random.default_rng(12).standard_normal((1, 4, 16)).astype(np.float32)
            np.testing.assert_array_equal(seq.attention_decode(0, q).o,
                                          bob.attention_decode(0, q).o)


def test_large_page_fetch_needs_the_raised_receive_limit(client, daemon):
    p = client.profile("qwen3-8b")  # one page: 36 x 8 x 64 x 128 x 2 x 2 B = 9.4 MB
    toks = random_tokens(64, 13)
    k, v = random_kv(p, 64, 13)
    client.put("qwen3-8b", toks, k, v, wire_dtype="bf16")
    with client.open_sequence("qwen3-8b", toks) as seq:
        f = seq.fetch_pages()
        assert len(f.pages) == 1 and len(f.pages[0].data) == 9437184 > 4 << 20
        dk, dv = f.decode()
        np.testing.assert_array_equal(dk, bf16_round(k))
        e = seq.fetch_pages(expand_to_bf16=True)
        np.testing.assert_array_equal(e.v, bf16_round(v))
        # The trap the client's channel options avoid: Python gRPC's default 4 MiB limit.
        with grpc.insecure_channel(daemon.grpc) as ch:
            stub = kvcd.v1.kvcache_pb2_grpc.KvCacheStub(ch)
            with pytest.raises(grpc.RpcError) as ei:
                stub.FetchPages(kvcd.pb.FetchPagesRequest(sequence_id=seq.id), timeout=20)
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_stats_and_health(client):
    s = client.stats()
    assert s.backend == "cpu" and s.version == kvcd.__version__
    assert s.memory_budget_bytes == 256 << 20
    assert {m.profile.name for m in s.models} >= {"tiny", "qwen3-8b"}
    assert client.health() == "SERVING"
    assert next(iter(client.watch_health())) == "SERVING"
    with pytest.raises(kvcd.NotFound):
        client.health("no.such.Service")


def test_unreachable_daemon_is_unavailable():
    import socket

    with socket.socket() as sock:  # a free port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(kvcd.Unavailable):
        kvcd.Client(f"127.0.0.1:{port}", wait_ready=0.5)


def test_a_dropped_sequence_is_no_longer_renewed(client):
    import gc

    p = client.profile("tiny")
    toks = random_tokens(8, 14)
    k, v = random_kv(p, 8, 14)
    expired0 = client.stats().expired_leases
    seq = client.open_sequence("tiny", toks, k=k, v=v, lease_ms=100)
    assert seq.wait_renewals(2, timeout=30)
    sid = seq.id
    del seq
    gc.collect()
    # The daemon's reaper closes it once the 100 ms lease has run out.
    assert wait_until(lambda: client.stats().expired_leases > expired0)
    with pytest.raises(kvcd.NotFound):
        client.close_sequence(sid)


def register_fsq(c, name):
    """A tiny FSQ model (C = 24, G = 9) with a random codec."""
    return c.register_model(name=name, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                            page_size=4, sink_tokens=4, recent_tokens=8, history_format="fsq",
                            memory_bytes=1 << 20, bf16_fraction=0.5, fsq_residual_width=24,
                            fsq_latent_width=9, rope={"theta": 10000.0, "pairing": 1},
                            codec_blob=fsq_codec_blob(2, 24, 9, 2, 16, 3))


def residuals(p, n, seed):
    rng = np.random.default_rng(seed + 77)
    return bf16_round(rng.standard_normal((p.num_layers, n, p.fsq_residual_width))
                      .astype(np.float32))


def test_fsq_model_carries_the_residuals(client):
    info = register_fsq(client, "py-fsq")
    assert [pl.format for pl in info.pools] == ["bf16+fsq", "fsq"]
    p = info.profile
    toks = random_tokens(16, 60)
    k, v = random_kv(p, 16, 60)
    x = residuals(p, 16, 60)
    # Without residuals, or with the wrong width: refused before anything is sent.
    with pytest.raises(ValueError, match="x .*is required"):
        client.put("py-fsq", toks, k, v)
    with pytest.raises(ValueError, match=r"x has shape \[2, 16, 23\], expected \[2, 16, 24\]"):
        client.put("py-fsq", toks, k, v, x=x[:, :, :23])
    with pytest.raises(ValueError, match="not an FSQ model"):
        client.put("tiny", toks, k, v, x=x)
    assert client.match("py-fsq", toks).matched_tokens == 0
    # F32 and BF16 on the wire give the same codes (x is BF16-exact); other residuals
    # give other codes.
    assert client.put("py-fsq", toks, k, v, x=x, cache_salt="a").inserted_tokens == 16
    assert client.put("py-fsq", toks, k, v, x=x, cache_salt="b",
                      wire_dtype="bf16").inserted_tokens == 16
    assert client.put("py-fsq", toks, k, v, x=-x, cache_salt="c").inserted_tokens == 16
    pages = {}
    for salt in "abc":
        with client.open_sequence("py-fsq", toks, cache_salt=salt) as seq:
            f = seq.fetch_pages()
            assert f.page_formats == ["bf16+fsq", "fsq", "fsq", "fsq"]
            pages[salt] = [pg.data for pg in f.pages]
            assert len(pages[salt][1]) == 2 * 4 * 5  # layers x tokens x ceil(9/2) bytes
    assert pages["a"] == pages["b"]
    assert pages["a"][1:] != pages["c"][1:]

    # A sequence: the unmatched tail is appended with its residuals, then the per-layer
    # decode loop with x_new.
    toks2 = np.concatenate([toks, random_tokens(3, 61)])
    k2, v2 = random_kv(p, 19, 61)
    k2[:, :16], v2[:, :16] = k, v
    x2 = residuals(p, 19, 61)
    x2[:, :16] = x
    with client.open_sequence("py-fsq", toks2, k=k2, v=v2, x=x2, cache_salt="a") as seq:
        assert seq.length == 19 and seq.pending_tokens == []
        rng = np.random.default_rng(5)
        with client.decode_session() as s:
            for layer in range(p.num_layers):
                q = rng.standard_normal((1, 4, 16)).astype(np.float32)
                k1 = rng.standard_normal((1, 2, 16)).astype(np.float32)
                with pytest.raises(ValueError, match="x_new .*is required"):
                    s.attend(layer, seq, q, k_new=k1, v_new=k1, new_tokens=[7])
                o, lse = s.attend(layer, seq, q, k_new=k1, v_new=k1, new_tokens=[7],
                                  x_new=rng.standard_normal((1, 24)).astype(np.float32))
                assert np.isfinite(o).all() and np.isfinite(lse).all()
        assert seq.length == 20
        # The daemon refuses an append without residuals (the check is not only local).
        with pytest.raises(kvcd.InvalidArgument, match="x is missing"):
            client.append(seq.id, [9], k2[:, :1], v2[:, :1])
        assert seq.append([9], k2[:, :1], v2[:, :1], x=x2[:, :1]) == 21
