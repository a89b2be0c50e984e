"""The exact merge of attention over disjoint parts of one history (docs/cluster.md
"Attention across daemons"): each part's output ``o`` (normalized within the part) and its
natural-log sum of exponentials ``lse`` combine as

    m = max(lse_a, lse_b);  o = (e^(lse_a-m) o_a + e^(lse_b-m) o_b) / (e^(lse_a-m) + e^(lse_b-m))
    lse = m + log(e^(lse_a-m) + e^(lse_b-m))

the same combination the kernels use for their splits. A part with no tokens has
``lse = -inf`` and weight 0.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

__all__ = ["merge_attention", "merge_many"]


def merge_attention(o_a, lse_a, o_b, lse_b) -> Tuple[np.ndarray, np.ndarray]:
    """Merges two parts. ``o``: ``[..., head_dim]``; ``lse``: ``o``'s shape without the last
    axis. Returns float32 (o, lse). Non-finite parts other than ``-inf`` LSEs raise."""
    o_a, o_b = np.asarray(o_a, np.float64), np.asarray(o_b, np.float64)
    lse_a, lse_b = np.asarray(lse_a, np.float64), np.asarray(lse_b, np.float64)
    if o_a.shape != o_b.shape or lse_a.shape != lse_b.shape or o_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"shapes do not merge: o {o_a.shape} and {o_b.shape}, "
                         f"lse {lse_a.shape} and {lse_b.shape} (lse must be o without its "
                         f"last axis)")
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if np.isnan(x).any() or np.isposinf(x).any():
            raise ValueError(f"{name} holds NaN or +inf")
    m = np.maximum(lse_a, lse_b)
    empty = np.isneginf(m)  # both parts empty
    m_safe = np.where(empty, 0.0, m)
    wa, wb = np.exp(lse_a - m_safe), np.exp(lse_b - m_safe)
    den = wa + wb
    o = (wa[..., None] * o_a + wb[..., None] * o_b) / np.where(den == 0, 1.0, den)[..., None]
    lse = np.where(empty, -np.inf, m_safe + np.log(np.where(den == 0, 1.0, den)))
    return o.astype(np.float32), lse.astype(np.float32)


def merge_many(parts: Sequence[Tuple[object, object]]) -> Tuple[np.ndarray, np.ndarray]:
    """Merges any number of (o, lse) parts, left to right."""
    if not parts:
        raise ValueError("merge_many needs at least one (o, lse) part")
    o, lse = np.asarray(parts[0][0], np.float32), np.asarray(parts[0][1], np.float32)
    for o_b, lse_b in parts[1:]:
        o, lse = merge_attention(o, lse, o_b, lse_b)
    return o, lse
