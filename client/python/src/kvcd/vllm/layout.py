"""Moving whole blocks between vLLM's paged KV cache and kvcd's ``[layers, tokens, kv_heads,
head_dim]`` tensors.

vLLM hands a connector each attention layer's cache as the logical view ``[num_blocks,
num_kv_heads, block_size, 2 * head_dim]`` (the physical strides differ by backend; the CPU
backend's are the identity): per (block, head) each token's row holds its K then its V.
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
        rows = cache.index_select(0, idx).permute(0, 2, 1, 3)  # [nb, bs, H, 2D]
        rows = rows.reshape(-1, rows.shape[2], rows.shape[3])
        ks.append(rows[..., :head_dim])
        vs.append(rows[..., head_dim:])
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
        bs, heads = cache.shape[2], cache.shape[1]
        rows = torch.cat([k[layer], v[layer]], dim=-1).to(cache.device, cache.dtype)
        cache.index_copy_(0, idx, rows.reshape(nb, bs, heads, -1).permute(0, 2, 1, 3))


def ordered_layers(kv_caches: Dict[str, torch.Tensor]) -> List[Tuple[str, torch.Tensor]]:
    """The attention layers in model order (by the layer index in their names)."""
    from vllm.model_executor.models.utils import extract_layer_index
    return sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
