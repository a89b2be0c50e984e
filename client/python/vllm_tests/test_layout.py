"""kvcd.vllm.layout against a cache built element by element (the CPU backend's block:
per (block, head) the K rows of its tokens, then their V rows)."""
import torch

from kvcd.vllm import layout


def test_gather_and_scatter_follow_the_cpu_block_layout():
    # A cache whose (block, head) memory is K rows then V rows: token t of block b, head h has
    # K = 1000*b + 100*h + t and V = the negative.
    nb, H, bs, D = 5, 3, 8, 4
    raw = torch.zeros(nb, H, 2, bs, D)
    for b in range(nb):
        for h in range(H):
            for t in range(bs):
                raw[b, h, 0, t] = 1000 * b + 100 * h + t
                raw[b, h, 1, t] = -(1000 * b + 100 * h + t)
    cache = raw.reshape(nb, H, bs, 2 * D)
    k, v = layout.gather([cache], [3, 1], D)
    assert k.shape == (1, 2 * bs, H, D)
    assert k[0, 0, 2, 0] == 3200 and k[0, bs + 5, 1, 3] == 1105 and v[0, 7, 0, 1] == -3007
    new = torch.zeros_like(cache)
    layout.scatter([new], [3, 1], k, v)
    assert torch.equal(new[3], cache[3]) and torch.equal(new[1], cache[1]) and new[0].abs().sum() == 0
