"""Block identity, version 1 (docs/cluster.md "Block identity"): the chained SHA-256 that
names a full page of (model, tenant salt, history format, token ids), computed without
asking a daemon. The C++ twin is common/block_hash.{h,cc}; both are tested against
tests/data/block_hash_vectors.json.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Iterable, List, Sequence

__all__ = ["VERSION_TAG", "ZERO_HASH", "block_hashes", "block_hash", "to_hex", "event_id",
           "MAX_NAME_BYTES"]

VERSION_TAG = b"kvcd-block-v1\x00"
ZERO_HASH = bytes(32)
# Names longer than this are refused: no real model, salt or format name comes close, and a
# bound keeps a hostile caller from hashing megabytes per page.
MAX_NAME_BYTES = 4096
_FORMATS = ("bf16", "int2-oscar", "int2-transform", "fsq")


def _field(name: str, value) -> bytes:
    if isinstance(value, str):
        raw = value.encode("utf-8")
    elif isinstance(value, (bytes, bytearray)):
        raw = bytes(value)
    else:
        raise TypeError(f"{name} must be str or bytes, got {type(value).__name__}")
    if len(raw) > MAX_NAME_BYTES:
        raise ValueError(f"{name} is {len(raw)} bytes; at most {MAX_NAME_BYTES} are allowed")
    return struct.pack("<I", len(raw)) + raw


def _prefix(model, salt, history_format) -> bytes:
    fmt = history_format.decode() if isinstance(history_format, (bytes, bytearray)) \
        else history_format
    if fmt not in _FORMATS:
        raise ValueError(f"history format {fmt!r} is not one of {', '.join(_FORMATS)}")
    return VERSION_TAG + _field("model", model) + _field("salt", salt) + _field("format", fmt)


def _page(page_size: int, tokens: Sequence[int]) -> bytes:
    """u32le(page_size) then each token id as u32le: an int32 id (the API's type) as its
    two's-complement bit pattern, as the daemon's static_cast<uint32_t> gives."""
    bad = next((t for t in tokens if not -2 ** 31 <= t < 2 ** 32), None)
    if bad is not None:
        raise ValueError(f"token ids must be in [-2^31, 2^32); got {bad!r}")
    return struct.pack(f"<I{page_size}I", page_size, *(t & 0xFFFFFFFF for t in tokens))


def block_hash(model, salt, history_format, parent: bytes, page_size: int,
               page_tokens: Sequence[int]) -> bytes:
    """The hash of one full page given its parent's hash (``ZERO_HASH`` for page 0)."""
    if len(parent) != 32:
        raise ValueError(f"parent hash must be 32 bytes, got {len(parent)}")
    if len(page_tokens) != page_size:
        raise ValueError(f"a page holds exactly page_size={page_size} tokens, "
                         f"got {len(page_tokens)}")
    h = hashlib.sha256(_prefix(model, salt, history_format))
    h.update(parent)
    h.update(_page(page_size, page_tokens))
    return h.digest()


def block_hashes(model, salt, history_format, page_size: int,
                 tokens: Iterable[int]) -> List[bytes]:
    """The hashes of every full page of ``tokens`` in order (a partial tail has none)."""
    if not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
    toks = [int(t) for t in tokens]
    prefix = _prefix(model, salt, history_format)
    out: List[bytes] = []
    parent = ZERO_HASH
    for i in range(len(toks) // page_size):
        h = hashlib.sha256(prefix)
        h.update(parent)
        h.update(_page(page_size, toks[i * page_size:(i + 1) * page_size]))
        parent = h.digest()
        out.append(parent)
    return out


def to_hex(h: bytes) -> str:
    """Text form: lowercase hex of all 32 bytes."""
    return bytes(h).hex()


def event_id(h: bytes) -> int:
    """The integer the ZeroMQ events carry: the first 8 bytes, big-endian signed."""
    return struct.unpack(">q", bytes(h)[:8])[0]
