"""asyncio twin of :mod:`kvcd.client`: the same API with ``await``.

    async with kvcd.aio.Client(target) as c:
        await c.put("tiny", tokens, k, v)
        async with await c.open_sequence("tiny", tokens, k=k, v=v) as seq:
            async with c.decode_session() as s:
                o, lse = await s.attend(0, seq, q, k_new=k1, v_new=v1, new_tokens=[t])

Arguments, results and exceptions are those of :class:`kvcd.Client`. A Client can serve
many concurrent tasks; each task uses its own :class:`DecodeSession`. Lease renewal of a
:class:`Sequence` runs as an asyncio task.
"""
from __future__ import annotations

import asyncio
import itertools
import weakref
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence as Seq, Tuple, Union

import grpc
import grpc.aio

from . import _api, _core as C
from ._api import implements
from ._core import (CommitResult, DecodeResult, FetchedPages, MatchResult, PinResult, PutResult,
                    TLS, TokenSeq)
from ._health import health_pb2
from .errors import KvcdError, NotFound, _from_rpc_error, error_from_status
from .pages import PageGeometry
from .v1 import kvcache_pb2 as pb
from .v1 import kvcache_pb2_grpc as pb_grpc

__all__ = ["Client", "Sequence", "DecodeSession"]

SequenceLike = Union["Sequence", int]
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # end of a stream's reads


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
    """asyncio client; same constructor arguments as :class:`kvcd.Client`, except that
    connecting happens on the first call or on ``await client.wait_ready()``."""

    def __init__(self, target: str = "127.0.0.1:50051", *,
                 tls: Union[None, bool, TLS, grpc.ChannelCredentials] = None,
                 token: Optional[str] = None, timeout: Optional[float] = 30.0,
                 max_message_bytes: int = C.DEFAULT_MAX_MESSAGE_BYTES,
                 options: Optional[Seq[Tuple[str, Any]]] = None) -> None:
        creds, opts, self._metadata = C.channel_setup(target, tls, token, max_message_bytes,
                                                      options)
        self.target = target
        self.timeout = timeout
        self.max_message_bytes = int(max_message_bytes)
        self.channel_options = opts
        self._channel = (grpc.aio.secure_channel(target, creds, options=opts)
                         if creds is not None else grpc.aio.insecure_channel(target, options=opts))
        self._stub = pb_grpc.KvCacheStub(self._channel)
        self._profiles: Dict[str, pb.ModelProfile] = {}
        self._request_ids = itertools.count(1)
        self._secure = creds is not None
        self._closed = False

    async def _call(self, method: str, request, timeout: Optional[float] = None):
        if self._closed:
            raise C.closed_error(self.target)
        try:
            return await getattr(self._stub, method)(
                request, timeout=self.timeout if timeout is None else timeout,
                metadata=self._metadata)
        except grpc.RpcError as e:
            raise _from_rpc_error(e) from None

    async def wait_ready(self, timeout: float = 10.0) -> None:
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            message = await asyncio.get_running_loop().run_in_executor(
                None, C.unreachable_message, self.target, self._secure, timeout)
            raise error_from_status(grpc.StatusCode.UNAVAILABLE, message) from None

    async def close(self) -> None:
        self._closed = True
        await self._channel.close(None)

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- models -----------------------------------------------------------------------

    async def register_model(self, profile: Optional[pb.ModelProfile] = None, *,
                             codec_blob: bytes = b"", tenant: str = "",
                             **fields: Any) -> pb.ModelInfo:
        req = pb.RegisterModelRequest(profile=C.make_profile(profile, fields),
                                      codec_blob=codec_blob, tenant=tenant)
        info = (await self._call("RegisterModel", req)).model
        self._profiles[info.profile.name] = info.profile
        return info

    async def list_models(self) -> List[pb.ModelInfo]:
        models = list((await self._call("ListModels", pb.ListModelsRequest())).models)
        for m in models:
            self._profiles[m.profile.name] = m.profile
        return models

    async def get_model(self, name: str) -> pb.ModelInfo:
        for m in await self.list_models():
            if m.profile.name == name:
                return m
        raise NotFound(f"model '{name}' is not registered", code=grpc.StatusCode.NOT_FOUND)

    async def profile(self, name: str) -> pb.ModelProfile:
        p = self._profiles.get(name)
        return p if p is not None else (await self.get_model(name)).profile

    # -- prefix cache -----------------------------------------------------------------

    async def put(self, model: str, tokens: TokenSeq, k: Any, v: Any, *, cache_salt: str = "",
                  kv_first_token: int = 0, wire_dtype: Optional[str] = None,
                  x: Any = None) -> PutResult:
        p = await self.profile(model)
        toks = C.tokens_list(tokens)
        reqs = C.put_requests(p, model, toks, k, v, cache_salt, kv_first_token, wire_dtype,
                              self.max_message_bytes, x)
        responses = []
        for r in reqs:
            responses.append(await self._call("Put", r))
        result = C.put_result(len(toks), responses)
        C.log_ignored(model, result)
        return result

    async def match(self, model: str, tokens: TokenSeq, *, cache_salt: str = "") -> MatchResult:
        r = await self._call("Match", pb.MatchRequest(model=model, cache_salt=cache_salt,
                                                      tokens=C.tokens_list(tokens)))
        return MatchResult(int(r.matched_tokens), int(r.matched_pages), int(r.committed_tokens))

    async def pin_prefix(self, model: str, tokens: TokenSeq, *, ttl_ms: int,
                         cache_salt: str = "") -> PinResult:
        return C.pin_result(await self._call("PinPrefix", pb.PinPrefixRequest(
            model=model, cache_salt=cache_salt, tokens=C.tokens_list(tokens),
            ttl_ms=int(ttl_ms))))

    async def unpin_prefix(self, pin_id: int) -> int:
        r = await self._call("UnpinPrefix", pb.UnpinPrefixRequest(pin_id=int(pin_id)))
        return int(r.unpinned_pages)

    # -- sequences --------------------------------------------------------------------

    async def open_sequence(self, model: str, tokens: TokenSeq, *, k: Any = None,
                            v: Any = None, cache_salt: str = "", lease_ms: int = 0,
                            auto_renew: bool = True,
                            wire_dtype: Optional[str] = None, x: Any = None) -> "Sequence":
        toks = C.tokens_list(tokens)
        p = await self.profile(model)
        if k is not None or v is not None:
            C.T.check_shape("k", k, C.kv_shape(p, len(toks)))
            C.T.check_shape("v", v, C.kv_shape(p, len(toks)))
        r = await self._call("OpenSequence", pb.OpenSequenceRequest(
            model=model, cache_salt=cache_salt, tokens=toks, lease_ms=int(lease_ms)))
        seq = Sequence(self, model, int(r.sequence_id), int(r.matched_tokens), int(r.lease_ms),
                       toks[int(r.matched_tokens):])
        try:
            if k is not None and seq.pending_tokens:
                m = seq.matched_tokens
                await seq.append(seq.pending_tokens, C.slice_tokens(k, m, len(toks)),
                                 C.slice_tokens(v, m, len(toks)), wire_dtype=wire_dtype,
                                 x=None if x is None else C.slice_tokens(x, m, len(toks)))
        except BaseException:
            await seq.close(missing_ok=True)
            raise
        if auto_renew:
            seq.start_renewing()
        return seq

    async def append(self, sequence: SequenceLike, tokens: TokenSeq, k: Any, v: Any, *,
                     wire_dtype: Optional[str] = None, x: Any = None) -> int:
        toks = C.tokens_list(tokens)
        p = (await self.profile(sequence.model)
             if isinstance(sequence, Sequence) and sequence.model else None)
        length = 0
        for r in C.append_requests(p, _seq_id(sequence), toks, k, v, wire_dtype,
                                   self.max_message_bytes, x):
            length = int((await self._call("Append", r)).length)
        if isinstance(sequence, Sequence):
            sequence.length = length
        return length

    async def renew_lease(self, sequence: SequenceLike, lease_ms: int = 0) -> int:
        return int((await self._call("RenewLease", pb.RenewLeaseRequest(
            sequence_id=_seq_id(sequence), lease_ms=int(lease_ms)))).lease_ms)

    async def close_sequence(self, sequence: SequenceLike, *, commit: bool = False) -> int:
        r = await self._call("CloseSequence", pb.CloseSequenceRequest(
            sequence_id=_seq_id(sequence), commit=bool(commit)))
        if commit and isinstance(sequence, Sequence):
            sequence.last_commit = CommitResult.of(r.commit)
        return int(r.length)

    async def commit_sequence(self, sequence: SequenceLike) -> CommitResult:
        r = await self._call("CommitSequence",
                            pb.CommitSequenceRequest(sequence_id=_seq_id(sequence)))
        result = CommitResult.of(r)
        if isinstance(sequence, Sequence):
            sequence.last_commit = result
        return result

    async def fork_sequence(self, sequence: SequenceLike, *, lease_ms: int = 0) -> "Sequence":
        r = await self._call("ForkSequence", pb.ForkSequenceRequest(
            sequence_id=_seq_id(sequence), lease_ms=int(lease_ms)))
        source = sequence if isinstance(sequence, Sequence) else None
        fork = Sequence(self, source.model if source is not None else "", int(r.sequence_id),
                        int(r.length), int(r.lease_ms), [])
        if source is not None and source.renewing:
            fork.start_renewing()
        return fork

    # -- attention --------------------------------------------------------------------

    async def _decode_profile(self, seqs: Seq[SequenceLike]) -> Optional[pb.ModelProfile]:
        models = {s.model for s in seqs if isinstance(s, Sequence)}
        if len(models) == 1 and all(isinstance(s, Sequence) for s in seqs) and all(models):
            return await self.profile(models.pop())
        return None

    async def attention_decode(self, layer: int,
                               sequences: Union[SequenceLike, Seq[SequenceLike]], q: Any, *,
                               k_new: Any = None, v_new: Any = None,
                               new_tokens: Optional[TokenSeq] = None,
                               softmax_scale: float = 0.0,
                               o_out: Optional[pb.TensorRef] = None,
                               lse_out: Optional[pb.TensorRef] = None,
                               wire_dtype: Optional[str] = None,
                               x_new: Any = None) -> DecodeResult:
        seqs = _seq_list(sequences)
        req = C.decode_request(await self._decode_profile(seqs), layer,
                               [_seq_id(s) for s in seqs], q, k_new, v_new, new_tokens,
                               softmax_scale, o_out, lse_out, wire_dtype,
                               next(self._request_ids), x_new)
        return _track(seqs, C.decode_result(await self._call("AttentionDecode", req), q))

    def decode_session(self) -> "DecodeSession":
        if self._closed:
            raise C.closed_error(self.target)
        return DecodeSession(self)

    # -- pages ------------------------------------------------------------------------

    async def fetch_pages(self, sequence: SequenceLike, *, first_token: int = 0,
                          num_tokens: int = 0, expand_to_bf16: bool = False,
                          as_torch: bool = False, destination: Optional[pb.TensorRef] = None,
                          model: Optional[str] = None) -> FetchedPages:
        req = pb.FetchPagesRequest(sequence_id=_seq_id(sequence), first_token=int(first_token),
                                   num_tokens=int(num_tokens), expand_to_bf16=expand_to_bf16)
        if destination is not None:
            req.destination.CopyFrom(destination)
        name = sequence.model if isinstance(sequence, Sequence) else model
        geometry = PageGeometry.of(await self.profile(name)) if name else None
        return C.fetched(await self._call("FetchPages", req), expand_to_bf16, as_torch,
                         geometry)

    async def push_pages(self, model: str, tokens: TokenSeq,
                         pages: Union[FetchedPages, Seq[pb.StoredPage], None] = None, *,
                         first_page: Optional[int] = None, cache_salt: str = "",
                         device_pages: Optional[pb.TensorRef] = None,
                         num_pages: int = 0) -> int:
        p = await self.profile(model)
        req = C.push_request(p, model, C.tokens_list(tokens), pages or [], first_page,
                             cache_salt, device_pages, num_pages)
        return int((await self._call("PushPages", req)).inserted_tokens)

    async def pull_prefix(self, model: str, tokens: TokenSeq, peer_member_id: str, *,
                          cache_salt: str = "") -> pb.PullPrefixResponse:
        return await self._call("PullPrefix", pb.PullPrefixRequest(
            model=model, cache_salt=cache_salt, tokens=C.tokens_list(tokens),
            peer_member_id=peer_member_id))

    # -- stats, health ------------------------------------------------------------------

    async def stats(self) -> pb.StatsResponse:
        return await self._call("Stats", pb.StatsRequest())

    async def health(self, service: str = "") -> str:
        if self._closed:
            raise C.closed_error(self.target)
        check = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)
        try:
            r = await check(health_pb2.HealthCheckRequest(service=service),
                            timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _from_rpc_error(e) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    async def watch_health(self, service: str = "") -> AsyncIterator[str]:
        if self._closed:
            raise C.closed_error(self.target)
        watch = self._channel.unary_stream(
            "/grpc.health.v1.Health/Watch",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)
        call = watch(health_pb2.HealthCheckRequest(service=service), metadata=self._metadata)
        try:
            async for r in call:
                yield health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
        except grpc.RpcError as e:
            raise _from_rpc_error(e) from None
        finally:
            call.cancel()

    # -- data plane (CUDA backend) ------------------------------------------------------

    async def register_buffer(self, ipc_handle: bytes, size: int, ready_event_handle: bytes, *,
                              lease_ms: int = 0, name: str = "") -> pb.RegisterBufferResponse:
        return await self._call("RegisterBuffer", pb.RegisterBufferRequest(
            ipc_handle=ipc_handle, size=int(size), ready_event_handle=ready_event_handle,
            lease_ms=int(lease_ms), name=name))

    async def unregister_buffer(self, buffer_id: int) -> None:
        await self._call("UnregisterBuffer", pb.UnregisterBufferRequest(buffer_id=int(buffer_id)))

    async def renew_buffer(self, buffer_id: int, lease_ms: int = 0) -> int:
        return int((await self._call("RenewBuffer", pb.RenewBufferRequest(
            buffer_id=int(buffer_id), lease_ms=int(lease_ms)))).lease_ms)

    async def nccl_connect(self, name: str = "", timeout_ms: int = 0) -> pb.NcclConnectResponse:
        return await self._call("NcclConnect", pb.NcclConnectRequest(
            name=name, timeout_ms=int(timeout_ms)))

    async def nccl_disconnect(self, communicator_id: int) -> None:
        await self._call("NcclDisconnect", pb.NcclDisconnectRequest(
            communicator_id=int(communicator_id)))

    async def open_decode_channel(self, shm_name: str, lease_ms: int = 0
                                  ) -> pb.OpenDecodeChannelResponse:
        return await self._call("OpenDecodeChannel", pb.OpenDecodeChannelRequest(
            shm_name=shm_name, lease_ms=int(lease_ms)))

    async def close_decode_channel(self, channel_id: int) -> None:
        await self._call("CloseDecodeChannel",
                         pb.CloseDecodeChannelRequest(channel_id=int(channel_id)))


@implements(_api.SequenceAPI)
class Sequence:
    """asyncio twin of :class:`kvcd.Sequence` (``async with``; renewal is a task)."""

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
        self._task: Optional[asyncio.Task] = None
        self._renewed = asyncio.Condition()

    @property
    def renewing(self) -> bool:
        """Whether the lease is renewed in the background."""
        return self._task is not None

    def __repr__(self) -> str:
        return f"<kvcd.aio.Sequence {self.id} model={self.model} length={self.length}>"

    async def append(self, tokens: TokenSeq, k: Any, v: Any, *,
                     wire_dtype: Optional[str] = None, x: Any = None) -> int:
        toks = C.tokens_list(tokens)
        length = await self.client.append(self, toks, k, v, wire_dtype=wire_dtype, x=x)
        if self.pending_tokens and toks[:len(self.pending_tokens)] == self.pending_tokens[:len(toks)]:
            self.pending_tokens = self.pending_tokens[len(toks):]
        return length

    async def attention_decode(self, layer: int, q: Any, **kwargs: Any) -> DecodeResult:
        return await self.client.attention_decode(layer, [self], q, **kwargs)

    async def fetch_pages(self, **kwargs: Any) -> FetchedPages:
        return await self.client.fetch_pages(self, **kwargs)

    async def renew(self, lease_ms: int = 0) -> int:
        self.lease_ms = await self.client.renew_lease(self, lease_ms)
        return self.lease_ms

    def start_renewing(self, interval: Optional[float] = None) -> None:
        if self._task is not None:
            return
        period = interval if interval is not None else max(self.lease_ms, 30) / 3000.0
        self._task = asyncio.get_running_loop().create_task(
            _renew_loop(weakref.ref(self), period))

    async def wait_renewals(self, n: int, timeout: float) -> bool:
        try:
            async with self._renewed:
                await asyncio.wait_for(self._renewed.wait_for(lambda: self.renewals >= n),
                                       timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def stop_renewing(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    async def commit(self) -> CommitResult:
        return await self.client.commit_sequence(self)

    async def fork(self, *, lease_ms: int = 0) -> "Sequence":
        return await self.client.fork_sequence(self, lease_ms=lease_ms)

    async def close(self, *, missing_ok: bool = False, commit: bool = False) -> int:
        if self.closed:
            await self.stop_renewing()
            return self.length
        if commit:  # a commit that fails leaves the sequence open (and renewed)
            try:
                self.length = await self.client.close_sequence(self, commit=True)
            except NotFound:
                await self.stop_renewing()
                self.closed = True
                if not missing_ok:
                    raise
                return -1
            await self.stop_renewing()
            self.closed = True
            return self.length
        await self.stop_renewing()
        self.closed = True
        try:
            self.length = await self.client.close_sequence(self)
        except NotFound:
            if not missing_ok:
                raise
            return -1
        return self.length

    async def __aenter__(self) -> "Sequence":
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self.close(missing_ok=exc_type is not None)


async def _renew_loop(ref: "weakref.ref[Sequence]", period: float) -> None:
    while True:
        await asyncio.sleep(period)  # the renewal period itself, not a synchronization
        seq = ref()
        if seq is None:
            return
        try:
            await seq.client.renew_lease(seq)
        except Exception as e:  # NotFound (expired, closed elsewhere), closed channel, ...
            seq.renew_error = e if isinstance(e, KvcdError) else error_from_status(
                grpc.StatusCode.UNKNOWN, f"lease renewal stopped: {e!r}")
            return
        async with seq._renewed:
            seq.renewals += 1
            seq._renewed.notify_all()
        del seq


@implements(_api.DecodeSessionAPI)
class DecodeSession:
    """asyncio twin of :class:`kvcd.DecodeSession` (one per task)."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._call = client._stub.AttentionDecodeStream(metadata=client._metadata)
        self._ids = itertools.count(1)
        self._closed = False

    async def attend(self, layer: int, sequences: Union[SequenceLike, Seq[SequenceLike]],
                     q: Any, *, k_new: Any = None, v_new: Any = None,
                     new_tokens: Optional[TokenSeq] = None, softmax_scale: float = 0.0,
                     o_out: Optional[pb.TensorRef] = None,
                     lse_out: Optional[pb.TensorRef] = None,
                     wire_dtype: Optional[str] = None, x_new: Any = None) -> DecodeResult:
        if self._closed:
            raise ValueError("the decode session is closed")
        seqs = _seq_list(sequences)
        req = C.decode_request(await self._client._decode_profile(seqs), layer,
                               [_seq_id(s) for s in seqs], q, k_new, v_new, new_tokens,
                               softmax_scale, o_out, lse_out, wire_dtype, next(self._ids), x_new)
        try:
            await self._call.write(req)
            r = await self._call.read()
        except grpc.RpcError as e:
            raise _from_rpc_error(e) from None
        if r is _EOF:
            raise error_from_status(grpc.StatusCode.UNAVAILABLE, "the decode stream ended")
        if r.error_code != 0:
            raise error_from_status(r.error_code, r.error_message)
        return _track(seqs, C.decode_result(r.response, q))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._call.done_writing()
            while await self._call.read() is not _EOF:
                pass
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:  # type: ignore[attr-defined]
                raise _from_rpc_error(e) from None

    def cancel(self) -> None:
        self._closed = True
        self._call.cancel()

    async def __aenter__(self) -> "DecodeSession":
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            await self.close()
        else:
            self.cancel()
