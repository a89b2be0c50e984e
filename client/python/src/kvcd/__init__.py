"""kvcd: Python client of the kvcd KV-cache daemon.

    import kvcd
    with kvcd.Client("127.0.0.1:50051") as c:
        c.put("tiny", tokens, k, v)
        with c.open_sequence("tiny", tokens, k=k, v=v) as seq, c.decode_session() as s:
            o, lse = s.attend(0, seq, q, k_new=k1, v_new=v1, new_tokens=[t])

Modules: :mod:`kvcd.aio` (asyncio twin), :mod:`kvcd.pages` (decoders of stored BF16 and
INT2 pages), :mod:`kvcd.cuda` (CUDA IPC buffers for torch tensors), :mod:`kvcd.errors`,
:mod:`kvcd.v1` (the generated protobuf/gRPC stubs).
"""
from ._version import __version__
from ._core import (TLS, CommitResult, DecodeResult, FetchedPages, MatchResult, PinResult,
                    PutResult,
                    make_profile)
from .client import Client, DecodeSession, Sequence
from .errors import (Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded,
                     FailedPrecondition, Internal, InvalidArgument, KvcdError, NotFound,
                     OutOfRange, PermissionDenied, ResourceExhausted, Unauthenticated,
                     Unavailable, Unimplemented, Unknown)
from .pages import PageGeometry, decode_page, hadamard
from .v1 import kvcache_pb2 as pb
from . import aio, cuda, errors, pages, tensors, v1  # noqa: E402  (kvcd.aio etc. as attributes)

__all__ = [
    "__version__", "aio", "cuda", "errors", "pages", "tensors", "v1", "Client", "Sequence", "DecodeSession", "TLS", "PutResult", "MatchResult", "PinResult",
    "CommitResult",
    "DecodeResult", "FetchedPages", "PageGeometry", "decode_page", "hadamard", "make_profile",
    "pb", "KvcdError", "Cancelled", "Unknown", "InvalidArgument", "DeadlineExceeded",
    "NotFound", "AlreadyExists", "PermissionDenied", "ResourceExhausted", "FailedPrecondition",
    "Aborted", "OutOfRange", "Unimplemented", "Internal", "Unavailable", "DataLoss",
    "Unauthenticated",
]
