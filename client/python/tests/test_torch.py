"""torch tensors (CPU) in and out; skipped when torch is not installed.

torch is optional and large, so scripts/test-python.sh does not install it; these tests
run where torch is present (e.g. the H200 image, see client/python/README.md)."""
import numpy as np
import pytest

from conftest import bf16_round, random_kv, random_tokens, reference_attention

torch = pytest.importorskip("torch")


def test_put_append_attend_with_torch(client):
    p = client.profile("tiny")
    n = 10
    toks = torch.tensor(random_tokens(n, 60))
    k, v = random_kv(p, n, 60)
    kt, vt = torch.from_numpy(k), torch.from_numpy(v)
    r = client.put("tiny", toks, kt.to(torch.bfloat16), vt.to(torch.bfloat16))  # sent as BF16
    assert (r.inserted_tokens, r.ignored_tokens) == (8, 2)
    with client.open_sequence("tiny", toks, k=kt, v=vt) as seq:
        assert seq.length == n
        q = torch.randn(1, p.num_q_heads, p.head_dim, generator=torch.Generator().manual_seed(0))
        o, lse = seq.attention_decode(0, q)
        assert isinstance(o, torch.Tensor) and o.dtype == torch.float32 and o.shape == q.shape
        assert isinstance(lse, torch.Tensor) and lse.shape == (1, p.num_q_heads)
        ro, rl = reference_attention(q[0].numpy(), bf16_round(k[0]), bf16_round(v[0]))
        np.testing.assert_allclose(o[0].numpy(), ro, rtol=1e-4, atol=1e-5)
        f = seq.fetch_pages(expand_to_bf16=True, as_torch=True)
        assert f.k.dtype == torch.bfloat16
        assert torch.equal(f.k, kt.to(torch.bfloat16))  # bit-exact BF16
        with client.decode_session() as s:
            kn = torch.zeros(1, p.num_kv_heads, p.head_dim, dtype=torch.bfloat16)
            out = s.attend(0, seq, q.to(torch.bfloat16), k_new=kn, v_new=kn, new_tokens=[3])
            assert isinstance(out.o, torch.Tensor) and out.lengths == (n + 1,)


def test_torch_shapes_are_checked(client):
    p = client.profile("tiny")
    k = torch.zeros(p.num_layers, 8, p.num_kv_heads, p.head_dim + 1)
    with pytest.raises(ValueError, match="k has shape"):
        client.put("tiny", list(range(8)), k, k)
    with pytest.raises(TypeError):
        client.put("tiny", list(range(8)), k.to(torch.int32)[..., :-1], k[..., :-1])
