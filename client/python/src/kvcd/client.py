"""The blocking client: :class:`Client`, :class:`Sequence` and :class:`DecodeSession`."""
from __future__ import annotations

import itertools
import queue
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence as Seq, Tuple, Union

import grpc

from . import _api, _core as C
from ._api import implements
from ._core import (CommitResult, DecodeResult, FetchedPages, MatchResult, PinResult, PutResult,
                    TLS,
                    TokenSeq)
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


@implements(_api.ClientAPI)
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
        self._secure = creds is not None
        self._closed = False
        if wait_ready is not None:
            try:
                self.wait_ready(wait_ready)
            except KvcdError:
                self.close()
                raise

    def wait_ready(self, timeout: float = 10.0) -> None:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise error_from_status(
                grpc.StatusCode.UNAVAILABLE,
                C.unreachable_message(self.target, self._secure, timeout)) from None

    # -- plumbing ---------------------------------------------------------------------

    def _call(self, method: str, request, timeout: Optional[float] = None):
        if self._closed:
            raise C.closed_error(self.target)
        try:
            return getattr(self._stub, method)(
                request, timeout=self.timeout if timeout is None else timeout,
                metadata=self._metadata)
        except grpc.RpcError as e:
            raise _from_rpc_error(e) from None

    def close(self) -> None:
        self._closed = True
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- models -----------------------------------------------------------------------

    def register_model(self, profile: Optional[pb.ModelProfile] = None, *,
                       codec_blob: bytes = b"", tenant: str = "",
                       **fields: Any) -> pb.ModelInfo:
        req = pb.RegisterModelRequest(profile=C.make_profile(profile, fields),
                                      codec_blob=codec_blob, tenant=tenant)
        info = self._call("RegisterModel", req).model
        with self._lock:
            self._profiles[info.profile.name] = info.profile
        return info

    def list_models(self) -> List[pb.ModelInfo]:
        models = list(self._call("ListModels", pb.ListModelsRequest()).models)
        with self._lock:
            for m in models:
                self._profiles[m.profile.name] = m.profile
        return models

    def get_model(self, name: str) -> pb.ModelInfo:
        for m in self.list_models():
            if m.profile.name == name:
                return m
        raise NotFound(f"model '{name}' is not registered", code=grpc.StatusCode.NOT_FOUND)

    def profile(self, name: str) -> pb.ModelProfile:
        with self._lock:
            p = self._profiles.get(name)
        return p if p is not None else self.get_model(name).profile

    # -- prefix cache -----------------------------------------------------------------

    def put(self, model: str, tokens: TokenSeq, k: Any, v: Any, *, cache_salt: str = "",
            kv_first_token: int = 0, wire_dtype: Optional[str] = None,
            x: Any = None) -> PutResult:
        p = self.profile(model)
        toks = C.tokens_list(tokens)
        reqs = C.put_requests(p, model, toks, k, v, cache_salt, kv_first_token, wire_dtype,
                              self.max_message_bytes, x)
        result = C.put_result(len(toks), [self._call("Put", r) for r in reqs])
        C.log_ignored(model, result)
        return result

    def match(self, model: str, tokens: TokenSeq, *, cache_salt: str = "") -> MatchResult:
        r = self._call("Match", pb.MatchRequest(model=model, cache_salt=cache_salt,
                                                tokens=C.tokens_list(tokens)))
        return MatchResult(int(r.matched_tokens), int(r.matched_pages), int(r.committed_tokens))

    def pin_prefix(self, model: str, tokens: TokenSeq, *, ttl_ms: int,
                   cache_salt: str = "") -> PinResult:
        return C.pin_result(self._call("PinPrefix", pb.PinPrefixRequest(
            model=model, cache_salt=cache_salt, tokens=C.tokens_list(tokens),
            ttl_ms=int(ttl_ms))))

    def unpin_prefix(self, pin_id: int) -> int:
        return int(self._call("UnpinPrefix", pb.UnpinPrefixRequest(pin_id=int(pin_id)))
                   .unpinned_pages)

    # -- sequences --------------------------------------------------------------------

    def open_sequence(self, model: str, tokens: TokenSeq, *, k: Any = None, v: Any = None,
                      cache_salt: str = "", lease_ms: int = 0, auto_renew: bool = True,
                      wire_dtype: Optional[str] = None, x: Any = None) -> "Sequence":
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
        toks = C.tokens_list(tokens)
        p = (self.profile(sequence.model)
             if isinstance(sequence, Sequence) and sequence.model else None)
        length = 0
        for r in C.append_requests(p, _seq_id(sequence), toks, k, v, wire_dtype,
                                   self.max_message_bytes, x):
            length = int(self._call("Append", r).length)
        if isinstance(sequence, Sequence):
            sequence.length = length
        return length

    def renew_lease(self, sequence: SequenceLike, lease_ms: int = 0) -> int:
        return int(self._call("RenewLease", pb.RenewLeaseRequest(
            sequence_id=_seq_id(sequence), lease_ms=int(lease_ms))).lease_ms)

    def close_sequence(self, sequence: SequenceLike, *, commit: bool = False) -> int:
        r = self._call("CloseSequence", pb.CloseSequenceRequest(
            sequence_id=_seq_id(sequence), commit=bool(commit)))
        if commit and isinstance(sequence, Sequence):
            sequence.last_commit = CommitResult.of(r.commit)
        return int(r.length)

    def commit_sequence(self, sequence: SequenceLike) -> CommitResult:
        r = self._call("CommitSequence",
                            pb.CommitSequenceRequest(sequence_id=_seq_id(sequence)))
        result = CommitResult.of(r)
        if isinstance(sequence, Sequence):
            sequence.last_commit = result
        return result

    def fork_sequence(self, sequence: SequenceLike, *, lease_ms: int = 0) -> "Sequence":
        r = self._call("ForkSequence", pb.ForkSequenceRequest(
            sequence_id=_seq_id(sequence), lease_ms=int(lease_ms)))
        source = sequence if isinstance(sequence, Sequence) else None
        fork = Sequence(self, source.model if source is not None else "", int(r.sequence_id),
                        int(r.length), int(r.lease_ms), [])
        if source is not None and source.renewing:
            fork.start_renewing()
        return fork

    # -- attention --------------------------------------------------------------------

    def _decode_profile(self, sequences: Seq[SequenceLike]) -> Optional[pb.ModelProfile]:
        models = {s.model for s in sequences if isinstance(s, Sequence)}
        if len(models) == 1 and all(isinstance(s, Sequence) for s in sequences) and all(models):
            return self.profile(models.pop())
        return None

    def attention_decode(self, layer: int, sequences: Union[SequenceLike, Seq[SequenceLike]],
                         q: Any, *, k_new: Any = None, v_new: Any = None,
                         new_tokens: Optional[TokenSeq] = None, softmax_scale: float = 0.0,
                         o_out: Optional[pb.TensorRef] = None,
                         lse_out: Optional[pb.TensorRef] = None,
                         wire_dtype: Optional[str] = None, x_new: Any = None) -> DecodeResult:
        seqs = _seq_list(sequences)
        req = C.decode_request(self._decode_profile(seqs), layer, [_seq_id(s) for s in seqs],
                               q, k_new, v_new, new_tokens, softmax_scale, o_out, lse_out,
                               wire_dtype, next(self._request_ids), x_new)
        return _track(seqs, C.decode_result(self._call("AttentionDecode", req), q))

    def decode_session(self) -> "DecodeSession":
        if self._closed:
            raise C.closed_error(self.target)
        return DecodeSession(self)

    # -- pages ------------------------------------------------------------------------

    def fetch_pages(self, sequence: SequenceLike, *, first_token: int = 0, num_tokens: int = 0,
                    expand_to_bf16: bool = False, as_torch: bool = False,
                    destination: Optional[pb.TensorRef] = None,
                    model: Optional[str] = None) -> FetchedPages:
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
        p = self.profile(model)
        req = C.push_request(p, model, C.tokens_list(tokens), pages or [], first_page,
                             cache_salt, device_pages, num_pages)
        return int(self._call("PushPages", req).inserted_tokens)

    def pull_prefix(self, model: str, tokens: TokenSeq, peer_member_id: str, *,
                    cache_salt: str = "") -> pb.PullPrefixResponse:
        return self._call("PullPrefix", pb.PullPrefixRequest(
            model=model, cache_salt=cache_salt, tokens=C.tokens_list(tokens),
            peer_member_id=peer_member_id))

    # -- stats, health ------------------------------------------------------------------

    def stats(self) -> pb.StatsResponse:
        return self._call("Stats", pb.StatsRequest())

    def health(self, service: str = "") -> str:
        if self._closed:
            raise C.closed_error(self.target)
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
        if self._closed:
            raise C.closed_error(self.target)
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
        return self._call("RegisterBuffer", pb.RegisterBufferRequest(
            ipc_handle=ipc_handle, size=int(size), ready_event_handle=ready_event_handle,
            lease_ms=int(lease_ms), name=name))

    def unregister_buffer(self, buffer_id: int) -> None:
        self._call("UnregisterBuffer", pb.UnregisterBufferRequest(buffer_id=int(buffer_id)))

    def renew_buffer(self, buffer_id: int, lease_ms: int = 0) -> int:
        return int(self._call("RenewBuffer", pb.RenewBufferRequest(
            buffer_id=int(buffer_id), lease_ms=int(lease_ms))).lease_ms)

    def nccl_connect(self, name: str = "", timeout_ms: int = 0) -> pb.NcclConnectResponse:
        return self._call("NcclConnect", pb.NcclConnectRequest(name=name,
                                                               timeout_ms=int(timeout_ms)))

    def nccl_disconnect(self, communicator_id: int) -> None:
        self._call("NcclDisconnect", pb.NcclDisconnectRequest(
            communicator_id=int(communicator_id)))

    def open_decode_channel(self, shm_name: str, lease_ms: int = 0
                            ) -> pb.OpenDecodeChannelResponse:
        return self._call("OpenDecodeChannel", pb.OpenDecodeChannelRequest(
            shm_name=shm_name, lease_ms=int(lease_ms)))

    def close_decode_channel(self, channel_id: int) -> None:
        self._call("CloseDecodeChannel", pb.CloseDecodeChannelRequest(channel_id=int(channel_id)))


