"""Moving whole blocks between vLLM's paged KV cache and kvcd's ``[layers, tokens, kv_heads,
head_dim]`` tensors.

vLLM (0.32) hands a connector each attention layer's cache as the logical view
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``; how its bytes are laid out depends
on the backend:

- **GPU backends** (FlashAttention and the others that read the view as it says): token t of
  block b, head h holds its key in ``[b, h, t, :head_dim]`` and its value in ``[b, h, t,
  head_dim:]``. The view is usually not contiguous: the default physical layout (vLLM's
  ``KVCacheLayout.LBNHC``) is ``[num_blocks, block_size, num_kv_heads, 2 * head_dim]``,
  permuted into the view. Everything below indexes through the view's strides.
- **The CPU backend** (strides the identity): each (block, head) holds its tokens' keys
  transposed, ``[head_dim][block_size]``, then their values, ``[block_size][head_dim]``: the
  view's row r is not token r's K and V. (Found by matching the stored keys' per-dimension
  profile against kvcd-llama's activation dump of the same model: the transposed reading
  correlates at 0.99-1.00, row-major at about 0.)

The reading follows the cache's device: a CPU tensor is the CPU backend's block, a CUDA
tensor the view as it says.
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


def _cpu_block(cache: torch.Tensor) -> bool:
    return cache.device.type == "cpu"


def _index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(block_ids), dtype=torch.long, device=device)


def _layer_kv(cache: torch.Tensor, idx: torch.Tensor,
              head_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks ``idx`` of one layer, each ``[nb * block_size, heads, D]``."""
    nb, heads, bs = idx.numel(), cache.shape[1], cache.shape[2]
    blk = cache.index_select(0, idx)
    if _cpu_block(cache):
        blk = blk.reshape(nb, heads, 2, bs * head_dim)
        k = blk[:, :, 0].reshape(nb, heads, head_dim, bs).permute(0, 3, 1, 2)  # [nb, bs, H, D]
        v = blk[:, :, 1].reshape(nb, heads, bs, head_dim).permute(0, 2, 1, 3)
    else:
        k = blk[..., :head_dim].permute(0, 2, 1, 3)  # [nb, bs, H, D]
        v = blk[..., head_dim:].permute(0, 2, 1, 3)
    return k.reshape(nb * bs, heads, head_dim), v.reshape(nb * bs, heads, head_dim)


def gather(layers: Sequence[torch.Tensor], block_ids: Sequence[int],
           head_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """K and V of the tokens of ``block_ids`` (in that order), each ``[layers, tokens,
    kv_heads, head_dim]`` on the host, in the cache's dtype."""
    idx = _index(block_ids, layers[0].device)
    ks: List[torch.Tensor] = []
    vs: List[torch.Tensor] = []
    for cache in layers:
        k, v = _layer_kv(cache, idx, head_dim)
        ks.append(k)
        vs.append(v)
    return torch.stack(ks).cpu(), torch.stack(vs).cpu()


def gather_into(layers: Sequence[torch.Tensor], block_ids: Sequence[int], head_dim: int,
                k_out: torch.Tensor, v_out: torch.Tensor) -> None:
    """As :func:`gather`, written into ``k_out``/``v_out`` ``[layers, tokens, kv_heads,
    head_dim]`` on the caches' device (converted to their dtype), on the current stream."""
    idx = _index(block_ids, layers[0].device)
    for layer, cache in enumerate(layers):
        k, v = _layer_kv(cache, idx, head_dim)
        k_out[layer].copy_(k)
        v_out[layer].copy_(v)


def _write_blocks(cache: torch.Tensor, idx: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> None:
    """Writes K/V ``[nb, bs, heads, D]`` (the cache's dtype and device) into blocks ``idx``."""
    nb, bs, heads = k.shape[0], k.shape[1], k.shape[2]
    if _cpu_block(cache):
        kt = k.permute(0, 2, 3, 1).reshape(nb, heads, -1)  # [nb, H, D * bs]
        vt = v.permute(0, 2, 1, 3).reshape(nb, heads, -1)  # [nb, H, bs * D]
        cache.index_copy_(0, idx, torch.cat([kt, vt], dim=-1).reshape(nb, heads, bs, -1))
    else:
        cache.index_copy_(0, idx, torch.cat([k, v], dim=-1).permute(0, 2, 1, 3))


def scatter(layers: Sequence[torch.Tensor], block_ids: Sequence[int], k: torch.Tensor,
            v: torch.Tensor) -> None:
    """Writes ``k``/``v`` ``[layers, len(block_ids) * block_size, kv_heads, head_dim]`` into
    the blocks ``block_ids`` of every layer (converted to the cache's dtype and device)."""
    if not layers:
        return
    nb = len(block_ids)
    idx = _index(block_ids, layers[0].device)
    for layer, cache in enumerate(layers):
        heads, bs = cache.shape[1], cache.shape[2]
        kl = k[layer].to(cache.device, cache.dtype).reshape(nb, bs, heads, -1)
        vl = v[layer].to(cache.device, cache.dtype).reshape(nb, bs, heads, -1)
        _write_blocks(cache, idx, kl, vl)


def scatter_bf16_pages(layers: Sequence[torch.Tensor], block_ids: Sequence[int],
                       pages: torch.Tensor) -> None:
    """Writes kvcd pages stored ``"bf16"`` (unrotated: a BF16-history model), ``pages``
    ``[len(block_ids), layers, 2, kv_heads, block_size, head_dim]`` (each page's layers back
    to back, a page-layer K then V, each ``[head][token][dim]``), into the blocks
    ``block_ids`` of every layer, on the pages' device."""
    idx = _index(block_ids, layers[0].device)
    for layer, cache in enumerate(layers):
        kv = pages[:, layer].to(cache.dtype)  # [nb, 2, H, bs, D]
        _write_blocks(cache, idx, kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2))


def ordered_layers(kv_caches: Dict[str, torch.Tensor]) -> List[Tuple[str, torch.Tensor]]:
    """The attention layers in model order (by the layer index in their names)."""
    from vllm.model_executor.models.utils import extract_layer_index
    return sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
