"""kvcd.aio against the real daemon: the same calls, and many sessions at once."""
import asyncio

import numpy as np
import pytest

import kvcd
import kvcd.aio
from conftest import bf16_round, fsq_codec_blob, random_kv, random_tokens, reference_attention


def run(coro):
    return asyncio.run(coro)


def test_aio_calls(daemon):
    async def main():
        async with kvcd.aio.Client(daemon.grpc, timeout=20) as c:
            await c.wait_ready()
            assert "tiny" in {m.profile.name for m in await c.list_models()}
            p = await c.profile("tiny")
            toks = random_tokens(10, 50)
            k, v = random_kv(p, 10, 50)
            r = await c.put("tiny", toks, k, v)
            assert (r.inserted_tokens, r.ignored_tokens) == (8, 2)
            assert (await c.match("tiny", toks)).matched_tokens == 8
            async with await c.open_sequence("tiny", toks, k=k, v=v, lease_ms=150) as seq:
                assert seq.length == 10 and seq.pending_tokens == []
                assert await seq.wait_renewals(4, timeout=30), seq.renew_error
                q = np.ones((1, p.num_q_heads, p.head_dim), np.float32)
                o, lse = await seq.attention_decode(1, q)
                ro, rl = reference_attention(q[0], bf16_round(k[1]), bf16_round(v[1]))
                np.testing.assert_allclose(o[0], ro, rtol=1e-4, atol=1e-5)
                f = await seq.fetch_pages(expand_to_bf16=True)
                np.testing.assert_array_equal(f.k, bf16_round(k))
                stored = await seq.fetch_pages()
                assert await c.push_pages("tiny", toks, stored, cache_salt="aio") == 8
                assert await seq.renew() == 150
            assert seq.closed
            with pytest.raises(kvcd.NotFound):
                await c.renew_lease(seq)
            assert (await c.stats()).backend == "cpu"
            assert await c.health() == "SERVING"
            with pytest.raises(kvcd.AlreadyExists):
                await c.register_model(name="tiny", num_layers=1, num_q_heads=4, num_kv_heads=2,
                                       head_dim=16, page_size=4, memory_bytes=1 << 20)

    run(main())


def test_aio_context_manager_closes_on_exception(daemon):
    async def main():
        async with kvcd.aio.Client(daemon.grpc) as c:
            p = await c.profile("tiny")
            toks = random_tokens(8, 51)
            k, v = random_kv(p, 8, 51)
            before = (await c.stats()).active_sequences
            with pytest.raises(RuntimeError):
                async with await c.open_sequence("tiny", toks, k=k, v=v) as seq:
                    assert (await c.stats()).active_sequences == before + 1
                    raise RuntimeError("boom")
            assert (await c.stats()).active_sequences == before
            with pytest.raises(kvcd.NotFound):
                await c.renew_lease(seq)

    run(main())


def test_many_concurrent_decode_sessions(daemon):
    """32 tasks, each with its own sequence and stream, decoding 3 steps x 2 layers
    concurrently on one channel; every output is checked against float64 attention."""
    sessions, steps = 32, 3

    async def worker(c, p, i):
        n = 6 + i % 5
        k, v = random_kv(p, n + steps, 100 + i)
        toks = random_tokens(n, 100 + i)
        rng = np.random.default_rng(100 + i)
        async with await c.open_sequence("tiny", toks, k=k[:, :n], v=v[:, :n]) as seq:
            async with c.decode_session() as s:
                for step in range(steps):
                    pos = n + step
                    for layer in range(p.num_layers):
                        q = rng.standard_normal((1, p.num_q_heads, p.head_dim)).astype(np.float32)
                        o, lse = await s.attend(layer, seq, q, k_new=k[layer, pos][None],
                                                v_new=v[layer, pos][None], new_tokens=[7 + step])
                        ro, rl = reference_attention(q[0], bf16_round(k[layer, :pos + 1]),
                                                     bf16_round(v[layer, :pos + 1]))
                        np.testing.assert_allclose(o[0], ro, rtol=1e-4, atol=1e-5)
                        np.testing.assert_allclose(lse[0], rl, rtol=1e-5, atol=1e-5)
            return await seq.close()

    async def main():
        async with kvcd.aio.Client(daemon.grpc, timeout=30) as c:
            p = await c.profile("tiny")
            lengths = await asyncio.gather(*(worker(c, p, i) for i in range(sessions)))
            assert lengths == [6 + i % 5 + steps for i in range(sessions)]

    run(main())


def test_aio_fsq_model_carries_the_residuals(daemon):
    async def main():
        async with kvcd.aio.Client(daemon.grpc, timeout=20) as c:
            info = await c.register_model(
                name="aio-fsq", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                page_size=4, sink_tokens=4, recent_tokens=8, history_format="fsq",
                memory_bytes=1 << 20, bf16_fraction=0.5, fsq_residual_width=24,
                fsq_latent_width=9, codec_blob=fsq_codec_blob(2, 24, 9, 2, 16, 4))
            p = info.profile
            toks = random_tokens(12, 70)
            k, v = random_kv(p, 12, 70)
            rng = np.random.default_rng(70)
            x = rng.standard_normal((2, 12, 24)).astype(np.float32)
            with pytest.raises(ValueError, match="x .*is required"):
                await c.put("aio-fsq", toks, k, v)
            assert (await c.put("aio-fsq", toks, k, v, x=x)).inserted_tokens == 12
            async with await c.open_sequence("aio-fsq", toks) as seq:
                assert seq.length == 12
                f = await seq.fetch_pages()
                assert f.page_formats == ["bf16+fsq", "fsq", "fsq"]
                assert await seq.append([5], k[:, :1], v[:, :1], x=x[:, :1]) == 13
                q = rng.standard_normal((1, 4, 16)).astype(np.float32)
                for layer in range(2):
                    o, lse = await seq.attention_decode(
                        layer, q, k_new=k[layer, :1], v_new=v[layer, :1], new_tokens=[6],
                        x_new=x[layer, :1])
                    assert np.isfinite(o).all()
                assert seq.length == 14
                with pytest.raises(kvcd.InvalidArgument, match="x is missing"):
                    await c.append(seq.id, [9], k[:, :1], v[:, :1])

    run(main())