@implements(_api.SequenceAPI)
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
        self.last_commit: Optional[CommitResult] = None
        self._stop = threading.Event()
        self._renewed = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    @property
    def renewing(self) -> bool:
        """Whether the lease is renewed in the background."""
        return self._thread is not None

    def __repr__(self) -> str:
        return f"<kvcd.Sequence {self.id} model={self.model} length={self.length}>"

    def append(self, tokens: TokenSeq, k: Any, v: Any, *,
               wire_dtype: Optional[str] = None, x: Any = None) -> int:
        toks = C.tokens_list(tokens)
        length = self.client.append(self, toks, k, v, wire_dtype=wire_dtype, x=x)
        if self.pending_tokens and toks[:len(self.pending_tokens)] == self.pending_tokens[:len(toks)]:
            self.pending_tokens = self.pending_tokens[len(toks):]
        return length

    def attention_decode(self, layer: int, q: Any, **kwargs: Any) -> DecodeResult:
        return self.client.attention_decode(layer, [self], q, **kwargs)

    def fetch_pages(self, **kwargs: Any) -> FetchedPages:
        return self.client.fetch_pages(self, **kwargs)

    def renew(self, lease_ms: int = 0) -> int:
        self.lease_ms = self.client.renew_lease(self, lease_ms)
        return self.lease_ms

    # -- background renewal -----------------------------------------------------------

    def start_renewing(self, interval: Optional[float] = None) -> None:
        if self._thread is not None:
            return
        period = interval if interval is not None else max(self.lease_ms, 30) / 3000.0
        self._thread = threading.Thread(
            target=_renew_loop, args=(weakref.ref(self), self._stop, period),
            name=f"kvcd-renew-{self.id}", daemon=True)
        self._thread.start()

    def wait_renewals(self, n: int, timeout: float) -> bool:
        with self._renewed:
            return self._renewed.wait_for(lambda: self.renewals >= n, timeout)

    def stop_renewing(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def commit(self) -> CommitResult:
        return self.client.commit_sequence(self)

    def fork(self, *, lease_ms: int = 0) -> "Sequence":
        return self.client.fork_sequence(self, lease_ms=lease_ms)

    def close(self, *, missing_ok: bool = False, commit: bool = False) -> int:
        if self.closed:
            self.stop_renewing()
            return self.length
        if commit:  # a commit that fails leaves the sequence open (and renewed)
            try:
                self.length = self.client.close_sequence(self, commit=True)
            except NotFound:
                self.stop_renewing()
                self.closed = True
                if not missing_ok:
                    raise
                return -1
            self.stop_renewing()
            self.closed = True
            return self.length
        self.stop_renewing()
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


@implements(_api.DecodeSessionAPI)
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
        self._closed = True
        self._responses.cancel()

    def __enter__(self) -> "DecodeSession":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.cancel()
