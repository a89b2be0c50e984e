"""The blocking client: :class:`Client`, :class:`Sequence` and :class:`DecodeSession`."""
from __future__ import annotations

import itertools
import queue
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence as Seq, Tuple, Union

import grpc

from . import _core as C
from ._core import (DecodeResult, FetchedPages, MatchResult, PutResult, TLS, TokenSeq)
from .errors import KvcdError, NotFound, _from_rpc_error, error_from_status
from .pages import PageGeometry
from .v1 import kvcache_pb2 as pb
from .v1 import kvcache_pb2_grpc as pb_grpc
from ._health import health_pb2

__all__ = ["Client", "Sequence", "DecodeSession"]

SequenceLike = Union["Sequence", int]
_HEALTH_CHECK = "/grpc.health.v1.Health/Check"
_HEALTH_WATCH = "/grpc.health.v1.Health/Watch"


def _seq_id(s: SequenceLike) -> int:
    return int(s.id) if isinstance(s, Sequence) else int(s)


def _track(seqs: List[SequenceLike], result: DecodeResult) -> DecodeResult:
    """Keeps Sequence.length current: the tokens attended include fused appends."""
    for s, n in zip(seqs, result.lengths):
        if isinstance(s, Sequence):
            s.length = n
    return result


def _seq_list(sequences: Union[SequenceLike, Seq[SequenceLike]]) -> List[SequenceLike]:
    if isinstance(sequences, (Sequence, int)):
        return [sequences]
    return list(sequences)


