"""kvcd.vllm.layout against a cache built element by element (the CPU backend's block with
its vec kernels: per (block, head) its tokens' keys transposed, [head_dim][block_size], then
their values, [block_size][head_dim]; with its AMX kernels the tiles' packed operands), and
against vLLM's own CPU cache writes for both; the GPU backends' view read as it says (K in [b, h, t, :D], V in
[b, h, t, D:], through a permuted view of the physical [blocks, tokens, heads, 2D]); kvcd's
stored BF16 pages written into blocks; the IPC save buffer's ring of regions."""
import pytest
import torch

from kvcd.vllm import layout
from kvcd.vllm.transfer import _Ring


def _cpu_cache(nb, H, bs, D, key_at, value_at):
    """A CPU block cache [nb, H, bs, 2D] built element by element: token t of block b, head h
    has K[d] = 10000*b + 1000*h + 10*t + d at key_at(t, d) of its (block, head) keys and V =
    the negative at value_at(t, d) of its values."""
    flat = torch.zeros(nb, H, 2 * bs * D)
    for b in range(nb):
        for h in range(H):
            for t in range(bs):
                for d in range(D):
                    x = 10000 * b + 1000 * h + 10 * t + d
                    flat[b, h, key_at(t, d)] = x
                    flat[b, h, bs * D + value_at(t, d)] = -x
    return flat.reshape(nb, H, bs, 2 * D)


def test_gather_and_scatter_follow_the_cpu_block_layout():
    nb, H, bs, D = 5, 3, 8, 4
    # keys [D][bs], values [bs][D]
    cache = _cpu_cache(nb, H, bs, D, lambda t, d: d * bs + t, lambda t, d: t * D + d)
    k, v = layout.gather([cache], [3, 1], D)
    assert k.shape == (1, 2 * bs, H, D)
    assert k[0, 0, 2, 0] == 32000 and k[0, bs + 5, 1, 3] == 11053 and v[0, 7, 0, 1] == -30071
    new = torch.zeros_like(cache)
    layout.scatter([new], [3, 1], k, v)
    assert torch.equal(new[3], cache[3]) and torch.equal(new[1], cache[1]) and new[0].abs().sum() == 0


def test_gather_and_scatter_follow_the_gpu_view(monkeypatch):
    # The GPU reading on CPU tensors (the device decides which reading applies).
    monkeypatch.setattr(layout, "_cpu_block", lambda cache: False)
    nb, H, bs, D = 5, 3, 8, 4
    phys = torch.zeros(nb, bs, H, 2 * D)  # vLLM's LBNHC layer: [blocks, tokens, heads, 2D]
    for b in range(nb):
        for t in range(bs):
            for h in range(H):
                for d in range(D):
                    x = 1000 * b + 100 * h + 10 * t + d
                    phys[b, t, h, d] = x
                    phys[b, t, h, D + d] = -x
    cache = phys.permute(0, 2, 1, 3)  # the view the connector gets: [blocks, heads, tokens, 2D]
    k, v = layout.gather([cache], [3, 1], D)
    assert k.shape == (1, 2 * bs, H, D)
    assert k[0, 0, 2, 0] == 3200 and k[0, bs + 5, 1, 3] == 1153 and v[0, 7, 0, 1] == -3071
    k2, v2 = torch.empty_like(k), torch.empty_like(v)
    layout.gather_into([cache], [3, 1], D, k2, v2)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    new_phys = torch.zeros_like(phys)
    new = new_phys.permute(0, 2, 1, 3)
    layout.scatter([new], [3, 1], k, v)
    assert torch.equal(new_phys[3], phys[3]) and torch.equal(new_phys[1], phys[1])
    assert new_phys[0].abs().sum() == 0
    # kvcd's "bf16" pages: per page and layer K then V, each [head][token][dim].
    pages = torch.zeros(2, 1, 2, H, bs, D)
    for j, b in enumerate([3, 1]):
        pages[j, 0, 0] = phys[b, :, :, :D].transpose(0, 1)
        pages[j, 0, 1] = phys[b, :, :, D:].transpose(0, 1)
    third = torch.zeros_like(phys)
    layout.scatter_bf16_pages([third.permute(0, 2, 1, 3)], [0, 4], pages)
    assert torch.equal(third[0], phys[3]) and torch.equal(third[4], phys[1])
    assert third[1:4].abs().sum() == 0


