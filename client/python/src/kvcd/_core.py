"""Request builders, result types and channel setup shared by kvcd.Client and kvcd.aio.Client."""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
import ssl
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from . import tensors as T
from .errors import error_from_status
from .pages import PageGeometry, decode_page
from .v1 import kvcache_pb2 as pb

log = logging.getLogger("kvcd")

DEFAULT_MAX_MESSAGE_BYTES = 256 << 20  # the daemon's default max_message_bytes
_MESSAGE_OVERHEAD = 64 << 10           # headroom for the non-tensor fields of a request

PemSource = Union[bytes, str, "os.PathLike[str]"]
TokenSeq = Union[Sequence[int], np.ndarray]


# ----------------------------------------------------------------------------------------
# TLS and token
# ----------------------------------------------------------------------------------------

def _pem(src: Optional[PemSource], what: str) -> Optional[bytes]:
    if src is None:
        return None
    if isinstance(src, bytes):
        return src
    s = os.fspath(src)
    if s.lstrip().startswith("-----BEGIN"):
        return s.encode()
    try:
        return Path(s).read_bytes()
    except OSError as e:
        raise ValueError(f"{what}: cannot read '{s}': {e.strerror}") from None


@dataclass(frozen=True)
class TLS:
    """TLS (and mTLS) settings of a client.

    Each PEM source is bytes (the PEM itself), a PEM string, or a file path.

    Attributes:
        root_certificates: CA bundle that signed the daemon's certificate; ``None`` uses
            gRPC's default roots.
        client_certificate / client_key: the client's certificate chain and private key for
            mutual TLS (both or neither).
        server_name: overrides the name checked against the daemon's certificate (for a
            daemon reached by IP or through a tunnel); ``None`` checks the target's host.
    """
    root_certificates: Optional[PemSource] = None
    client_certificate: Optional[PemSource] = None
    client_key: Optional[PemSource] = None
    server_name: Optional[str] = None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert = _pem(self.client_certificate, "client_certificate")
        key = _pem(self.client_key, "client_key")
        if (cert is None) != (key is None):
            raise ValueError("mTLS needs both client_certificate and client_key")
        return grpc.ssl_channel_credentials(
            root_certificates=_pem(self.root_certificates, "root_certificates"),
            private_key=key, certificate_chain=cert)


def _is_loopback(target: str) -> bool:
    host = target.rsplit(":", 1)[0] if not target.startswith("unix:") else "localhost"
    host = host.split("///")[-1].strip("[]")
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def channel_setup(target: str, tls: Union[None, bool, TLS, grpc.ChannelCredentials],
                  token: Optional[str], max_message_bytes: int,
                  options: Optional[Sequence[Tuple[str, Any]]]):
    """(credentials or None, channel options, per-call metadata) for a client."""
    opts: Dict[str, Any] = {
        # Python gRPC receives at most 4 MiB by default, less than one Qwen3-8B page
        # (9.4 MB for FetchPages); the daemon's own limit is 256 MiB.
        "grpc.max_receive_message_length": int(max_message_bytes),
        "grpc.max_send_message_length": int(max_message_bytes),
        # Long-lived decode streams: ping every 60 s (the daemon accepts >= 10 s).
        "grpc.keepalive_time_ms": 60000,
        "grpc.keepalive_timeout_ms": 20000,
    }
    creds: Optional[grpc.ChannelCredentials] = None
    if isinstance(tls, grpc.ChannelCredentials):
        creds = tls
    elif tls is True:
        creds = TLS().channel_credentials()
    elif isinstance(tls, TLS):
        creds = tls.channel_credentials()
        if tls.server_name:
            opts["grpc.ssl_target_name_override"] = tls.server_name
    elif tls not in (None, False):
        raise TypeError("tls must be None, True, kvcd.TLS or grpc.ChannelCredentials")
    for k, v in options or ():
        opts[k] = v
    metadata: Tuple[Tuple[str, str], ...] = ()
    if token is not None:
        if not token or any(c in token for c in "\r\n"):
            raise ValueError("token must be a non-empty single-line string")
        if creds is None and not _is_loopback(target):
            warnings.warn(f"sending a bearer token to {target} without TLS", stacklevel=3)
        metadata = (("authorization", f"Bearer {token}"),)
    return creds, list(opts.items()), metadata