class Client:
    """A blocking client of one kvcd daemon.

    Args:
        target: ``host:port`` of the daemon (its ready line's ``grpc=``).
        tls: ``None`` for plaintext (the daemon's default on loopback), ``True`` for TLS
            with gRPC's default roots, a :class:`kvcd.TLS` (CA, optional client cert and key
            for mTLS, server-name override), or ready ``grpc.ChannelCredentials``.
        token: bearer token, sent as ``authorization: Bearer <token>`` metadata on every
            call (unset: no metadata, as a daemon without auth expects).
        timeout: deadline of every unary call, in seconds (``None``: no deadline). Decode
            streams have no deadline.
        max_message_bytes: gRPC send/receive limit, and the size under which ``put`` and
            ``append`` split their requests; keep it <= the daemon's ``max_message_bytes``
            (256 MiB by default).
        options: extra gRPC channel options (override the defaults).
        wait_ready: seconds to wait for the channel to connect (``None``: do not wait; the
            first call connects). A daemon that is not reachable in time raises
            :class:`kvcd.Unavailable`.

    Thread safety: a Client may be shared by threads; a :class:`DecodeSession` may not.
    Every method raises a :class:`kvcd.KvcdError` subclass on a non-OK status and
    ``ValueError``/``TypeError`` for arguments caught before sending.
    """

    def __init__(self, target: str = "127.0.0.1:50051", *,
                 tls: Union[None, bool, TLS, grpc.ChannelCredentials] = None,
                 token: Optional[str] = None, timeout: Optional[float] = 30.0,
                 max_message_bytes: int = C.DEFAULT_MAX_MESSAGE_BYTES,
                 options: Optional[Seq[Tuple[str, Any]]] = None,
                 wait_ready: Optional[float] = 10.0) -> None:
        creds, opts, self._metadata = C.channel_setup(target, tls, token, max_message_bytes,
                                                      options)
        self.target = target
        self.timeout = timeout
        self.max_message_bytes = int(max_message_bytes)
        self.channel_options = opts
        self._channel = (grpc.secure_channel(target, creds, options=opts) if creds is not None
                         else grpc.insecure_channel(target, options=opts))
        self._stub = pb_grpc.KvCacheStub(self._channel)
        self._profiles: Dict[str, pb.ModelProfile] = {}
        self._lock = threading.Lock()
        self._request_ids = itertools.count(1)
        if wait_ready is not None:
            try:
                grpc.channel_ready_future(self._channel).result(timeout=wait_ready)
            except grpc.FutureTimeoutError:
                self._channel.close()
                raise error_from_status(grpc.StatusCode.UNAVAILABLE,
                                        f"kvcd at {target} not reachable within {wait_ready} s")\
                    from None

    # -- plumbing ---------------------------------------------------------------------

    def _call(self, method: str, request, timeout: Optional[float] = None):
        try:
            return getattr(self._stub, method)(
                request, timeout=self.timeout if timeout is None else timeout,
                metadata=self._metadata)
        except grpc.RpcError as e:
            raise _from_rpc_error(e) from None

    def close(self) -> None:
        """Closes the channel (open sequences keep their leases until they run out)."""
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- models -----------------------------------------------------------------------

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
        req = pb.RegisterModelRequest(profile=C.make_profile(profile, fields),
                                      codec_blob=codec_blob, tenant=tenant)
        info = self._call("RegisterModel", req).model
        with self._lock:
            self._profiles[info.profile.name] = info.profile
        return info

    def list_models(self) -> List[pb.ModelInfo]:
        """All registered models with their pools, codec and cache figures."""
        models = list(self._call("ListModels", pb.ListModelsRequest()).models)
        with self._lock:
            for m in models:
                self._profiles[m.profile.name] = m.profile
        return models

    def get_model(self, name: str) -> pb.ModelInfo:
        """The registered model ``name``; raises NotFound if absent."""
        for m in self.list_models():
            if m.profile.name == name:
                return m
        raise NotFound(f"model '{name}' is not registered", code=grpc.StatusCode.NOT_FOUND)

    def profile(self, name: str) -> pb.ModelProfile:
        """The (cached) profile of model ``name``, used to check shapes before sending."""
        with self._lock:
            p = self._profiles.get(name)
        return p if p is not None else self.get_model(name).profile

    # -- prefix cache -----------------------------------------------------------------

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
        p = self.profile(model)
        toks = C.tokens_list(tokens)
        reqs = C.put_requests(p, model, toks, k, v, cache_salt, kv_first_token, wire_dtype,
                              self.max_message_bytes, x)
        result = C.put_result(len(toks), [self._call("Put", r) for r in reqs])
        C.log_ignored(model, result)
        return result

    def match(self, model: str, tokens: TokenSeq, *, cache_salt: str = "") -> MatchResult:
        """The longest cached page-aligned prefix of ``tokens`` (nothing is pinned)."""
        r = self._call("Match", pb.MatchRequest(model=model, cache_salt=cache_salt,
                                                tokens=C.tokens_list(tokens)))
        return MatchResult(int(r.matched_tokens), int(r.matched_pages))

    # -- sequences --------------------------------------------------------------------

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
        toks = C.tokens_list(tokens)
        p = self.profile(model)
        if k is not None or v is not None:
            C.T.check_shape("k", k, C.kv_shape(p, len(toks)))
            C.T.check_shape("v", v, C.kv_shape(p, len(toks)))
        r = self._call("OpenSequence", pb.OpenSequenceRequest(
            model=model, cache_salt=cache_salt, tokens=toks, lease_ms=int(lease_ms)))
        seq = Sequence(self, model, int(r.sequence_id), int(r.matched_tokens), int(r.lease_ms),
                       toks[int(r.matched_tokens):])
        try:
            if k is not None and seq.pending_tokens:
                m = seq.matched_tokens
                seq.append(seq.pending_tokens, C.slice_tokens(k, m, len(toks)),
                           C.slice_tokens(v, m, len(toks)), wire_dtype=wire_dtype,
                           x=None if x is None else C.slice_tokens(x, m, len(toks)))
        except BaseException:
            seq.close(missing_ok=True)
            raise
        if auto_renew:
            seq.start_renewing()
        return seq

    def append(self, sequence: SequenceLike, tokens: TokenSeq, k: Any, v: Any, *,
               wire_dtype: Optional[str] = None, x: Any = None) -> int:
        """Appends new tokens' K/V (``[num_layers, n, num_kv_heads, head_dim]``) for all
        layers, with their residuals ``x`` (``[num_layers, n, fsq_residual_width]``) for FSQ
        models; split under the message limit if needed. Returns the new length."""
        toks = C.tokens_list(tokens)
        p = self.profile(sequence.model) if isinstance(sequence, Sequence) else None
        length = 0
        for r in C.append_requests(p, _seq_id(sequence), toks, k, v, wire_dtype,
                                   self.max_message_bytes, x):
            length = int(self._call("Append", r).length)
        if isinstance(sequence, Sequence):
            sequence.length = length
        return length

    def renew_lease(self, sequence: SequenceLike, lease_ms: int = 0) -> int:
        """Renews a sequence's lease (0 = the lease granted at open); returns it in ms."""
        return int(self._call("RenewLease", pb.RenewLeaseRequest(
            sequence_id=_seq_id(sequence), lease_ms=int(lease_ms))).lease_ms)

    def close_sequence(self, sequence: SequenceLike) -> int:
        """Closes a sequence (unpins its prefix, frees private pages); returns its length."""
        return int(self._call("CloseSequence",
                              pb.CloseSequenceRequest(sequence_id=_seq_id(sequence))).length)

    # -- attention --------------------------------------------------------------------

    def _decode_profile(self, sequences: Seq[SequenceLike]) -> Optional[pb.ModelProfile]:
        models = {s.model for s in sequences if isinstance(s, Sequence)}
        if len(models) == 1 and all(isinstance(s, Sequence) for s in sequences):
            return self.profile(models.pop())
        return None

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
        seqs = _seq_list(sequences)
        req = C.decode_request(self._decode_profile(seqs), layer, [_seq_id(s) for s in seqs],
                               q, k_new, v_new, new_tokens, softmax_scale, o_out, lse_out,
                               wire_dtype, next(self._request_ids), x_new)
        return _track(seqs, C.decode_result(self._call("AttentionDecode", req), q))

    def decode_session(self) -> "DecodeSession":
        """A bidirectional ``AttentionDecodeStream`` for the per-layer decode loop."""
        return DecodeSession(self)

    # -- pages ------------------------------------------------------------------------

    def fetch_pages(self, sequence: SequenceLike, *, first_token: int = 0, num_tokens: int = 0,
                    expand_to_bf16: bool = False, as_torch: bool = False,
                    destination: Optional[pb.TensorRef] = None,
                    model: Optional[str] = None) -> FetchedPages:
        """A sequence's pages: as stored (``pages``; INT2 stays INT2, decode them with
        :meth:`FetchedPages.decode` or :mod:`kvcd.pages`) or, with ``expand_to_bf16``, its
        K/V as BF16 in the model's original space (``k``/``v``). ``first_token`` must be
        page-aligned; ``num_tokens`` 0 means to the end. ``destination``: a cuda_ipc region
        or nccl slot receiving the stored pages (CUDA backend)."""
        req = pb.FetchPagesRequest(sequence_id=_seq_id(sequence), first_token=int(first_token),
                                   num_tokens=int(num_tokens), expand_to_bf16=expand_to_bf16)
        if destination is not None:
            req.destination.CopyFrom(destination)
        name = sequence.model if isinstance(sequence, Sequence) else model
        geometry = PageGeometry.of(self.profile(name)) if name else None
        return C.fetched(self._call("FetchPages", req), expand_to_bf16, as_torch, geometry)

    def push_pages(self, model: str, tokens: TokenSeq,
                   pages: Union[FetchedPages, Seq[pb.StoredPage], None] = None, *,
                   first_page: Optional[int] = None, cache_salt: str = "",
                   device_pages: Optional[pb.TensorRef] = None, num_pages: int = 0) -> int:
        """Stores pages already in the model's storage format (e.g. another daemon's or
        tenant's ``fetch_pages``) for ``tokens``, without re-encoding. ``first_page``
        defaults to the first page's position; the prefix before it must be cached. A
        trailing partial page is left out (only full pages are stored, as with ``put``).
        Returns the tokens newly inserted."""
        p = self.profile(model)
        req = C.push_request(p, model, C.tokens_list(tokens), pages or [], first_page,
                             cache_salt, device_pages, num_pages)
        return int(self._call("PushPages", req).inserted_tokens)

    # -- stats, health ------------------------------------------------------------------

    def stats(self) -> pb.StatsResponse:
        """Memory, pools, hit/miss tokens, evictions, sequences, backend and version."""
        return self._call("Stats", pb.StatsRequest())

    def health(self, service: str = "") -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... ("" = the whole server)."""
        check = self._channel.unary_unary(
            _HEALTH_CHECK, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)
        try:
            r = check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout,
                      metadata=self._metadata)
        except grpc.RpcError as e:
            raise _from_rpc_error(e) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def watch_health(self, service: str = "") -> Iterator[str]:
        """grpc.health.v1 Watch: yields the serving status on every change."""
        watch = self._channel.unary_stream(
            _HEALTH_WATCH, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)
        call = watch(health_pb2.HealthCheckRequest(service=service), metadata=self._metadata)
        try:
            for r in call:
                yield health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
        except grpc.RpcError as e:
            raise _from_rpc_error(e) from None
        finally:
            call.cancel()  # closing the generator ends the stream

    # -- data plane (CUDA backend) ------------------------------------------------------

    def register_buffer(self, ipc_handle: bytes, size: int, ready_event_handle: bytes, *,
                        lease_ms: int = 0, name: str = "") -> pb.RegisterBufferResponse:
        """Low level: maps a device allocation into the daemon (see kvcd.cuda)."""
        return self._call("RegisterBuffer", pb.RegisterBufferRequest(
            ipc_handle=ipc_handle, size=int(size), ready_event_handle=ready_event_handle,
            lease_ms=int(lease_ms), name=name))

    def unregister_buffer(self, buffer_id: int) -> None:
        self._call("UnregisterBuffer", pb.UnregisterBufferRequest(buffer_id=int(buffer_id)))

    def renew_buffer(self, buffer_id: int, lease_ms: int = 0) -> int:
        return int(self._call("RenewBuffer", pb.RenewBufferRequest(
            buffer_id=int(buffer_id), lease_ms=int(lease_ms))).lease_ms)

    def nccl_connect(self, name: str = "", timeout_ms: int = 0) -> pb.NcclConnectResponse:
        """Low level: the daemon's side of a 2-rank NCCL communicator (CUDA backend)."""
        return self._call("NcclConnect", pb.NcclConnectRequest(name=name,
                                                               timeout_ms=int(timeout_ms)))

    def nccl_disconnect(self, communicator_id: int) -> None:
        self._call("NcclDisconnect", pb.NcclDisconnectRequest(
            communicator_id=int(communicator_id)))

    def open_decode_channel(self, shm_name: str, lease_ms: int = 0
                            ) -> pb.OpenDecodeChannelResponse:
        """Low level: the RPC behind the C++ shared-memory DecodeChannel (the shared-memory
        protocol itself is not implemented in Python)."""
        return self._call("OpenDecodeChannel", pb.OpenDecodeChannelRequest(
            shm_name=shm_name, lease_ms=int(lease_ms)))

    def close_decode_channel(self, channel_id: int) -> None:
        self._call("CloseDecodeChannel", pb.CloseDecodeChannelRequest(channel_id=int(channel_id)))


