"""The one definition of the client API: every public method of :class:`kvcd.Client`,
:class:`kvcd.Sequence` and :class:`kvcd.DecodeSession` and of their asyncio twins in
:mod:`kvcd.aio`, with its signature and its documentation.

Both clients declare their classes with :func:`implements`, which checks at import time that
each public method has exactly the parameters written here (names, kinds, defaults and
annotations) and gives it the docstring written here. A method added to one client and not
the other, or a keyword that one client takes and the other does not, fails the import of
``kvcd`` — the sync and async clients cannot drift apart.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence as Seq, Type, Union

from ._core import (CommitResult, DecodeResult, FetchedPages, MatchResult, PinResult, PutResult,
                    TokenSeq)
from .v1 import kvcache_pb2 as pb

SequenceLike = Union["Sequence", int]

# Methods a class may have beyond its spec (none today): name -> why.
_EXTRA: Dict[str, str] = {}


def _public(cls: type) -> Dict[str, Callable[..., Any]]:
    return {n: f for n, f in vars(cls).items()
            if not n.startswith("_") and inspect.isfunction(f)}


def _params(fn: Callable[..., Any]) -> List[tuple]:
    return [(p.name, p.kind, p.default, p.annotation)
            for p in inspect.signature(fn).parameters.values()]


def implements(spec: type) -> Callable[[type], type]:
    """Class decorator: the class's public methods are exactly ``spec``'s, with the same
    parameters; each takes ``spec``'s docstring. Raises TypeError at import otherwise."""

    def check(cls: type) -> type:
        want, have = _public(spec), _public(cls)
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want) - set(_EXTRA))
        if missing or extra:
            raise TypeError(f"{cls.__module__}.{cls.__qualname__} does not match "
                            f"{spec.__qualname__}: missing {missing}, not in the spec {extra}")
        for name, fn in want.items():
            if _params(have[name]) != _params(fn):
                raise TypeError(
                    f"{cls.__module__}.{cls.__qualname__}.{name}{inspect.signature(have[name])}"
                    f" differs from the spec {name}{inspect.signature(fn)}")
            have[name].__doc__ = fn.__doc__
        return cls

    return check


def spec_methods(spec: Type[Any]) -> List[str]:
    """The public method names of a spec class (for tests)."""
    return sorted(_public(spec))