def test_bf16_pages_into_the_cpu_block():
    nb, H, bs, D = 3, 2, 4, 2
    cache = torch.arange(nb * H * bs * 2 * D, dtype=torch.float32).reshape(nb, H, bs, 2 * D)
    k, v = layout.gather([cache], [2], D)  # [1, bs, H, D]
    pages = torch.stack([k[0].transpose(0, 1), v[0].transpose(0, 1)])[None, None]
    new = torch.zeros_like(cache)
    layout.scatter_bf16_pages([new], [0], pages)
    assert torch.equal(new[0], cache[2]) and new[1:].abs().sum() == 0


def test_gather_and_scatter_follow_the_amx_block_layout(monkeypatch):
    # vLLM's AMX kernels (BF16 caches, blocks of a multiple of 32 tokens, CPUs with AMX): keys
    # in groups of 16 tokens, each [D/2][16][2]; values in groups of 16 dimensions, each
    # [bs/2][16][2]. Written here element by element from that description.
    monkeypatch.setattr(layout, "_cpu_isa", lambda dtype, block_size, head_dim: "amx")
    nb, H, bs, D = 3, 2, 32, 32
    cache = _cpu_cache(nb, H, bs, D,
                       lambda t, d: (t // 16) * 16 * D + (d // 2) * 32 + (t % 16) * 2 + d % 2,
                       lambda t, d: (d // 16) * bs * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2)
    k, v = layout.gather([cache], [2, 0], D)
    assert k.shape == (1, 2 * bs, H, D)
    want_k = torch.tensor([[[10000 * b + 1000 * h + 10 * t + d for d in range(D)]
                            for h in range(H)] for b in (2, 0) for t in range(bs)],
                          dtype=torch.float32)
    assert torch.equal(k[0], want_k) and torch.equal(v[0], -want_k)
    new = torch.zeros_like(cache)
    layout.scatter([new], [2, 0], k, v)
    assert torch.equal(new[2], cache[2]) and torch.equal(new[0], cache[0])
    assert new[1].abs().sum() == 0


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_layouts_read_what_vllms_own_cache_writes_wrote(monkeypatch, isa):
    # vLLM's reshape_and_cache of the CPU backend for that instruction set writes the cache;
    # the connector reads the same K/V back and writes the same bytes.
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX tiles on this CPU")
    from vllm import _custom_ops as ops
    monkeypatch.setattr(layout, "_cpu_isa", lambda dtype, block_size, head_dim: isa)
    nb, H, bs, D = 3, 2, 32, 64
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(2 * bs, H, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(2 * bs, H, D, generator=gen).to(torch.bfloat16)
    cache = torch.zeros(nb, H, bs, 2 * D, dtype=torch.bfloat16)
    key_cache, value_cache = cache.view(nb, H, 2 * bs, D).chunk(2, dim=2)
    slots = torch.cat([torch.arange(2 * bs, 3 * bs), torch.arange(0, bs)])  # blocks 2, 0
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
    got_k, got_v = layout.gather([cache], [2, 0], D)
    assert torch.equal(got_k[0], k) and torch.equal(got_v[0], v)
    new = torch.zeros_like(cache)
    layout.scatter([new], [2, 0], got_k, got_v)
    assert torch.equal(new, cache)


def test_an_unknown_cpu_layout_is_refused(monkeypatch):
    monkeypatch.setattr(layout, "_cpu_isa", lambda dtype, block_size, head_dim: "neon")
    cache = torch.zeros(2, 2, 32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'neon' attention kernels"):
        layout.check_layer("model.layers.0.self_attn.attn", cache, num_kv_heads=2, head_dim=32,
                           block_size=32)
    with pytest.raises(ValueError, match="no block layout"):
        layout.gather([cache], [0], 32)


def test_ring_gives_regions_in_order_and_wraps():
    r = _Ring(1024)
    a = r.take(300)  # 512 bytes (aligned to 256)
    b = r.take(256)
    assert a == (0, 512) and b == (512, 768)
    assert r.take(512) is None  # 256 left at the end, nothing free at the start
    r.give_back(a)
    c = r.take(400)  # wraps to the start
    assert c == (0, 512)
    assert r.take(1) is None  # wrapped: only the space before the oldest region is free
    with pytest.raises(RuntimeError, match="out of order"):
        r.give_back(c)
    r.give_back(b)
    assert r.take(256) == (512, 768)
    assert r.take(2048) is None  # larger than the ring
    assert r.used() == 512 + 256
