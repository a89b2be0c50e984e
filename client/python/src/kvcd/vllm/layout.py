"""Moving whole blocks between vLLM's paged KV cache and kvcd's ``[layers, tokens, kv_heads,
head_dim]`` tensors.

vLLM hands a connector each attention layer's cache as the view ``[num_blocks,
num_kv_heads, block_size, 2 * head_dim]``. On the CPU backend (strides the identity) each
(block, head) holds its tokens' keys transposed, ``[head_dim][block_size]``, then their
values, ``[block_size][head_dim]``: the view's row r is not token r's K and V. (Found by
matching the stored keys' per-dimension profile against kvcd-llama's activation dump of the
same model: the transposed reading correlates at 0.99-1.00, row-major at about 0.)
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch


def check_layer(name: str, cache: torch.Tensor, *, num_kv_heads: int, head_dim: int,
                block_size: int) -> None:
    """Raises ``ValueError`` when a layer's cache is not the view this module reads."""
    want = (num_kv_heads, block_size, 2 * head_dim)
    if cache.dim() != 4 or tuple(cache.shape[1:]) != want:
        raise ValueError(f"kvcd connector: KV cache of layer '{name}' has shape "
                         f"{tuple(cache.shape)}, expected [num_blocks, {want[0]}, {want[1]}, "
                         f"{want[2]}] (blocks, KV heads, block size, K and V rows)")


def gather(layers: Sequence[torch.Tensor], block_ids: Sequence[int],
           head_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """K and V of the tokens of ``block_ids`` (in that order), each ``[layers, tokens,
    kv_heads, head_dim]`` on the host, in the cache's dtype."""
    idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=layers[0].device)
    ks: List[torch.Tensor] = []
    vs: List[torch.Tensor] = []
    for cache in layers:
        nb, heads, bs = len(block_ids), cache.shape[1], cache.shape[2]
        blk = cache.index_select(0, idx).reshape(nb, heads, 2, bs * head_dim)
        k = blk[:, :, 0].reshape(nb, heads, head_dim, bs).permute(0, 3, 1, 2)  # [nb, bs, H, D]
        v = blk[:, :, 1].reshape(nb, heads, bs, head_dim).permute(0, 2, 1, 3)
        ks.append(k.reshape(nb * bs, heads, head_dim))
        vs.append(v.reshape(nb * bs, heads, head_dim))
    return torch.stack(ks).cpu(), torch.stack(vs).cpu()


def scatter(layers: Sequence[torch.Tensor], block_ids: Sequence[int], k: torch.Tensor,
            v: torch.Tensor) -> None:
    """Writes ``k``/``v`` ``[layers, len(block_ids) * block_size, kv_heads, head_dim]`` into
    the blocks ``block_ids`` of every layer (converted to the cache's dtype and device)."""
    if not layers:
        return
    nb = len(block_ids)
    idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=layers[0].device)
    for layer, cache in enumerate(layers):
        heads, bs = cache.shape[1], cache.shape[2]
        kl = k[layer].to(cache.device, cache.dtype).reshape(nb, bs, heads, -1)
        vl = v[layer].to(cache.device, cache.dtype).reshape(nb, bs, heads, -1)
        kt = kl.permute(0, 2, 3, 1).reshape(nb, heads, -1)  # [nb, H, D * bs]
        vt = vl.permute(0, 2, 1, 3).reshape(nb, heads, -1)  # [nb, H, bs * D]
        cache.index_copy_(0, idx, torch.cat([kt, vt], dim=-1).reshape(nb, heads, bs, -1))


def ordered_layers(kv_caches: Dict[str, torch.Tensor]) -> List[Tuple[str, torch.Tensor]]:
    """The attention layers in model order (by the layer index in their names)."""
    from vllm.model_executor.models.utils import extract_layer_index
    return sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
