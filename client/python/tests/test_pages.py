"""The numpy decoders of stored pages against the daemon's own expansion."""
import numpy as np
import pytest

import kvcd
from kvcd.pages import PageGeometry, decode_int2_page, hadamard, int2_page_layer_bytes
from conftest import bf16_round, random_kv, random_tokens

BF16_ULP = 2.0 ** -8  # relative spacing of bfloat16


def assert_close_to_bf16(decoded, expanded):
    """decoded (float32) rounds to the daemon's BF16 value, up to one BF16 ulp (the two
    sides sum the un-rotation in different orders)."""
    err = np.abs(decoded - expanded)
    bound = BF16_ULP * np.maximum(np.abs(expanded), 1e-2) + 1e-6
    assert (err <= bound).all(), f"max err {err.max()} at {np.unravel_index(err.argmax(), err.shape)}"


@pytest.mark.parametrize("model,rotation", [("tiny-int2", None), ("tiny-int2-h", "hadamard")])
def test_int2_decoder_matches_the_daemons_expansion(client, model, rotation):
    p = client.profile(model)
    n = 30  # page 4, sink 4: page 0 BF16, pages 1..6 INT2 (demoted on Put), 2 tokens pending
    toks = random_tokens(n, 40)
    k, v = random_kv(p, n, 40)
    client.put(model, toks, k, v)
    r = hadamard(p.head_dim) if rotation else None
    with client.open_sequence(model, toks, k=k, v=v) as seq:
        stored = seq.fetch_pages()
        expanded = seq.fetch_pages(expand_to_bf16=True)
        assert stored.page_formats == expanded.page_formats
        assert stored.page_formats.count("int2-oscar") == 6 and stored.page_formats[0] == "bf16"
        g = PageGeometry.of(p)
        int2 = [pg for pg in stored.pages if pg.format == "int2-oscar"]
        assert all(len(pg.data) == p.num_layers * int2_page_layer_bytes(g) for pg in int2)
        dk, dv = stored.decode(rotation_k=r, rotation_v=r)
        assert dk.shape == expanded.k.shape == (p.num_layers, n, p.num_kv_heads, p.head_dim)
        assert_close_to_bf16(dk, expanded.k)
        assert_close_to_bf16(dv, expanded.v)
        # BF16 pages are exact; INT2 pages are a 2-bit approximation of the input.
        np.testing.assert_array_equal(bf16_round(dk[:, :4]), expanded.k[:, :4])
        int2_err = np.abs(dk[:, 4:28] - k[:, 4:28]).mean() / np.abs(k[:, 4:28]).mean()
        assert 0.05 < int2_err < 0.6
        # Every code value and the FP16 parameters are used: decoding one page by hand.
        pg = int2[0]
        pk, pv = decode_int2_page(pg.data, g, rotation_k=r, rotation_v=r)
        assert_close_to_bf16(pk, expanded.k[:, pg.first_token:pg.first_token + 4])


def test_decoder_rejects_a_wrong_size(client):
    g = PageGeometry.of(client.profile("tiny-int2"))
    with pytest.raises(ValueError, match="expected"):
        decode_int2_page(b"\0" * 10, g)
    page = kvcd.pb.StoredPage(format="fsq", num_tokens=4, data=b"")
    with pytest.raises(ValueError, match="no decoder"):
        kvcd.decode_page(page, g)


def test_hadamard_is_orthogonal():
    h = hadamard(16)
    np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-6)
    with pytest.raises(ValueError):
        hadamard(12)


def test_wrong_rotation_does_not_match(client):
    """The test above can fail: decoding Hadamard pages without the rotation differs."""
    p = client.profile("tiny-int2-h")
    toks = random_tokens(12, 41)
    k, v = random_kv(p, 12, 41)
    client.put("tiny-int2-h", toks, k, v)
    with client.open_sequence("tiny-int2-h", toks) as seq:
        dk, _ = seq.fetch_pages().decode()
        ek = seq.fetch_pages(expand_to_bf16=True).k
        assert np.abs(dk - ek).max() > 0.1
