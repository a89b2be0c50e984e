"""A session on a cluster (docs/cluster.md "Routing"): a sequence opened on the member the
router chose, with open/append/decode/commit/fork/close. When its member answers
``UNAVAILABLE`` the session re-opens on another member (routed again, the failed member
excluded) and re-prefills what that member lacks, then retries the call once.

Re-prefilling needs the K/V of the session's tokens: the session keeps the arrays it was
given (``retain=True``, the default) or asks ``prefill(start, end) -> (k, v)`` for rows
``[start, end)`` (e.g. a model that recomputes them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Protocol, Tuple

import numpy as np

from .. import _core as C
from ..errors import Unavailable

if TYPE_CHECKING:  # pragma: no cover
    from ..client import Client, Sequence
    from .routing import Decision

__all__ = ["ClusterSession", "Prefill", "Router"]

Prefill = Callable[[int, int], Tuple[Any, Any]]


class Router(Protocol):
    """What a session asks of the cluster it lives on (ClusterClient provides it): where to
    open, a member's client, replication of a hot prefix, and a member's loss."""

    def route(self, model: str, tokens: Any, *, cache_salt: str = "",
              exclude: Tuple[str, ...] = ()) -> "Decision": ...

    def replicate(self, d: "Decision", model: str, tokens: Any, cache_salt: str) -> str: ...

    def client(self, member_id: str) -> "Client": ...

    def mark_down(self, member_id: str) -> None: ...


class ClusterSession:
    """Create with :meth:`ClusterClient.open`. ``member_id`` is where the sequence lives
    now; ``failovers`` and ``reprefilled_tokens`` count what a lost member cost."""

    def __init__(self, cluster: Router, model: str, cache_salt: str,
                 tokens: List[int], prefill: Optional[Prefill], lease_ms: int) -> None:
        self.cluster = cluster
        self.model = model
        self.cache_salt = cache_salt
        self.tokens: List[int] = list(tokens)
        self.lease_ms = lease_ms
        self.member_id = ""
        self.sequence: Optional["Sequence"] = None
        self.failovers = 0
        self.reprefilled_tokens = 0
        self.decision = None
        self._prefill = prefill
        self._kv: List[Tuple[np.ndarray, np.ndarray]] = []
        self._reprefill_count = 0
        self.closed = False

    # -- K/V the session can re-send ------------------------------------------------------

    def _retain(self, k: Any, v: Any) -> None:
        if self._prefill is None and k is not None:
            self._kv.append((np.asarray(k), np.asarray(v)))

    def _rows(self, start: int, end: int) -> Tuple[Any, Any]:
        if self._prefill is not None:
            return self._prefill(start, end)
        if not self._kv:
            raise ValueError("the session has no K/V to re-prefill (open it with k/v or a "
                             "prefill callable)")
        k = np.concatenate([c[0] for c in self._kv], axis=1)
        v = np.concatenate([c[1] for c in self._kv], axis=1)
        return k[:, start:end], v[:, start:end]

    # -- opening ----------------------------------------------------------------------------

    def _open(self, k: Any, v: Any, exclude: Tuple[str, ...] = ()) -> None:
        d = self.cluster.route(self.model, self.tokens, cache_salt=self.cache_salt,
                               exclude=exclude)
        member = d.member_id
        if d.reason == "replicate":
            member = self.cluster.replicate(d, self.model, self.tokens, self.cache_salt)
        client = self.cluster.client(member)
        self.decision = d
        if k is None and self.tokens:
            m = client.match(self.model, self.tokens, cache_salt=self.cache_salt).matched_tokens
            k, v = self._rows(0, len(self.tokens)) if m < len(self.tokens) else (None, None)
        self.sequence = client.open_sequence(self.model, self.tokens, k=k, v=v,
                                             cache_salt=self.cache_salt,
                                             lease_ms=self.lease_ms)
        self.member_id = member
        self._reprefill_count = len(self.tokens) - self.sequence.matched_tokens

    def _failover(self) -> None:
        lost = self.member_id
        self.cluster.mark_down(lost)
        old = self.sequence
        if old is not None:
            old.stop_renewing()
        self.failovers += 1
        self._open(None, None, exclude=(lost,))
        self.reprefilled_tokens += self._reprefill_count

    def _run(self, op: Callable[[], Any]) -> Any:
        if self.closed:
            raise ValueError("the session is closed")
        try:
            return op()
        except Unavailable:
            self._failover()
            return op()

    # -- the session API --------------------------------------------------------------------

    def append(self, tokens, k: Any, v: Any) -> int:
        toks = C.tokens_list(tokens)
        n = self._run(lambda: self.sequence.append(toks, k, v))
        self.tokens.extend(toks)
        self._retain(k, v)
        return n

    def attention_decode(self, layer: int, q: Any, **kwargs: Any):
        """Attention of ``q`` over the session's tokens on its member. New tokens go through
        :meth:`append` (so that the session can re-send them after a failover)."""
        if {"k_new", "v_new", "new_tokens", "x_new"} & set(kwargs):
            raise ValueError("a cluster session appends new tokens with append(), not "
                             "through attention_decode's k_new/v_new")
        return self._run(lambda: self.sequence.attention_decode(layer, q, **kwargs))

    def commit(self):
        return self._run(lambda: self.sequence.commit())

    def fork(self) -> "ClusterSession":
        """A second session on the same member sharing this one's tokens (ForkSequence)."""
        seq = self._run(lambda: self.sequence.fork(lease_ms=self.lease_ms))
        twin = ClusterSession(self.cluster, self.model, self.cache_salt, self.tokens,
                              self._prefill, self.lease_ms)
        twin._kv = list(self._kv)
        twin.member_id, twin.sequence, twin.decision = self.member_id, seq, self.decision
        return twin

    def close(self, *, commit: bool = False) -> int:
        if self.closed:
            return len(self.tokens)
        try:
            if commit:  # the pages must land somewhere: re-open elsewhere if need be
                return self._run(lambda: self.sequence.close(commit=True, missing_ok=True))
            try:
                return self.sequence.close(missing_ok=True)
            except Unavailable:  # nothing to keep: the member is gone, so is the sequence
                self.cluster.mark_down(self.member_id)
                self.sequence.stop_renewing()
                return len(self.tokens)
        finally:
            self.closed = True

    def __enter__(self) -> "ClusterSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
