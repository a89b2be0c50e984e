"""Sessions (docs/sessions.md) through both clients against the real daemon: a turn's
sequence is committed on close and the next turn reuses it; commit keeps a sequence open; a
fork attends exactly as its source until each appends its own tokens."""
import asyncio

import numpy as np
import pytest

import kvcd
import kvcd.aio
from conftest import random_kv, random_tokens


def test_turns_commit_and_fork(client):
    salt = "sessions-sync"
    p = client.profile("tiny")
    conv = random_tokens(40, 31)
    k, v = random_kv(p, 40, 31)
    client.put("tiny", conv[:8], k[:, :8], v[:, :8], cache_salt=salt)  # the system prompt
    # Turn 1: the prompt, the answer (15 tokens), closed with commit.
    seq = client.open_sequence("tiny", conv[:23], k=k[:, :23], v=v[:, :23], cache_salt=salt)
    assert seq.matched_tokens == 8 and seq.length == 23
    assert seq.close(commit=True) == 23
    assert seq.closed and seq.last_commit == kvcd.CommitResult(20, 3, 0)
    # Turn 2 opens on turn 1's tokens and a new message: every committed page matches.
    m = client.match("tiny", conv[:32], cache_salt=salt)
    assert m == kvcd.MatchResult(20, 5, 12)
    with client.open_sequence("tiny", conv[:32], k=k[:, :32], v=v[:, :32],
                              cache_salt=salt) as turn2:
        assert turn2.matched_tokens == 20 and turn2.length == 32
        # A checkpoint keeps it open.
        r = turn2.commit()
        assert r == kvcd.CommitResult(32, 3, 0) and turn2.last_commit == r
        assert client.match("tiny", conv, cache_salt=salt).matched_tokens == 32
        # Two branches from here: the fork is renewed as its source is.
        with turn2.fork(lease_ms=4000) as fork:
            assert fork.id != turn2.id and fork.length == 32 and fork.lease_ms == 4000
            assert fork.model == "tiny" and fork.renewing
            q = np.random.default_rng(3).standard_normal(
                (1, p.num_q_heads, p.head_dim)).astype(np.float32)
            for layer in range(p.num_layers):
                a, b = turn2.attention_decode(layer, q), fork.attention_decode(layer, q)
                np.testing.assert_array_equal(a.o, b.o)
                np.testing.assert_array_equal(a.lse, b.lse)
            ka, va = random_kv(p, 3, 40)
            kb, vb = random_kv(p, 3, 41)
            assert turn2.append([1, 2, 3], ka, va) == 35
            assert fork.append([4, 5, 6], kb, vb) == 35
            fa = turn2.fetch_pages(first_token=32, expand_to_bf16=True)
            fb = fork.fetch_pages(first_token=32, expand_to_bf16=True)
            assert not np.array_equal(fa.k, fb.k)
            assert not np.array_equal(turn2.attention_decode(0, q).o,
                                      fork.attention_decode(0, q).o)
        assert fork.closed
    stats = client.stats()
    assert stats.forks >= 1 and stats.committed_pages >= 6
    assert stats.hit_tokens_put + stats.hit_tokens_committed == stats.hit_tokens


def test_session_calls_by_id_and_their_errors(client):
    salt = "sessions-ids"
    p = client.profile("tiny")
    toks = random_tokens(10, 32)
    k, v = random_kv(p, 10, 32)
    seq = client.open_sequence("tiny", toks, k=k, v=v, cache_salt=salt, auto_renew=False,
                               lease_ms=5000)
    r = client.commit_sequence(seq.id)
    assert r == kvcd.CommitResult(8, 2, 0)
    fork = client.fork_sequence(seq.id, lease_ms=5000)
    assert fork.length == 10 and not fork.renewing  # an id: no handle to follow
    ka, va = random_kv(p, 2, 33)
    assert client.append(fork, [7, 8], ka, va) == 12
    with pytest.raises(kvcd.InvalidArgument, match="lease_ms"):
        client.fork_sequence(seq, lease_ms=-1)
    assert client.close_sequence(fork, commit=True) == 12
    assert fork.last_commit == kvcd.CommitResult(12, 1, 0)  # its first 2 pages were shared
    assert client.close_sequence(seq) == 10
    for call in (lambda: client.commit_sequence(seq), lambda: client.fork_sequence(seq),
                 lambda: client.close_sequence(seq, commit=True)):
        with pytest.raises(kvcd.NotFound):
            call()
    m = client.match("tiny", [int(t) for t in toks] + [7, 8], cache_salt=salt)
    assert (m.matched_tokens, m.committed_tokens) == (12, 12)


def test_aio_turns_commit_and_fork(daemon):
    async def main():
        salt = "sessions-aio"
        async with kvcd.aio.Client(daemon.grpc, timeout=20) as c:
            p = await c.profile("tiny")
            conv = random_tokens(24, 34)
            k, v = random_kv(p, 24, 34)
            seq = await c.open_sequence("tiny", conv[:14], k=k[:, :14], v=v[:, :14],
                                        cache_salt=salt)
            assert await seq.close(commit=True) == 14
            assert seq.last_commit == kvcd.CommitResult(12, 3, 0)
            assert (await c.match("tiny", conv, cache_salt=salt)) == kvcd.MatchResult(12, 3, 12)
            async with await c.open_sequence("tiny", conv, k=k, v=v, cache_salt=salt) as turn2:
                assert turn2.matched_tokens == 12
                assert await turn2.commit() == kvcd.CommitResult(24, 3, 0)
                async with await turn2.fork() as fork:
                    assert fork.renewing and fork.length == 24
                    q = np.ones((1, p.num_q_heads, p.head_dim), np.float32)
                    a = await turn2.attention_decode(1, q)
                    b = await fork.attention_decode(1, q)
                    np.testing.assert_array_equal(a.o, b.o)
                    r = await c.commit_sequence(fork.id)
                    assert r == kvcd.CommitResult(24, 0, 0)
                with pytest.raises(kvcd.NotFound):
                    await c.fork_sequence(fork)
            with pytest.raises(kvcd.NotFound):
                await c.commit_sequence(turn2)

    asyncio.run(main())
