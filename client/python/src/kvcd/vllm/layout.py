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
- **The CPU backend** (strides the identity): each (block, head) holds ``block_size *
  head_dim`` elements of keys, then as many of values, laid out as the instruction set its
  attention picked for the cache (vLLM's ``_get_attn_isa``: dtype, block size, head size,
  the CPU) writes them:

  - ``vec`` / ``vec16`` (AVX-512, AVX2 and the portable kernels): keys transposed,
    ``[head_dim][block_size]``, values ``[block_size][head_dim]``. (Found by matching the
    stored keys' per-dimension profile against kvcd-llama's activation dump of the same model:
    the transposed reading correlates at 0.99-1.00, row-major at about 0.)
  - ``amx`` (BF16 caches with blocks of a multiple of 32 tokens on CPUs with AMX tiles): the
    tiles' packed operands. Keys in groups of 16 tokens, each group ``[head_dim / 2][16][2]``
    (pairs of dimensions per token); values in groups of 16 dimensions, each group
    ``[block_size / 2][16][2]`` (pairs of tokens per dimension). Read from vLLM's own
    ``reshape_and_cache`` for AMX; reading such a cache the ``vec`` way scrambles every key
    (a compressed prefix then loads as noise).

  Any other instruction set's layout is refused (``ValueError``), not guessed.

The reading follows the cache's device: a CPU tensor is the CPU backend's block, a CUDA
tensor the view as it says.
"""
from __future__ import annotations

import functools
from typing import Dict, List, Sequence, Tuple

import torch


_CPU_LAYOUTS = ("vec", "vec16", "amx")


def check_layer(name: str, cache: torch.Tensor, *, num_kv_heads: int, head_dim: int,
                block_size: int) -> None:
    """Raises ``ValueError`` when a layer's cache is not the view this module reads, or is
    laid out by a CPU attention kernel whose layout it does not know."""
    want = (num_kv_heads, block_size, 2 * head_dim)
    if cache.dim() != 4 or tuple(cache.shape[1:]) != want:
        raise ValueError(f"kvcd connector: KV cache of layer '{name}' has shape "
                         f"{tuple(cache.shape)}, expected [num_blocks, {want[0]}, {want[1]}, "
                         f"{want[2]}] (blocks, KV heads, block size, K and V rows)")
    if _cpu_block(cache):
        isa = _cpu_isa(cache.dtype, block_size, head_dim)
        if isa not in _CPU_LAYOUTS:
            raise ValueError(f"kvcd connector: layer '{name}' is a CPU cache laid out for vLLM's "
                             f"'{isa}' attention kernels, whose block layout the connector does "
                             f"not read (it reads {', '.join(_CPU_LAYOUTS)})")


def _cpu_block(cache: torch.Tensor) -> bool:
    return cache.device.type == "cpu"


@functools.lru_cache(maxsize=None)
def _cpu_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The instruction set vLLM's CPU attention uses for such a cache (its own rule), which
    decides the block layout."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    return _get_attn_isa(dtype, block_size, head_dim)


def _amx(cache: torch.Tensor, head_dim: int) -> bool:
    isa = _cpu_isa(cache.dtype, cache.shape[2], head_dim)
    if isa not in _CPU_LAYOUTS:
        raise ValueError(f"kvcd connector: no block layout for vLLM's '{isa}' CPU attention")
    return isa == "amx"


def _index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(block_ids), dtype=torch.long, device=device)


def _layer_kv(cache: torch.Tensor, idx: torch.Tensor,
              head_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks ``idx`` of one layer, each ``[nb * block_size, heads, D]``."""
    nb, heads, bs = idx.numel(), cache.shape[1], cache.shape[2]
    blk = cache.index_select(0, idx)
    if _cpu_block(cache) and _amx(cache, head_dim):
        blk = blk.reshape(nb, heads, 2, bs * head_dim)
        # keys [g][d/2][t%16][d%2], values [d/16][t/2][d%16][t%2]
        k = blk[:, :, 0].reshape(nb, heads, bs // 16, head_dim // 2, 16, 2)
        k = k.permute(0, 2, 4, 1, 3, 5)  # [nb, g, t%16, H, d/2, d%2]
        v = blk[:, :, 1].reshape(nb, heads, head_dim // 16, bs // 2, 16, 2)
        v = v.permute(0, 3, 5, 1, 2, 4)  # [nb, t/2, t%2, H, d/16, d%16]
    elif _cpu_block(cache):
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
    nb, bs, heads, D = k.shape
    if _cpu_block(cache) and _amx(cache, D):
        kt = k.reshape(nb, bs // 16, 16, heads, D // 2, 2).permute(0, 3, 1, 4, 2, 5)
        vt = v.reshape(nb, bs // 2, 2, heads, D // 16, 16).permute(0, 3, 4, 1, 5, 2)
        kv = torch.cat([kt.reshape(nb, heads, -1), vt.reshape(nb, heads, -1)], dim=-1)
        cache.index_copy_(0, idx, kv.reshape(nb, heads, bs, -1))
    elif _cpu_block(cache):
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
