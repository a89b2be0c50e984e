"""Routing (docs/cluster.md "Routing"): which member serves a prompt.

Pure functions of what membership and the index say, so the C++ client (client/cluster/)
and this module can be tested against the same cases:

1. ``consecutive_prefixes``: per member, the pages of the longest run from page 0 it holds.
2. ``load_value``/``score``: ``hit_tokens - alpha * load`` with
   ``load = pages_used/pages_capacity * page_size * N + beta * (open_sequences +
   queued_decode)``.
3. ``rendezvous``: nobody holds page 0: the member with the highest
   ``rendezvous_weight(member_id, first_page_hash)`` among those whose load is below
   ``bound`` (1.25) times the mean (bounded load).
4. ``HotPrefixes``: a prefix routed to its holder more than ``replicate_after`` times in
   ``window_s`` while the holder is above the mean load is replicated: the second member by
   rendezvous pulls it (PullPrefix) and serves the request.
"""
from __future__ import annotations

import collections
import hashlib
import struct
import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

from .index import Load

__all__ = ["RoutingConfig", "Decision", "consecutive_prefixes", "load_value", "score",
           "rendezvous_weight", "rendezvous", "bounded_members", "HotPrefixes", "decide"]


@dataclass(frozen=True)
class RoutingConfig:
    """alpha: tokens of hit one unit of load is worth (default 1). beta: load units per open
    sequence or queued decode request (default: ``None`` = one page, ``page_size``).
    bound: no member above ``bound`` x the mean load takes a prefix nobody holds.
    replicate_after: routings of one prefix to one holder within ``window_s`` before it is
    replicated (0 disables replication)."""
    alpha: float = 1.0
    beta: Optional[float] = None
    bound: float = 1.25
    replicate_after: int = 8
    window_s: float = 10.0
    max_tracked_prefixes: int = 4096


def consecutive_prefixes(holders: Sequence[Mapping[str, str]]) -> Dict[str, int]:
    """Per member, the number of pages from page 0 on that it holds without a gap."""
    runs: Dict[str, int] = {}
    alive = set(holders[0]) if holders else set()
    for i, page in enumerate(holders):
        alive &= set(page)
        if not alive:
            break
        for m in alive:
            runs[m] = i + 1
    return runs


def load_value(load: Optional[Load], page_size: int, n_members: int,
               beta: Optional[float]) -> float:
    """The load term of the score; a member that wrote no load counts as idle and empty."""
    if load is None:
        return 0.0
    b = float(page_size) if beta is None else beta
    util = load.pages_used / load.pages_capacity if load.pages_capacity > 0 else 0.0
    return min(util, 1.0) * page_size * n_members + b * (load.open_sequences +
                                                         load.queued_decode)


def score(hit_pages: int, page_size: int, load: float, alpha: float) -> float:
    return hit_pages * page_size - alpha * load


def rendezvous_weight(member_id: str, first_page_hash: bytes) -> int:
    """The first 8 bytes (big-endian, unsigned) of SHA-256(member_id 0x00 first_page_hash)."""
    d = hashlib.sha256(member_id.encode() + b"\x00" + bytes(first_page_hash)).digest()
    return struct.unpack(">Q", d[:8])[0]


def bounded_members(loads: Mapping[str, float], bound: float) -> List[str]:
    """The members whose load is below ``bound`` x the mean (all of them when the mean is 0,
    the least loaded when rounding leaves none)."""
    if not loads:
        return []
    mean = sum(loads.values()) / len(loads)
    if mean <= 0:
        return sorted(loads)
    ok = sorted(m for m, v in loads.items() if v < bound * mean)
    return ok or [min(sorted(loads), key=lambda m: loads[m])]


def rendezvous(first_page_hash: bytes, candidates: Sequence[str]) -> str:
    """The candidate with the highest weight (ties broken by member id)."""
    return max(candidates, key=lambda m: (rendezvous_weight(m, first_page_hash), m))


@dataclass
class Decision:
    member_id: str
    hit_pages: int                 # pages of the prompt the chosen member holds (index)
    reason: str                    # "index", "rendezvous" or "replicate"
    pull_from: str = ""            # with "replicate": the holder the member pulls from
    scores: Dict[str, float] = field(default_factory=dict)


class HotPrefixes:
    """Counts routings per (prefix, holder) in a sliding window, bounded in entries."""

    def __init__(self, config: RoutingConfig, clock=time.monotonic) -> None:
        self._cfg, self._clock = config, clock
        self._hits: "collections.OrderedDict[tuple, collections.deque]" = \
            collections.OrderedDict()

    def record(self, prefix_hash: bytes, holder: str) -> int:
        """Counts one routing; returns the routings in the window, this one included."""
        now = self._clock()
        key = (bytes(prefix_hash), holder)
        q = self._hits.pop(key, None) or collections.deque()
        q.append(now)
        while q and q[0] <= now - self._cfg.window_s:
            q.popleft()
        self._hits[key] = q
        while len(self._hits) > self._cfg.max_tracked_prefixes:
            self._hits.popitem(last=False)
        return len(q)

    def reset(self, prefix_hash: bytes, holder: str) -> None:
        self._hits.pop((bytes(prefix_hash), holder), None)


def decide(hashes: Sequence[bytes], holders: Sequence[Mapping[str, str]],
           members: Sequence[str], loads: Mapping[str, Optional[Load]], page_size: int,
           config: RoutingConfig, hot: Optional[HotPrefixes] = None,
           exclude: Sequence[str] = ()) -> Decision:
    """The routing decision for a prompt whose full pages hash to ``hashes`` (``holders``:
    the index's answer per page), over ``members`` (minus ``exclude``). A prompt without a
    full page is routed by rendezvous on the empty hash."""
    live = sorted(set(members) - set(exclude))
    if not live:
        raise LookupError("no live cluster member to route to")
    n = len(live)
    lv = {m: load_value(loads.get(m), page_size, n, config.beta) for m in live}
    runs = {m: r for m, r in consecutive_prefixes(holders).items() if m in lv}
    first = hashes[0] if hashes else b""
    if runs:
        scores = {m: score(runs.get(m, 0), page_size, lv[m], config.alpha) for m in live}
        best = max(live, key=lambda m: (scores[m], runs.get(m, 0), -lv[m], m))
        if runs.get(best, 0) > 0:
            d = Decision(best, runs[best], "index", scores=scores)
            if hot is not None and config.replicate_after > 0 and n > 1:
                prefix = hashes[runs[best] - 1]
                mean = sum(lv.values()) / n
                if hot.record(prefix, best) > config.replicate_after and lv[best] > mean:
                    others = [m for m in bounded_members(lv, config.bound) if m != best]
                    others = others or [m for m in live if m != best]
                    second = rendezvous(first, others)
                    if runs.get(second, 0) < runs[best]:
                        hot.reset(prefix, best)
                        return Decision(second, runs.get(second, 0), "replicate",
                                        pull_from=best, scores=scores)
            return d
    return Decision(rendezvous(first, bounded_members(lv, config.bound)), 0, "rendezvous")
