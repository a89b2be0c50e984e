"""Decoders of pages as the daemon stores them (``FetchPages`` with ``expand_to_bf16=False``).

A stored page holds ``page_size`` tokens of one sequence for all layers: its ``data`` is
``num_layers`` page-layers back to back, each in the page's ``format``:

``"bf16"``
    K then V, each ``[num_kv_heads][page_size][head_dim]`` bfloat16 (little-endian). For a
    model whose history is ``int2-oscar`` these rows are stored rotated (``k·R_k``, ``v·R_v``).

``"int2-oscar"`` (kernels/include/kvcd/kernels/int2_attention.h and int2_codec.h)
    With ``d = head_dim``, ``Q = d/4`` code bytes per row, ``G = min(4, Q)``,
    ``P4 = ceil(page_size/4)``, ``H = num_kv_heads``, ``P = page_size``, in this order:

    ===========  ==========================  ===============================================
    K codes      ``[H][Q/G][P][G]`` uint8    row (token t, head h), byte j at
                                             ``h*P*Q + (j//G)*P*G + t*G + j%G``
    V codes      ``[H][P4][Q][4]`` uint8     byte j of 4 consecutive tokens together:
                                             ``H*P*Q + h*P4*4*Q + (t//4)*4*Q + j*4 + t%4``
    K params     ``[H][2][P]`` float16       scales, then minimums (``lo``)
    V params     ``[H][2][P]`` float16
    ===========  ==========================  ===============================================

    Byte j of a row holds elements ``j, j+Q, j+2Q, j+3Q`` in bits ``[1:0], [3:2], [5:4],
    [7:6]`` (planar packing). An element is ``x̂ = code·scale + lo`` in the rotated space;
    the original row is ``x = x̂ · Rᵀ`` (R the layer's ``r_k`` / ``r_v``; identity for
    ``codec: identity``, :func:`hadamard` for ``codec: hadamard``). A page-layer is
    ``H·(P·Q + P4·4·Q + 8·P)`` bytes (36 B per token-head for K and for V at d = 128).

The decoders return ``(k, v)`` float32 arrays ``[num_layers, page_size, num_kv_heads,
head_dim]`` (the token-major layout of ``Put``/``Append`` and of ``FetchPages``'s expanded
tensors), cut to ``num_tokens`` when given. They are checked against the daemon's own
expansion (``FetchPages(expand_to_bf16=True)``) in tests/test_pages.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import numpy as np

from .tensors import bf16_bits_to_float

__all__ = ["PageGeometry", "int2_page_layer_bytes", "bf16_page_layer_bytes", "decode_bf16_page",
           "decode_int2_page", "decode_page", "hadamard"]

Rotation = Optional[Union[np.ndarray, Sequence[np.ndarray]]]


@dataclass(frozen=True)
class PageGeometry:
    """The model geometry a page layout depends on."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int

    @classmethod
    def of(cls, profile) -> "PageGeometry":
        """From a ``ModelProfile`` / ``ModelInfo`` message (or anything with those fields)."""
        p = getattr(profile, "profile", profile)
        return cls(int(p.num_layers), int(p.num_kv_heads), int(p.head_dim), int(p.page_size))


def bf16_page_layer_bytes(g: PageGeometry) -> int:
    return 2 * g.num_kv_heads * g.page_size * g.head_dim * 2


def int2_page_layer_bytes(g: PageGeometry) -> int:
    q = g.head_dim // 4
    p4 = (g.page_size + 3) // 4
    return g.num_kv_heads * (g.page_size * q + p4 * 4 * q + 8 * g.page_size)