class Sequence:
    """An open decode sequence (from :meth:`Client.open_sequence`).

    Attributes: ``id``, ``model``, ``matched_tokens`` (tokens served from the cache at
    open), ``lease_ms``, ``length`` (after the last append through this object),
    ``pending_tokens`` (prompt tokens not yet appended: the daemon keeps only the matched
    prefix), ``renewals`` (leases renewed by the background thread).
    """

    def __init__(self, client: Client, model: str, sequence_id: int, matched_tokens: int,
                 lease_ms: int, pending_tokens: List[int]) -> None:
        self.client = client
        self.model = model
        self.id = sequence_id
        self.matched_tokens = matched_tokens
        self.lease_ms = lease_ms
        self.length = matched_tokens
        self.pending_tokens = list(pending_tokens)
        self.renewals = 0
        self.closed = False
        self.renew_error: Optional[KvcdError] = None
        self._stop = threading.Event()
        self._renewed = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def __repr__(self) -> str:
        return f"<kvcd.Sequence {self.id} model={self.model} length={self.length}>"

    def append(self, tokens: TokenSeq, k: Any, v: Any, *,
               wire_dtype: Optional[str] = None, x: Any = None) -> int:
        """Appends tokens' K/V; tokens listed in ``pending_tokens`` are removed from it."""
        toks = C.tokens_list(tokens)
        length = self.client.append(self, toks, k, v, wire_dtype=wire_dtype, x=x)
        if self.pending_tokens and toks[:len(self.pending_tokens)] == self.pending_tokens[:len(toks)]:
            self.pending_tokens = self.pending_tokens[len(toks):]
        return length

    def attention_decode(self, layer: int, q: Any, **kwargs: Any) -> DecodeResult:
        """:meth:`Client.attention_decode` for this sequence alone (B = 1)."""
        return self.client.attention_decode(layer, [self], q, **kwargs)

    def fetch_pages(self, **kwargs: Any) -> FetchedPages:
        return self.client.fetch_pages(self, **kwargs)

    def renew(self, lease_ms: int = 0) -> int:
        self.lease_ms = self.client.renew_lease(self, lease_ms)
        return self.lease_ms

    # -- background renewal -----------------------------------------------------------

    def start_renewing(self, interval: Optional[float] = None) -> None:
        """Renews the lease every ``interval`` s (default: a third of the lease).

        The thread holds only a weak reference: a Sequence dropped without ``close`` stops
        being renewed, and the daemon closes it when its lease runs out."""
        if self._thread is not None:
            return
        period = interval if interval is not None else max(self.lease_ms, 30) / 3000.0
        self._thread = threading.Thread(
            target=_renew_loop, args=(weakref.ref(self), self._stop, period),
            name=f"kvcd-renew-{self.id}", daemon=True)
        self._thread.start()

    def wait_renewals(self, n: int, timeout: float) -> bool:
        """Blocks until the background thread has renewed ``n`` times (True) or timeout."""
        with self._renewed:
            return self._renewed.wait_for(lambda: self.renewals >= n, timeout)

    def stop_renewing(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def close(self, *, missing_ok: bool = False) -> int:
        """Stops renewal and closes the sequence; returns its final length (-1 if it was
        already gone and ``missing_ok``)."""
        self.stop_renewing()
        if self.closed:
            return self.length
        self.closed = True
        try:
            self.length = self.client.close_sequence(self)
        except NotFound:
            if not missing_ok:
                raise
            return -1
        return self.length

    def __enter__(self) -> "Sequence":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # On an exception the original error wins; a sequence already reaped is fine.
        self.close(missing_ok=exc_type is not None)


def _renew_loop(ref: "weakref.ref[Sequence]", stop: threading.Event, period: float) -> None:
    while not stop.wait(period):
        seq = ref()
        if seq is None:
            return
        try:
            seq.client.renew_lease(seq)
        except Exception as e:  # NotFound (expired, closed elsewhere), closed channel, ...
            seq.renew_error = e if isinstance(e, KvcdError) else error_from_status(
                grpc.StatusCode.UNKNOWN, f"lease renewal stopped: {e!r}")
            return
        with seq._renewed:
            seq.renewals += 1
            seq._renewed.notify_all()
        del seq


class DecodeSession:
    """One ``AttentionDecodeStream``: the per-layer decode loop of a worker.

    Each :meth:`attend` sends one request and waits for its answer (the daemon answers in
    order). A per-request error raises its :class:`kvcd.KvcdError` and the stream stays
    usable; a broken stream raises on the next call. Not thread-safe: one session per
    thread. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, client: Client) -> None:
        self._client = client
        self._requests: "queue.Queue[Optional[pb.AttentionDecodeRequest]]" = queue.Queue()
        self._ids = itertools.count(1)
        self._closed = False
        try:
            self._responses = client._stub.AttentionDecodeStream(
                self._request_iter(), metadata=client._metadata)
        except grpc.RpcError as e:  # pragma: no cover - stream creation is lazy
            raise _from_rpc_error(e) from None

    def _request_iter(self) -> Iterator[pb.AttentionDecodeRequest]:
        while True:
            r = self._requests.get()
            if r is None:
                return
            yield r

    def attend(self, layer: int, sequences: Union[SequenceLike, Seq[SequenceLike]], q: Any, *,
               k_new: Any = None, v_new: Any = None, new_tokens: Optional[TokenSeq] = None,
               softmax_scale: float = 0.0, o_out: Optional[pb.TensorRef] = None,
               lse_out: Optional[pb.TensorRef] = None,
               wire_dtype: Optional[str] = None, x_new: Any = None) -> DecodeResult:
        """Same arguments and result as :meth:`Client.attention_decode`."""
        if self._closed:
            raise ValueError("the decode session is closed")
        seqs = _seq_list(sequences)
        req = C.decode_request(self._client._decode_profile(seqs), layer,
                               [_seq_id(s) for s in seqs], q, k_new, v_new, new_tokens,
                               softmax_scale, o_out, lse_out, wire_dtype, next(self._ids), x_new)
        self._requests.put(req)
        try:
            r = next(self._responses)
        except StopIteration:
            raise error_from_status(grpc.StatusCode.UNAVAILABLE,
                                    "the decode stream ended") from None
        except grpc.RpcError as e:
            raise _from_rpc_error(e) from None
        if r.error_code != 0:
            raise error_from_status(r.error_code, r.error_message)
        return _track(seqs, C.decode_result(r.response, q))

    def close(self) -> None:
        """Half-closes the stream and waits for the daemon to finish it."""
        if self._closed:
            return
        self._closed = True
        self._requests.put(None)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:  # type: ignore[attr-defined]
                raise _from_rpc_error(e) from None

    def cancel(self) -> None:
        """Abandons the stream at once."""
        self._closed = True
        self._responses.cancel()

    def __enter__(self) -> "DecodeSession":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.cancel()
