"""kvcd.vllm.layout against a cache built element by element (the CPU backend's block:
per (block, head) its tokens' keys transposed, [head_dim][block_size], then their values,
[block_size][head_dim]); the GPU backends' view read as it says (K in [b, h, t, :D], V in
[b, h, t, D:], through a permuted view of the physical [blocks, tokens, heads, 2D]); kvcd's
stored BF16 pages written into blocks; the IPC save buffer's ring of regions."""
import pytest
import torch

from kvcd.vllm import layout
from kvcd.vllm.transfer import _Ring


def test_gather_and_scatter_follow_the_cpu_block_layout():
    # Token t of block b, head h: K[d] = 1000*b + 100*h + 10*t + d, V = the negative.
    nb, H, bs, D = 5, 3, 8, 4
    flat = torch.zeros(nb, H, 2 * bs * D)
    for b in range(nb):
        for h in range(H):
            for t in range(bs):
                for d in range(D):
                    x = 1000 * b + 100 * h + 10 * t + d
                    flat[b, h, d * bs + t] = x  # keys: [D][bs]
                    flat[b, h, bs * D + t * D + d] = -x  # values: [bs][D]
    cache = flat.reshape(nb, H, bs, 2 * D)
    k, v = layout.gather([cache], [3, 1], D)
    assert k.shape == (1, 2 * bs, H, D)
    assert k[0, 0, 2, 0] == 3200 and k[0, bs + 5, 1, 3] == 1153 and v[0, 7, 0, 1] == -3071
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
