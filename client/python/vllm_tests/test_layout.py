"""kvcd.vllm.layout against a cache built element by element (the CPU backend's block:
per (block, head) its tokens' keys transposed, [head_dim][block_size], then their values,
[block_size][head_dim])."""
import torch

from kvcd.vllm import layout


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
