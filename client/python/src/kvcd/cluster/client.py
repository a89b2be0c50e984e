"""ClusterClient: the cluster as one cache (docs/cluster.md). It hashes a prompt's pages,
asks the index who holds them, routes (kvcd.cluster.routing), opens sessions on the chosen
member (kvcd.cluster.session), replicates hot prefixes with PullPrefix, and computes
attention across members with the exact (output, LSE) merge.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Optional, Sequence as Seq, Set, Tuple

from .. import _core as C
from ..client import Client, Sequence
from ..errors import KvcdError, Unavailable
from ..v1 import kvcache_pb2 as pb
from .block_hash import block_hashes
from .index import BlockIndex
from .merge import merge_attention
from .routing import Decision, HotPrefixes, RoutingConfig, decide
from .session import ClusterSession, Prefill

__all__ = ["ClusterClient", "history_format_name"]

_COMPRESSED = ("int2-transform", "int2-oscar", "fsq")


def history_format_name(info: pb.ModelInfo) -> str:
    """The model's history format as block identity names it: the pool format of its
    history ("bf16" for an uncompressed model)."""
    hf = info.profile.history_format
    if hf in (pb.HISTORY_FORMAT_UNSPECIFIED, pb.HISTORY_FORMAT_BF16):
        return "bf16"
    for pool in info.pools:
        if pool.format in _COMPRESSED:
            return pool.format
    return "fsq" if hf == pb.HISTORY_FORMAT_FSQ else "int2-oscar"


def _index_unreachable(e: BaseException) -> bool:
    """Whether ``e`` says the index's Redis did not answer (connection refused, reset,
    timed out), as opposed to a bug or bad data."""
    if isinstance(e, (ConnectionError, TimeoutError, OSError)):
        return True
    try:
        import redis as redis_py  # the `cluster` extra
    except ImportError:  # pragma: no cover
        return False
    return isinstance(e, (redis_py.exceptions.ConnectionError, redis_py.exceptions.TimeoutError))


class ClusterClient:
    """Routes sessions over the members of ``membership`` (an EtcdMembership or
    DnsMembership) using ``index`` (a BlockIndex; ``None``: rendezvous only).

    ``client_options`` go to every member's :class:`kvcd.Client` (tls, token, timeout).
    Members that answered UNAVAILABLE are left out of routing until membership shows them
    with another incarnation (or, for ``down_s`` seconds, at all).
    """

    def __init__(self, membership, index: Optional[BlockIndex] = None, *,
                 config: RoutingConfig = RoutingConfig(), down_s: float = 30.0,
                 **client_options: Any) -> None:
        self.membership = membership
        self.index = index
        self.config = config
        self.hot = HotPrefixes(config)
        self._options = dict(client_options)
        self._options.setdefault("wait_ready", None)
        self._clients: Dict[str, Tuple[str, str, Client]] = {}
        self._formats: Dict[str, Tuple[str, int]] = {}
        self._down: Dict[Tuple[str, str], float] = {}
        self._down_s = down_s
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvcd-cluster")
        self.last_lookup_seconds = 0.0
        self.replications = 0
        self.replication_errors = 0
        # Lookups the index did not answer (Redis down or timing out): routed by
        # rendezvous and load-free scoring instead.
        self.index_errors = 0

    # -- members ------------------------------------------------------------------------

    def client(self, member_id: str) -> Client:
        """The client of a live member (one per member address and incarnation)."""
        m = self.membership.members().get(member_id)
        if m is None:
            raise LookupError(f"{member_id!r} is not a cluster member")
        with self._lock:
            cached = self._clients.get(member_id)
            if cached is not None and cached[:2] == (m.address, m.incarnation):
                return cached[2]
            c = Client(m.address, **self._options)
            self._clients[member_id] = (m.address, m.incarnation, c)
        if cached is not None:
            cached[2].close()
        return c

    def mark_down(self, member_id: str) -> None:
        m = self.membership.members().get(member_id)
        with self._lock:
            self._down[(member_id, m.incarnation if m else "")] = time.monotonic()

    def _live(self) -> Dict[str, Any]:
        members = self.membership.members()
        now = time.monotonic()
        with self._lock:
            self._down = {k: t for k, t in self._down.items() if now - t < self._down_s}
            down = {mid for (mid, inc) in self._down if mid in members and
                    members[mid].incarnation == inc}
        return {k: m for k, m in members.items() if k not in down}

    def _format(self, model: str) -> Tuple[str, int]:
        """(history format name, page_size) of ``model``, asked of a member once."""
        with self._lock:
            f = self._formats.get(model)
        if f is None:
            last: Optional[Exception] = None
            for member_id in sorted(self._live()):
                try:
                    info = self.client(member_id).get_model(model)
                    f = (history_format_name(info), int(info.profile.page_size))
                    break
                except KvcdError as e:
                    last = e
            if f is None:
                raise LookupError(f"model {model!r}: no live member answered ({last})")
            with self._lock:
                self._formats[model] = f
        return f

    # -- routing ------------------------------------------------------------------------

    def route(self, model: str, tokens, *, cache_salt: str = "",
              exclude: Seq[str] = ()) -> Decision:
        """Where a session on ``tokens`` goes (the index looked up, load weighed)."""
        fmt, page_size = self._format(model)
        toks = C.tokens_list(tokens)
        hashes = block_hashes(model, cache_salt, fmt, page_size, toks)
        members = self._live()
        t0 = time.perf_counter()
        holders: list = [{} for _ in hashes]
        loads: dict = {}
        if self.index is not None:
            try:
                holders = self.index.holders(hashes, members)
                loads = self.index.loads(members)
            except Exception as e:  # the index is a hint: route without it
                if not _index_unreachable(e):
                    raise
                holders, loads = [{} for _ in hashes], {}
                self.index_errors += 1
        self.last_lookup_seconds = time.perf_counter() - t0
        return decide(hashes, holders, list(members), loads, page_size, self.config,
                      self.hot, exclude)

    def replicate(self, d: Decision, model: str, tokens, cache_salt: str) -> str:
        """Asks ``d.member_id`` to pull the prefix from ``d.pull_from``; returns the member
        to open on (the holder when the pull failed)."""
        try:
            self.client(d.member_id).pull_prefix(model, tokens, d.pull_from,
                                                 cache_salt=cache_salt)
            self.replications += 1
            return d.member_id
        except KvcdError:
            self.replication_errors += 1
            return d.pull_from

    # -- sessions -----------------------------------------------------------------------

    def open(self, model: str, tokens, *, k: Any = None, v: Any = None, cache_salt: str = "",
             lease_ms: int = 0, prefill: Optional[Prefill] = None) -> ClusterSession:
        """Opens a session on the member routing picks (K/V of every token of ``tokens``, or
        ``prefill``, for what that member lacks)."""
        s = ClusterSession(self, model, cache_salt, C.tokens_list(tokens), prefill, lease_ms)
        s._retain(k, v)
        self._open_with_failover(s, k, v)
        return s

    def _open_with_failover(self, s: ClusterSession, k: Any, v: Any) -> None:
        tried: Set[str] = set()
        while True:
            try:
                s._open(k, v, exclude=tuple(tried))
                return
            except Unavailable:
                if s.decision is None:
                    raise
                tried.add(s.decision.member_id)
                self.mark_down(s.decision.member_id)
                if len(tried) >= len(self.membership.members()):
                    raise

    # -- attention across members ---------------------------------------------------------

    def attend_across(self, layer: int, q: Any, history: Sequence, session: Sequence, *,
                      softmax_scale: float = 0.0) -> Tuple[Any, Any]:
        """Attention of ``q`` over a history held by one member (``history``, a sequence
        opened on the shared prefix) and a session on another (``session``, the tokens
        after the prefix), each computed where it lives and merged exactly. No page moves."""
        fa = self._pool.submit(history.attention_decode, layer, q,
                               softmax_scale=softmax_scale)
        fb = self._pool.submit(session.attention_decode, layer, q,
                               softmax_scale=softmax_scale)
        (o_a, lse_a), (o_b, lse_b) = fa.result(), fb.result()
        return merge_attention(o_a, lse_a, o_b, lse_b)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            clients, self._clients = self._clients, {}
        for _, _, c in clients.values():
            c.close()

    def __enter__(self) -> "ClusterClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
