"""Exceptions raised by the kvcd client, one class per gRPC status code.

Every call of :class:`kvcd.Client` and :class:`kvcd.aio.Client` raises a subclass of
:class:`KvcdError` when the daemon (or the transport) answers with a non-OK status. The
daemon's message names the offending field and the expected value; it is the exception's
``message`` (and ``str(e)``). Per-request errors of a :class:`~kvcd.DecodeSession` are
raised the same way and leave the stream usable.

Codes the daemon produces (docs/api.md): INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS,
RESOURCE_EXHAUSTED (with a retry hint), FAILED_PRECONDITION, UNAVAILABLE (draining).
PERMISSION_DENIED and UNAUTHENTICATED come from a daemon with token auth; the others
from the transport (DEADLINE_EXCEEDED, CANCELLED, ...).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple, Type

import grpc

__all__ = [
    "KvcdError", "Cancelled", "Unknown", "InvalidArgument", "DeadlineExceeded", "NotFound",
    "AlreadyExists", "PermissionDenied", "ResourceExhausted", "FailedPrecondition", "Aborted",
    "OutOfRange", "Unimplemented", "Internal", "Unavailable", "DataLoss", "Unauthenticated",
    "error_from_status",
]


class KvcdError(Exception):
    """A non-OK status from the daemon or the transport.

    Attributes:
        code: the ``grpc.StatusCode``.
        message: the status message (the daemon's explanation).
        trailing_metadata: the call's trailing metadata as ``(key, value)`` pairs.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, code: Optional[grpc.StatusCode] = None,
                 trailing_metadata: Sequence[Tuple[str, str]] = ()) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.trailing_metadata = tuple(trailing_metadata)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class Cancelled(KvcdError):
    code = grpc.StatusCode.CANCELLED


class Unknown(KvcdError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(KvcdError):
    """Bad shape, dtype, length or field value (the message names the field)."""
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(KvcdError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(KvcdError):
    """Unknown model, sequence or buffer (e.g. a sequence whose lease ran out)."""
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KvcdError):
    """A model name registered again with a different profile."""
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(KvcdError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(KvcdError):
    """Pool full and nothing evictable (or a message over the size limit).

    ``retry_after`` is the daemon's retry hint in seconds, read from the standard
    ``grpc-retry-pushback-ms`` trailer, or the ``retry-after-ms`` trailer of older
    daemons (``None`` when neither is present, e.g. a transport-level size error or a
    stream error).
    """
    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    @property
    def retry_after_ms(self) -> Optional[int]:
        md = dict((k.lower(), v) for k, v in self.trailing_metadata)
        for key in ("grpc-retry-pushback-ms", "retry-after-ms"):
            value = md.get(key)
            if value is None:
                continue
            if isinstance(value, bytes):
                value = value.decode("ascii", "replace")
            try:
                ms = int(value)
            except ValueError:
                continue
            if ms >= 0:  # a negative pushback means "do not retry"; ignore it here
                return ms
        return None

    @property
    def retry_after(self) -> Optional[float]:
        ms = self.retry_after_ms
        return None if ms is None else ms / 1000.0


class FailedPrecondition(KvcdError):
    """Misuse: closed sequence, a per-layer token still pending, a chunk whose prefix is
    not cached, a cuda_ipc tensor on the CPU backend, ..."""
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(KvcdError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(KvcdError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(KvcdError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(KvcdError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(KvcdError):
    """The daemon is draining or cannot be reached; retry (on another replica)."""
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(KvcdError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(KvcdError):
    """Missing or invalid bearer token."""
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: Dict[grpc.StatusCode, Type[KvcdError]] = {
    cls.code: cls for cls in (
        Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
        PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange,
        Unimplemented, Internal, Unavailable, DataLoss, Unauthenticated)
}
_BY_NUMBER: Dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def error_from_status(code, message: str,
                      trailing_metadata: Sequence[Tuple[str, str]] = ()) -> KvcdError:
    """The exception for a status; ``code`` is a ``grpc.StatusCode`` or its number."""
    if not isinstance(code, grpc.StatusCode):
        code = _BY_NUMBER.get(int(code), grpc.StatusCode.UNKNOWN)
    cls = _BY_CODE.get(code, KvcdError)
    return cls(message or "", code=code, trailing_metadata=trailing_metadata or ())


def _from_rpc_error(e: grpc.RpcError) -> KvcdError:
    """Maps a grpc.RpcError (sync) or grpc.aio.AioRpcError to a KvcdError."""
    try:
        md: Any = e.trailing_metadata() or ()  # type: ignore[attr-defined]
    except Exception:  # pragma: no cover - some transport errors carry none
        md = ()
    pairs = [(str(k), v) for k, v in md]
    return error_from_status(e.code(), e.details() or "", pairs)  # type: ignore[attr-defined]