def _host_port(target: str) -> Optional[Tuple[str, int]]:
    if target.startswith("unix:"):
        return None
    t = target.split("///")[-1]
    host, sep, port = t.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "localhost", int(port)


def _speaks_tls(host: str, port: int, timeout: float) -> Optional[bool]:
    """True if the port completes a TLS handshake, False if it answers but not with TLS,
    None if nothing accepts a connection there (or the probe itself failed)."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with ctx.wrap_socket(sock, server_hostname=host):
            return True
    except (ssl.SSLError, ConnectionError):
        return False
    except OSError:
        return None
    finally:
        sock.close()


def closed_error(target: str) -> Exception:
    """The error of a call on a closed client (a kvcd error, not gRPC's ValueError)."""
    return error_from_status(grpc.StatusCode.CANCELLED,
                             f"the client of {target} is closed; make a new kvcd.Client")


def unreachable_message(target: str, secure: bool, waited: float) -> str:
    """Why a channel did not become ready, with what to do: a plaintext client on a TLS
    port, a TLS client on a plaintext port, or nothing listening."""
    base = f"kvcd at {target} not reachable within {waited:g} s"
    hp = _host_port(target)
    if hp is None:
        return base
    tls = _speaks_tls(hp[0], hp[1], timeout=min(2.0, max(waited, 0.5)))
    if tls is None:
        return f"{base}: nothing accepts connections on {hp[0]}:{hp[1]} (is the daemon running?)"
    if tls and not secure:
        return (f"{base}: the port speaks TLS and this client connects in plaintext; pass "
                f"tls=kvcd.TLS(root_certificates=...) (or tls=True for the system roots)")
    if not tls and secure:
        return (f"{base}: the port does not speak TLS and this client uses TLS; connect "
                f"without tls= (a plaintext daemon) or enable tls in the daemon's config")
    if tls and secure:
        return (f"{base}: the TLS handshake does not complete with this client's "
                f"credentials (check root_certificates, server_name and, for mTLS, the "
                f"client certificate)")
    return base


# ----------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PutResult:
    """Outcome of :meth:`Client.put`.

    ``ignored_tokens`` > 0 means the prompt ended in a partial page, which the daemon does
    NOT store (only full pages are cached and shared): a later ``open_sequence`` matches
    at most ``len(tokens) - ignored_tokens`` tokens and the rest must be appended.
    ``requests`` is the number of Put messages sent (> 1 when chunked).
    """
    cached_tokens: int
    inserted_tokens: int
    ignored_tokens: int
    requests: int = 1


@dataclass(frozen=True)
class MatchResult:
    """``committed_tokens``: of ``matched_tokens``, those in pages a sequence's commit put
    into the cache (docs/sessions.md) rather than a Put."""
    matched_tokens: int
    matched_pages: int
    committed_tokens: int = 0


@dataclass(frozen=True)
class CommitResult:
    """What a commit put into the prefix cache (docs/sessions.md): ``committed_tokens``
    page-aligned tokens of the sequence are cached now, ``inserted_pages`` of its pages were
    added, ``deduplicated_pages`` were cached already (the sequence uses the cache's)."""
    committed_tokens: int
    inserted_pages: int
    deduplicated_pages: int

    @staticmethod
    def of(r: Any) -> "CommitResult":
        return CommitResult(int(r.committed_tokens), int(r.inserted_pages),
                            int(r.deduplicated_pages))


@dataclass(frozen=True)
class PinResult:
    """Outcome of :meth:`Client.pin_prefix`: the pin's id (for ``unpin_prefix``), the
    page-aligned tokens and pages it holds, and when it expires (Unix time in ms)."""
    pin_id: int
    pinned_tokens: int
    pinned_pages: int
    expires_unix_ms: int


def pin_result(r: Any) -> PinResult:
    return PinResult(int(r.pin_id), int(r.pinned_tokens), int(r.pinned_pages),
                     int(r.expires_unix_ms))


class DecodeResult(tuple):
    """``(o, lse)`` of an attention call, unpackable as a pair.

    ``o``: ``[B, num_q_heads, head_dim]`` float32; ``lse``: ``[B, num_q_heads]`` float32,
    natural log. Both are numpy arrays, or torch tensors on q's device when q was a torch
    tensor, or ``None`` when the outputs were written to ``o_out``/``lse_out`` device
    regions. ``lengths``: tokens attended per sequence; ``kernel_seconds``: time in the
    daemon's attention kernels; ``request_id``: as echoed by the daemon.
    """
    lengths: Tuple[int, ...]
    kernel_seconds: float
    request_id: int

    def __new__(cls, o, lse, lengths: Sequence[int], kernel_seconds: float, request_id: int):
        self = tuple.__new__(cls, (o, lse))
        self.lengths = tuple(int(x) for x in lengths)
        self.kernel_seconds = float(kernel_seconds)
        self.request_id = int(request_id)
        return self

    @property
    def o(self):
        return self[0]

    @property
    def lse(self):
        return self[1]


@dataclass
class FetchedPages:
    """Outcome of :meth:`Client.fetch_pages`.

    With ``expand_to_bf16=True``: ``k``/``v`` are ``[num_layers, num_tokens, num_kv_heads,
    head_dim]`` in the model's original (unrotated) space, BF16 values as float32 (or
    ``torch.bfloat16`` with ``as_torch=True``), and ``pages`` is empty. Otherwise ``pages``
    holds the ``StoredPage`` messages (format, first_token, num_tokens, data) that
    :func:`kvcd.pages.decode_page` decodes and :meth:`Client.push_pages` stores elsewhere.
    ``page_formats``: the stored format of every page covered, in both cases.
    """
    first_token: int
    num_tokens: int
    page_formats: List[str]
    pages: List[pb.StoredPage] = field(default_factory=list)
    k: Any = None
    v: Any = None
    geometry: Optional[PageGeometry] = None

    def decode(self, rotation_k=None, rotation_v=None) -> Tuple[np.ndarray, np.ndarray]:
        """Decodes the stored pages into float32 ``(k, v)`` ``[L, num_tokens, H, D]``."""
        if self.geometry is None:
            raise ValueError("unknown model geometry")
        ks, vs = [], []
        for p in self.pages:
            k, v = decode_page(p, self.geometry, rotation_k=rotation_k, rotation_v=rotation_v)
            ks.append(k)
            vs.append(v)
        L, H, D = self.geometry.num_layers, self.geometry.num_kv_heads, self.geometry.head_dim
        if not ks:
            return np.zeros((L, 0, H, D), np.float32), np.zeros((L, 0, H, D), np.float32)
        return np.concatenate(ks, axis=1), np.concatenate(vs, axis=1)


# ----------------------------------------------------------------------------------------
# Profiles
# ----------------------------------------------------------------------------------------

_HISTORY = {
    "bf16": pb.HISTORY_FORMAT_BF16,
    "int2-oscar": pb.HISTORY_FORMAT_INT2_OSCAR,
    "int2": pb.HISTORY_FORMAT_INT2_OSCAR,
    "fsq": pb.HISTORY_FORMAT_FSQ,
}


def make_profile(profile: Optional[pb.ModelProfile], fields: Dict[str, Any]) -> pb.ModelProfile:
    """A ModelProfile from a message and/or keyword fields.

    ``history_format`` may be a string ("bf16", "int2-oscar"); ``rope`` a dict
    (theta, rotary_dims, scaling) or a RopeParams; the other keywords are the message's
    fields (num_layers, num_q_heads, num_kv_heads, head_dim, page_size, sink_tokens,
    recent_tokens, memory_bytes, bf16_fraction, codec, ...)."""
    p = pb.ModelProfile()
    if profile is not None:
        p.CopyFrom(profile)
    for key, value in fields.items():
        if key == "history_format" and isinstance(value, str):
            if value not in _HISTORY:
                raise ValueError(f"history_format '{value}', expected one of {sorted(_HISTORY)}")
            value = _HISTORY[value]
        if key == "rope":
            p.rope.CopyFrom(value if isinstance(value, pb.RopeParams) else pb.RopeParams(**value))
            continue
        if key not in pb.ModelProfile.DESCRIPTOR.fields_by_name:
            raise TypeError(f"ModelProfile has no field '{key}'")
        setattr(p, key, value)
    return p


# ----------------------------------------------------------------------------------------
# Put / Append planning and checks
# ----------------------------------------------------------------------------------------

def tokens_list(tokens: TokenSeq) -> List[int]:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {list(arr.shape)}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"tokens must be integers, got {arr.dtype}")
    if arr.size and (arr.min() < -(2 ** 31) or arr.max() >= 2 ** 31):
        raise ValueError("tokens must fit in int32")
    return [int(t) for t in arr.tolist()]