def hadamard(d: int) -> np.ndarray:
    """The normalized Sylvester Hadamard matrix (``H_2n = [[H, H], [H, -H]] / √2``), the
    rotation of ``codec: hadamard``."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"d is {d}, expected a power of two")
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(d)).astype(np.float32)


def _layer_rotation(rot: Rotation, layer: int) -> Optional[np.ndarray]:
    if rot is None:
        return None
    if isinstance(rot, np.ndarray) and rot.ndim == 2:
        return rot
    return np.asarray(rot[layer], dtype=np.float32)


def _unrotate(x: np.ndarray, rot: Optional[np.ndarray]) -> np.ndarray:
    if rot is None:
        return x
    return (x.astype(np.float32) @ np.asarray(rot, dtype=np.float32).T).astype(np.float32)


def _check_size(data: bytes, per_layer: int, g: PageGeometry, fmt: str) -> None:
    if len(data) != per_layer * g.num_layers:
        raise ValueError(f"{fmt} page has {len(data)} bytes, expected {g.num_layers} layers x "
                         f"{per_layer} = {per_layer * g.num_layers}")


def decode_bf16_page(data: bytes, g: PageGeometry, *, num_tokens: Optional[int] = None,
                     rotation_k: Rotation = None, rotation_v: Rotation = None
                     ) -> Tuple[np.ndarray, np.ndarray]:
    """Decodes a ``"bf16"`` page; rotations (per layer or one for all) undo a rotated store."""
    per_layer = bf16_page_layer_bytes(g)
    _check_size(data, per_layer, g, "bf16")
    H, P, D, L = g.num_kv_heads, g.page_size, g.head_dim, g.num_layers
    raw = np.frombuffer(data, dtype="<u2").reshape(L, 2, H, P, D)
    kv = bf16_bits_to_float(raw).reshape(L, 2, H, P, D).transpose(0, 1, 3, 2, 4)  # [L,2,P,H,D]
    k = np.empty((L, P, H, D), np.float32)
    v = np.empty((L, P, H, D), np.float32)
    for layer in range(L):
        k[layer] = _unrotate(kv[layer, 0], _layer_rotation(rotation_k, layer))
        v[layer] = _unrotate(kv[layer, 1], _layer_rotation(rotation_v, layer))
    n = P if num_tokens is None else num_tokens
    return k[:, :n], v[:, :n]


def _unpack(codes: np.ndarray) -> np.ndarray:
    """[..., Q] bytes -> [..., 4Q] 2-bit codes in planar order."""
    parts = [(codes >> np.uint8(2 * i)) & np.uint8(3) for i in range(4)]
    return np.concatenate(parts, axis=-1)


def decode_int2_page(data: bytes, g: PageGeometry, *, num_tokens: Optional[int] = None,
                     rotation_k: Rotation = None, rotation_v: Rotation = None
                     ) -> Tuple[np.ndarray, np.ndarray]:
    """Decodes an ``"int2-oscar"`` page (layout in the module docstring).

    Without rotations the result is in the rotated (stored) space; pass the model's
    ``r_k``/``r_v`` (``[d, d]`` or one per layer) to get the original K/V."""
    per_layer = int2_page_layer_bytes(g)
    _check_size(data, per_layer, g, "int2-oscar")
    H, P, D, L = g.num_kv_heads, g.page_size, g.head_dim, g.num_layers
    Q = D // 4
    G = min(4, Q)
    P4 = (P + 3) // 4
    k_codes_bytes = H * P * Q
    v_codes_bytes = H * P4 * 4 * Q
    buf = np.frombuffer(data, dtype=np.uint8).reshape(L, per_layer)
    k_out = np.empty((L, P, H, D), np.float32)
    v_out = np.empty((L, P, H, D), np.float32)
    for layer in range(L):
        b = buf[layer]
        # K codes [H][Q/G][P][G] -> [H][P][Q]
        kc = b[:k_codes_bytes].reshape(H, Q // G, P, G).transpose(0, 2, 1, 3).reshape(H, P, Q)
        # V codes [H][P4][Q][4] -> [H][P4*4][Q] -> first P tokens
        vc = b[k_codes_bytes:k_codes_bytes + v_codes_bytes].reshape(H, P4, Q, 4)
        vc = vc.transpose(0, 1, 3, 2).reshape(H, P4 * 4, Q)[:, :P]
        params = np.frombuffer(b[k_codes_bytes + v_codes_bytes:].tobytes(), dtype="<f2")
        params = params.astype(np.float32).reshape(2, H, 2, P)  # [K|V][head][scale|lo][token]
        for codes, which, out, rot in ((kc, 0, k_out, rotation_k), (vc, 1, v_out, rotation_v)):
            q = _unpack(codes).astype(np.float32)  # [H, P, D]
            scale = params[which, :, 0, :, None]   # [H, P, 1]
            lo = params[which, :, 1, :, None]
            x = q * scale + lo                     # rotated space
            out[layer] = _unrotate(x.transpose(1, 0, 2), _layer_rotation(rot, layer))
    n = P if num_tokens is None else num_tokens
    return k_out[:, :n], v_out[:, :n]


def decode_page(page, g: PageGeometry, *, rotation_k: Rotation = None,
                rotation_v: Rotation = None) -> Tuple[np.ndarray, np.ndarray]:
    """Decodes a ``StoredPage`` message (format, num_tokens, data) of either format.

    For a model with ``int2-oscar`` history, BF16 pages are stored rotated too, so the
    same rotations apply to both formats."""
    fmt = page.format
    n = int(page.num_tokens)
    if fmt == "bf16":
        return decode_bf16_page(page.data, g, num_tokens=n, rotation_k=rotation_k,
                                rotation_v=rotation_v)
    if fmt == "int2-oscar":
        return decode_int2_page(page.data, g, num_tokens=n, rotation_k=rotation_k,
                                rotation_v=rotation_v)
    raise ValueError(f"page format '{fmt}' has no decoder (expected 'bf16' or 'int2-oscar')")