class ClientAPI:
    """The public methods of ``Client`` (sync) and ``kvcd.aio.Client`` (async)."""

    def close(self) -> None:
        """Closes the channel (open sequences keep their leases until they run out)."""

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Waits for the channel to connect; raises :class:`kvcd.Unavailable` after
        ``timeout`` s (the message says whether the daemon answered plaintext or TLS)."""

    def register_model(self, profile: Optional[pb.ModelProfile] = None, *,
                       codec_blob: bytes = b"", tenant: str = "",
                       **fields: Any) -> pb.ModelInfo:
        """Registers a model profile (idempotent for an identical profile).

        Give a ``ModelProfile`` message and/or its fields as keywords, e.g.
        ``register_model(name="m", num_layers=2, num_q_heads=4, num_kv_heads=2,
        head_dim=16, page_size=4, sink_tokens=4, recent_tokens=8, history_format="bf16",
        memory_bytes=1 << 20)``. ``codec_blob``: a codec file (safetensors rotations).
        ``tenant``: the tenant the registration counts against (its ``max_models`` /
        ``max_model_bytes`` quotas; with auth on, the token must grant it). "" = default.

        Raises: InvalidArgument (bad field), AlreadyExists (name taken by another profile),
        ResourceExhausted (the tenant's registration quota or the memory budget).
        """

    def list_models(self) -> List[pb.ModelInfo]:
        """All registered models with their pools, codec and cache figures."""

    def get_model(self, name: str) -> pb.ModelInfo:
        """The registered model ``name``; raises NotFound if absent."""

    def profile(self, name: str) -> pb.ModelProfile:
        """The (cached) profile of model ``name``, used to check shapes before sending."""

    def put(self, model: str, tokens: TokenSeq, k: Any, v: Any, *, cache_salt: str = "",
            kv_first_token: int = 0, wire_dtype: Optional[str] = None,
            x: Any = None) -> PutResult:
        """Caches the K/V of a prompt (prefill -> kvcd).

        ``k``/``v``: ``[num_layers, len(tokens) - kv_first_token, num_kv_heads, head_dim]``
        (numpy or torch, F32 or BF16; ``wire_dtype="bf16"`` halves the bytes sent). Shapes
        are checked against the model before anything is sent. A payload over
        ``max_message_bytes`` is split into page-aligned chunks sent in order with
        ``kv_first_token`` (each chunk's prefix is cached by the one before).

        FSQ models (``history_format`` FSQ) also need ``x``: the attention blocks'
        normalized residuals of the same tokens, ``[num_layers, n, fsq_residual_width]``;
        the daemon stores their 4-bit codes as the history. Other models must not get ``x``.

        Only full pages are stored: a trailing partial page is ignored by the daemon and
        reported in ``PutResult.ignored_tokens``. Idempotent on cached prefixes.
        """

    def match(self, model: str, tokens: TokenSeq, *, cache_salt: str = "") -> MatchResult:
        """The longest cached page-aligned prefix of ``tokens`` (nothing is pinned), and how
        many of its tokens came from committed sequences (``committed_tokens``)."""

    def pin_prefix(self, model: str, tokens: TokenSeq, *, ttl_ms: int,
                   cache_salt: str = "") -> PinResult:
        """Pins the longest cached page-aligned prefix of ``tokens`` for ``ttl_ms`` ms, so
        that eviction skips it until :meth:`unpin_prefix` or the ttl runs out (then it is an
        ordinary LRU prefix again). Its pages count against the tenant's
        ``max_pinned_prefix_pages``, per pin. Pins do not survive a daemon restart.

        Raises: InvalidArgument (``ttl_ms`` not in 1..the daemon's ``max_pin_ttl_ms``),
        NotFound (unknown model, or not one page of ``tokens`` cached), ResourceExhausted
        (the tenant's ``max_pinned_prefix_pages`` quota).
        """

    def unpin_prefix(self, pin_id: int) -> int:
        """Removes a pin made by :meth:`pin_prefix`; returns the pages it pinned. Raises
        NotFound for a pin that is not live (unpinned, expired, or another tenant's)."""

    def open_sequence(self, model: str, tokens: TokenSeq, *, k: Any = None, v: Any = None,
                      cache_salt: str = "", lease_ms: int = 0, auto_renew: bool = True,
                      wire_dtype: Optional[str] = None, x: Any = None) -> "Sequence":
        """Opens a decode sequence on the longest cached prefix of ``tokens``.

        The daemon keeps only the matched (page-aligned, cached) tokens: the sequence holds
        ``matched_tokens`` tokens and ``tokens[matched_tokens:]`` must be appended. Give
        ``k``/``v`` of the whole prompt (``[num_layers, len(tokens), num_kv_heads,
        head_dim]``) and this method appends the missing rows itself; otherwise they are
        listed in ``Sequence.pending_tokens``.

        Use it as a context manager: the sequence is closed on exit, also on an exception.
        With ``auto_renew`` a background thread renews the lease every third of it.
        """

    def append(self, sequence: SequenceLike, tokens: TokenSeq, k: Any, v: Any, *,
               wire_dtype: Optional[str] = None, x: Any = None) -> int:
        """Appends new tokens' K/V (``[num_layers, n, num_kv_heads, head_dim]``) for all
        layers, with their residuals ``x`` (``[num_layers, n, fsq_residual_width]``) for FSQ
        models; split under the message limit if needed. Returns the new length."""

    def renew_lease(self, sequence: SequenceLike, lease_ms: int = 0) -> int:
        """Renews a sequence's lease (0 = the lease granted at open); returns it in ms."""

    def close_sequence(self, sequence: SequenceLike, *, commit: bool = False) -> int:
        """Closes a sequence (unpins its prefix, frees private pages); returns its length.

        With ``commit`` its full pages first enter the prefix cache as
        :meth:`commit_sequence` does (for a :class:`Sequence` handle the
        :class:`kvcd.CommitResult` is kept in its ``last_commit``); a commit that fails
        raises and leaves the sequence open."""

    def commit_sequence(self, sequence: SequenceLike) -> CommitResult:
        """Puts the sequence's full pages into the prefix cache under its model and tenant,
        keyed by the tokens it holds; the sequence stays open (docs/sessions.md). A later
        ``open_sequence`` on those tokens (plus a new message) reuses them.

        Raises: NotFound (not open, or another tenant's), FailedPrecondition (a per-layer
        token only partly appended: the message names the layers), ResourceExhausted
        (nothing changed)."""

    def fork_sequence(self, sequence: SequenceLike, *, lease_ms: int = 0) -> "Sequence":
        """A new sequence sharing every full page of ``sequence`` and a copy of its partial
        page, with its own lease (0 = the daemon's default), counted against the tenant's
        quotas like ``open_sequence``. Its lease is renewed in the background when the
        source is a :class:`Sequence` whose lease is. Each then appends independently.

        Raises: NotFound, FailedPrecondition (a partly appended token), InvalidArgument
        (lease_ms), ResourceExhausted (a quota or the pool; nothing changed)."""

    def attention_decode(self, layer: int, sequences: Union[SequenceLike, Seq[SequenceLike]],
                         q: Any, *, k_new: Any = None, v_new: Any = None,
                         new_tokens: Optional[TokenSeq] = None, softmax_scale: float = 0.0,
                         o_out: Optional[pb.TensorRef] = None,
                         lse_out: Optional[pb.TensorRef] = None,
                         wire_dtype: Optional[str] = None, x_new: Any = None) -> DecodeResult:
        """Attention of one layer for a batch of B sequences over everything they hold.

        ``q``: ``[B, num_q_heads, head_dim]`` raw post-RoPE queries. With ``k_new``/``v_new``
        (``[B, num_kv_heads, head_dim]``) and ``new_tokens`` (B ids) each sequence first
        receives one token at this layer (fused append; the token is committed once every
        layer has it); FSQ models also need ``x_new`` (``[B, fsq_residual_width]``, the
        token's residual at this layer). ``softmax_scale`` 0 means ``1/sqrt(head_dim)``. Returns ``(o, lse)``
        (see :class:`kvcd.DecodeResult`). ``o_out``/``lse_out``: cuda_ipc regions the daemon
        writes instead (CUDA backend).
        """

    def decode_session(self) -> "DecodeSession":
        """A bidirectional ``AttentionDecodeStream`` for the per-layer decode loop."""

    def fetch_pages(self, sequence: SequenceLike, *, first_token: int = 0, num_tokens: int = 0,
                    expand_to_bf16: bool = False, as_torch: bool = False,
                    destination: Optional[pb.TensorRef] = None,
                    model: Optional[str] = None) -> FetchedPages:
        """A sequence's pages: as stored (``pages``; INT2 stays INT2, decode them with
        :meth:`FetchedPages.decode` or :mod:`kvcd.pages`) or, with ``expand_to_bf16``, its
        K/V as BF16 in the model's original space (``k``/``v``). ``first_token`` must be
        page-aligned; ``num_tokens`` 0 means to the end. ``destination``: a cuda_ipc region
        or nccl slot receiving the stored pages (CUDA backend)."""

    def push_pages(self, model: str, tokens: TokenSeq,
                   pages: Union[FetchedPages, Seq[pb.StoredPage], None] = None, *,
                   first_page: Optional[int] = None, cache_salt: str = "",
                   device_pages: Optional[pb.TensorRef] = None, num_pages: int = 0) -> int:
        """Stores pages already in the model's storage format (e.g. another daemon's or
        tenant's ``fetch_pages``) for ``tokens``, without re-encoding. ``first_page``
        defaults to the first page's position; the prefix before it must be cached. A
        trailing partial page is left out (only full pages are stored, as with ``put``).
        Returns the tokens newly inserted."""

    def pull_prefix(self, model: str, tokens: TokenSeq, peer_member_id: str, *,
                    cache_salt: str = "") -> pb.PullPrefixResponse:
        """Cluster (docs/cluster.md): makes this daemon pull from the member
        ``peer_member_id`` the pages of the longest prefix of ``tokens`` the peer holds
        beyond its own, as stored (the peer's address comes from membership). Returns the
        tokens held before, pulled, and the bytes received."""

    def stats(self) -> pb.StatsResponse:
        """Memory, pools, hit/miss tokens, evictions, sequences, backend and version; the
        caller's tenants' prefix pins (``pins``)."""

    def health(self, service: str = "") -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... ("" = the whole server)."""

    def watch_health(self, service: str = "") -> Iterator[str]:
        """grpc.health.v1 Watch: yields the serving status on every change."""

    def register_buffer(self, ipc_handle: bytes, size: int, ready_event_handle: bytes, *,
                        lease_ms: int = 0, name: str = "") -> pb.RegisterBufferResponse:
        """Low level: maps a device allocation into the daemon (see kvcd.cuda)."""

    def unregister_buffer(self, buffer_id: int) -> None:
        """Low level: unmaps a buffer registered with :meth:`register_buffer`."""

    def renew_buffer(self, buffer_id: int, lease_ms: int = 0) -> int:
        """Renews a registered buffer's lease (0 = the lease granted at registration); returns it in ms."""

    def nccl_connect(self, name: str = "", timeout_ms: int = 0) -> pb.NcclConnectResponse:
        """Low level: the daemon's side of a 2-rank NCCL communicator (CUDA backend)."""

    def nccl_disconnect(self, communicator_id: int) -> None:
        """Low level: tears down a communicator made by :meth:`nccl_connect`."""

    def open_decode_channel(self, shm_name: str, lease_ms: int = 0
                            ) -> pb.OpenDecodeChannelResponse:
        """Low level: the RPC behind the C++ shared-memory DecodeChannel (the shared-memory
        protocol itself is not implemented in Python)."""

    def close_decode_channel(self, channel_id: int) -> None:
        """Low level: closes a decode channel opened by :meth:`open_decode_channel`."""


class SequenceAPI:
    """The public methods of ``Sequence`` (sync) and ``kvcd.aio.Sequence`` (async)."""

    def append(self, tokens: TokenSeq, k: Any, v: Any, *,
               wire_dtype: Optional[str] = None, x: Any = None) -> int:
        """Appends tokens' K/V; tokens listed in ``pending_tokens`` are removed from it."""

    def attention_decode(self, layer: int, q: Any, **kwargs: Any) -> DecodeResult:
        """:meth:`Client.attention_decode` for this sequence alone (B = 1)."""

    def fetch_pages(self, **kwargs: Any) -> FetchedPages:
        """See :meth:`Client.fetch_pages` (for this sequence)."""

    def renew(self, lease_ms: int = 0) -> int:
        """Renews this sequence's lease (0 = the lease granted at open); returns it in ms."""

    def start_renewing(self, interval: Optional[float] = None) -> None:
        """Renews the lease every ``interval`` s (default: a third of the lease).

        The thread holds only a weak reference: a Sequence dropped without ``close`` stops
        being renewed, and the daemon closes it when its lease runs out."""

    def wait_renewals(self, n: int, timeout: float) -> bool:
        """Blocks until the background thread has renewed ``n`` times (True) or timeout."""

    def stop_renewing(self) -> None:
        """Stops the background renewal (a no-op when none runs)."""

    def commit(self) -> CommitResult:
        """:meth:`Client.commit_sequence` of this sequence (it stays open): an agent loop
        checkpoints a turn and keeps decoding."""

    def fork(self, *, lease_ms: int = 0) -> "Sequence":
        """:meth:`Client.fork_sequence` of this sequence."""

    def close(self, *, missing_ok: bool = False, commit: bool = False) -> int:
        """Stops renewal and closes the sequence; returns its final length (-1 if it was
        already gone and ``missing_ok``). With ``commit`` its full pages enter the prefix
        cache first (``last_commit`` holds the :class:`kvcd.CommitResult`)."""


class DecodeSessionAPI:
    """The public methods of ``DecodeSession`` (sync) and ``kvcd.aio.DecodeSession`` (async)."""

    def attend(self, layer: int, sequences: Union[SequenceLike, Seq[SequenceLike]], q: Any, *,
               k_new: Any = None, v_new: Any = None, new_tokens: Optional[TokenSeq] = None,
               softmax_scale: float = 0.0, o_out: Optional[pb.TensorRef] = None,
               lse_out: Optional[pb.TensorRef] = None,
               wire_dtype: Optional[str] = None, x_new: Any = None) -> DecodeResult:
        """Same arguments and result as :meth:`Client.attention_decode`."""

    def close(self) -> None:
        """Half-closes the stream and waits for the daemon to finish it."""

    def cancel(self) -> None:
        """Abandons the stream at once."""