def elem_bytes(x: Any, wire_dtype: Optional[str]) -> int:
    if isinstance(x, pb.TensorRef):
        return 2 if x.dtype == pb.DTYPE_BF16 else 4
    if wire_dtype is not None:
        return 2 if wire_dtype.lower() == "bf16" else 4
    if T.is_torch(x):
        import torch
        return 2 if x.dtype == torch.bfloat16 else 4
    return 4


def kv_chunks(p: pb.ModelProfile, n_kv: int, k: Any, wire_dtype: Optional[str],
              max_message_bytes: int, extra_bytes: int, align: int,
              extra_per_token: int = 0) -> List[Tuple[int, int]]:
    """Splits n_kv K/V rows into [start, end) chunks whose request fits the message limit;
    chunk boundaries are multiples of ``align`` (page_size for Put, 1 for Append).
    ``extra_per_token``: bytes per token sent beside K/V (FSQ residuals)."""
    if isinstance(k, pb.TensorRef) and k.WhichOneof("payload") != "inline_data":
        return [(0, n_kv)]  # device regions: nothing travels in the message
    per_token = (2 * p.num_layers * p.num_kv_heads * p.head_dim * elem_bytes(k, wire_dtype)
                 + extra_per_token)
    budget = max_message_bytes - _MESSAGE_OVERHEAD - extra_bytes
    if per_token * n_kv <= budget or n_kv == 0:
        return [(0, n_kv)]
    rows = (budget // per_token) // align * align
    if rows <= 0:
        raise ValueError(f"one {'page' if align > 1 else 'token'} of K/V ({per_token * align} "
                         f"bytes) does not fit in max_message_bytes={max_message_bytes}")
    return [(s, min(s + rows, n_kv)) for s in range(0, n_kv, rows)]


def slice_tokens(x: Any, start: int, end: int) -> Any:
    """x[:, start:end] for arrays/tensors (axis 1 = tokens)."""
    if isinstance(x, pb.TensorRef):
        if start != 0 or end != int(x.shape[1]):
            raise ValueError("cannot split a device TensorRef")
        return x
    return x[:, start:end]


def kv_shape(p: pb.ModelProfile, n: int) -> Tuple[int, int, int, int]:
    return (p.num_layers, n, p.num_kv_heads, p.head_dim)


def is_fsq(p: Optional[pb.ModelProfile]) -> bool:
    return p is not None and p.history_format == pb.HISTORY_FORMAT_FSQ


def check_residuals(p: Optional[pb.ModelProfile], name: str, x: Any,
                    shape: Optional[Tuple[int, ...]]) -> None:
    """FSQ models need the residuals ``x`` beside K/V; other models must not get them."""
    if p is None:
        return
    if is_fsq(p) and x is None:
        raise ValueError(f"model '{p.name}' stores FSQ codes: {name} (the residuals, "
                         f"{list(shape) if shape else ''}) is required")
    if not is_fsq(p) and x is not None:
        raise ValueError(f"{name} is set but model '{p.name}' is not an FSQ model")
    if x is not None and shape is not None:
        T.check_shape(name, x, shape)


def residual_bytes(p: pb.ModelProfile, x: Any, wire_dtype: Optional[str]) -> int:
    """Bytes per token of the residuals (all layers)."""
    if x is None:
        return 0
    return p.num_layers * p.fsq_residual_width * elem_bytes(x, wire_dtype)


def put_requests(p: pb.ModelProfile, model: str, tokens: List[int], k: Any, v: Any,
                 cache_salt: str, kv_first_token: int, wire_dtype: Optional[str],
                 max_message_bytes: int, x: Any = None) -> List[pb.PutRequest]:
    n = len(tokens)
    if n < 1:
        raise ValueError("tokens must hold at least one token")
    if kv_first_token < 0 or kv_first_token > n or kv_first_token % p.page_size:
        raise ValueError(f"kv_first_token is {kv_first_token}, expected a multiple of page_size "
                         f"{p.page_size} in [0, {n}]")
    T.check_shape("k", k, kv_shape(p, n - kv_first_token))
    T.check_shape("v", v, kv_shape(p, n - kv_first_token))
    check_residuals(p, "x", x, (p.num_layers, n - kv_first_token, p.fsq_residual_width))
    chunks = kv_chunks(p, n - kv_first_token, k, wire_dtype, max_message_bytes, 4 * n,
                       p.page_size, residual_bytes(p, x, wire_dtype))
    reqs = []
    for s, e in chunks:
        r = pb.PutRequest(model=model, cache_salt=cache_salt,
                          kv_first_token=kv_first_token + s)
        r.tokens.extend(tokens[:kv_first_token + e])
        T.to_tensor_ref(slice_tokens(k, s, e), wire_dtype, r.k)
        T.to_tensor_ref(slice_tokens(v, s, e), wire_dtype, r.v)
        if x is not None:
            T.to_tensor_ref(slice_tokens(x, s, e), wire_dtype, r.x)
        reqs.append(r)
    return reqs


def put_result(n: int, responses: List[pb.PutResponse]) -> PutResult:
    if len(responses) == 1:
        r = responses[0]
        return PutResult(int(r.cached_tokens), int(r.inserted_tokens), int(r.ignored_tokens), 1)
    inserted = sum(int(r.inserted_tokens) for r in responses)
    ignored = int(responses[-1].ignored_tokens)
    return PutResult(n - ignored - inserted, inserted, ignored, len(responses))


def log_ignored(model: str, result: PutResult) -> None:
    if result.ignored_tokens:
        log.debug("Put %s: %d trailing token(s) of a partial page were not stored", model,
                  result.ignored_tokens)


def append_requests(p: Optional[pb.ModelProfile], sequence_id: int, tokens: List[int], k: Any,
                    v: Any, wire_dtype: Optional[str], max_message_bytes: int,
                    x: Any = None) -> List[pb.AppendRequest]:
    n = len(tokens)
    if n < 1:
        raise ValueError("append needs at least one token")
    if p is not None:
        T.check_shape("k", k, kv_shape(p, n))
        T.check_shape("v", v, kv_shape(p, n))
        check_residuals(p, "x", x, (p.num_layers, n, p.fsq_residual_width))
        chunks = kv_chunks(p, n, k, wire_dtype, max_message_bytes, 4 * n, 1,
                           residual_bytes(p, x, wire_dtype))
    else:
        if T.shape_of(k) != T.shape_of(v) or len(T.shape_of(k)) != 4 or T.shape_of(k)[1] != n:
            raise ValueError(f"k and v must be [num_layers, {n}, num_kv_heads, head_dim]")
        chunks = [(0, n)]
    reqs = []
    for s, e in chunks:
        r = pb.AppendRequest(sequence_id=int(sequence_id))
        r.tokens.extend(tokens[s:e])
        T.to_tensor_ref(slice_tokens(k, s, e), wire_dtype, r.k)
        T.to_tensor_ref(slice_tokens(v, s, e), wire_dtype, r.v)
        if x is not None:
            T.to_tensor_ref(slice_tokens(x, s, e), wire_dtype, r.x)
        reqs.append(r)
    return reqs


def decode_request(p: Optional[pb.ModelProfile], layer: int, ids: List[int], q: Any,
                   k_new: Any, v_new: Any, new_tokens: Optional[TokenSeq], softmax_scale: float,
                   o_out: Optional[pb.TensorRef], lse_out: Optional[pb.TensorRef],
                   wire_dtype: Optional[str], request_id: int,
                   x_new: Any = None) -> pb.AttentionDecodeRequest:
    B = len(ids)
    if B < 1:
        raise ValueError("attention needs at least one sequence")
    qs = T.shape_of(q)
    if len(qs) != 3 or qs[0] != B:
        raise ValueError(f"q has shape {list(qs)}, expected [{B}, num_q_heads, head_dim]")
    if p is not None:
        if not 0 <= layer < p.num_layers:
            raise ValueError(f"layer is {layer}, expected 0..{p.num_layers - 1}")
        T.check_shape("q", q, (B, p.num_q_heads, p.head_dim))
    r = pb.AttentionDecodeRequest(layer=int(layer), softmax_scale=float(softmax_scale),
                                  request_id=int(request_id))
    r.sequence_ids.extend(int(i) for i in ids)
    T.to_tensor_ref(q, wire_dtype, r.q)
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together")
    if k_new is not None:
        toks = tokens_list(new_tokens if new_tokens is not None else [])
        if len(toks) != B:
            raise ValueError(f"new_tokens has {len(toks)} ids, expected one per sequence ({B})")
        expected = (B, p.num_kv_heads, p.head_dim) if p is not None else None
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            if expected is not None:
                T.check_shape(name, x, expected)
            elif T.shape_of(x)[:1] != (B,):
                raise ValueError(f"{name} must be [{B}, num_kv_heads, head_dim]")
        T.to_tensor_ref(k_new, wire_dtype, r.k_new)
        T.to_tensor_ref(v_new, wire_dtype, r.v_new)
        check_residuals(p, "x_new", x_new,
                        (B, p.fsq_residual_width) if p is not None else None)
        if x_new is not None:
            T.to_tensor_ref(x_new, wire_dtype, r.x_new)
        r.new_tokens.extend(toks)
    elif new_tokens is not None:
        raise ValueError("new_tokens needs k_new and v_new")
    elif x_new is not None:
        raise ValueError("x_new needs k_new and v_new")
    if (o_out is None) != (lse_out is None):
        raise ValueError("o_out and lse_out go together")
    if o_out is not None:
        r.o_out.CopyFrom(o_out)
        r.lse_out.CopyFrom(lse_out)
    return r


def decode_result(resp: pb.AttentionDecodeResponse, q: Any) -> DecodeResult:
    o = lse = None
    if resp.o.WhichOneof("payload") == "inline_data":
        o = T.like(T.tensor_ref_to_numpy(resp.o), q)
        lse = T.like(T.tensor_ref_to_numpy(resp.lse), q)
    return DecodeResult(o, lse, list(resp.lengths), resp.kernel_seconds, resp.request_id)


def fetched(resp: pb.FetchPagesResponse, expand: bool, as_torch: bool,
            geometry: Optional[PageGeometry]) -> FetchedPages:
    out = FetchedPages(first_token=int(resp.first_token), num_tokens=int(resp.num_tokens),
                       page_formats=list(resp.page_formats), pages=list(resp.pages),
                       geometry=geometry)
    if expand:
        if as_torch:
            out.k = T.bf16_tensor_from_ref(resp.k)
            out.v = T.bf16_tensor_from_ref(resp.v)
        else:
            out.k = T.tensor_ref_to_numpy(resp.k)
            out.v = T.tensor_ref_to_numpy(resp.v)
    return out


def push_request(p: pb.ModelProfile, model: str, tokens: List[int],
                 pages: Union[FetchedPages, Iterable[pb.StoredPage]], first_page: Optional[int],
                 cache_salt: str, device_pages: Optional[pb.TensorRef], num_pages: int
                 ) -> pb.PushPagesRequest:
    r = pb.PushPagesRequest(model=model, cache_salt=cache_salt)
    r.tokens.extend(tokens)
    if device_pages is not None:
        r.pages.CopyFrom(device_pages)
        r.num_pages = int(num_pages)
        r.first_page = int(first_page or 0)
        return r
    plist = list(pages.pages if isinstance(pages, FetchedPages) else pages)
    # Like Put, only full pages can be stored: a sequence's trailing partial page (as
    # FetchPages returns it) is left out.
    if plist and int(plist[-1].num_tokens) < p.page_size:
        plist = plist[:-1]
    if any(int(pg.num_tokens) != p.page_size for pg in plist):
        raise ValueError("only the last page may be partial")
    if not plist:
        raise ValueError("no pages to push (fetch them with expand_to_bf16=False)")
    if first_page is None:
        first_page = int(plist[0].first_token) // p.page_size
    r.first_page = int(first_page)
    r.inline_pages.extend(plist)
    return r
