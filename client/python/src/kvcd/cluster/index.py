"""The block index (docs/cluster.md "Block index"): which member holds which page, and each
member's load, read from Redis with redis-py. Everything read is checked: a field whose
member is not in membership, whose incarnation differs from the member's, or whose value is
malformed is ignored (counted in ``rejected``); a stale entry costs a miss, never a wrong
answer (the daemon verifies on the call).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

from .block_hash import to_hex
from .member import Member

__all__ = ["BlockIndex", "Load", "MAX_LOOKUP_PAGES"]

MAX_LOOKUP_PAGES = 1 << 16    # pages of one prompt looked up at most
MAX_FIELDS_PER_BLOCK = 1024   # holders read per page at most
_VALUE_RE = re.compile(rb"([0-9a-f]{16}):(device|host)\Z")
_CLUSTER_RE = re.compile(r"[A-Za-z0-9._-]{1,128}\Z")
_U64 = (1 << 63) - 1


@dataclass(frozen=True)
class Load:
    """A member's load as it last wrote it (``load:<member_id>``)."""
    pages_used: int = 0
    pages_capacity: int = 0
    open_sequences: int = 0
    queued_decode: int = 0
    updated_ms: int = 0


def _u(fields: Mapping[bytes, bytes], name: bytes) -> int:
    v = fields.get(name, b"0")
    if not v.isdigit() or len(v) > 19 or int(v) > _U64:
        raise ValueError(f"{name.decode()} is not a non-negative integer")
    return int(v)


class BlockIndex:
    """Reads ``kvcd:{<cluster>}:`` keys of the Redis that ``redis`` (a ``redis.Redis``) or
    ``url`` (``redis://host:port/db``) names."""

    def __init__(self, cluster_name: str, *, url: Optional[str] = None, redis=None,
                 timeout: float = 2.0) -> None:
        if not _CLUSTER_RE.match(cluster_name):
            raise ValueError(f"cluster name {cluster_name!r} is not [A-Za-z0-9._-]{{1,128}}")
        if redis is None:
            if not url:
                raise ValueError("BlockIndex needs a Redis url or a redis.Redis")
            import redis as redis_py  # the `cluster` extra
            redis = redis_py.Redis.from_url(url, socket_timeout=timeout,
                                            socket_connect_timeout=timeout)
        self.redis = redis
        self.prefix = f"kvcd:{{{cluster_name}}}:"
        self.rejected = 0

    def holders(self, hashes: Sequence[bytes],
                members: Mapping[str, Member]) -> List[Dict[str, str]]:
        """For each page hash (in order, at most MAX_LOOKUP_PAGES), the members credited
        with it (member id -> tier), fenced by incarnation. One pipelined HGETALL per page."""
        hashes = list(hashes)[:MAX_LOOKUP_PAGES]
        if not hashes or not members:
            return [{} for _ in hashes]
        pipe = self.redis.pipeline(transaction=False)
        for h in hashes:
            pipe.hgetall(self.prefix + "blk:" + to_hex(h))
        out: List[Dict[str, str]] = []
        for fields in pipe.execute():
            held: Dict[str, str] = {}
            if not isinstance(fields, dict):
                self.rejected += 1
                fields = {}
            for n, (k, v) in enumerate(fields.items()):
                if n >= MAX_FIELDS_PER_BLOCK:
                    self.rejected += 1
                    break
                try:
                    member_id = k.decode()
                except UnicodeDecodeError:
                    self.rejected += 1
                    continue
                m = members.get(member_id)
                match = _VALUE_RE.match(v) if isinstance(v, bytes) else None
                if m is None or match is None or match.group(1).decode() != m.incarnation:
                    self.rejected += 1
                    continue
                held[member_id] = match.group(2).decode()
            out.append(held)
        return out

    def loads(self, members: Mapping[str, Member]) -> Dict[str, Load]:
        """Each member's load, when its ``load:`` hash exists and names its incarnation."""
        ids = sorted(members)
        if not ids:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for member_id in ids:
            pipe.hgetall(self.prefix + "load:" + member_id)
        out: Dict[str, Load] = {}
        for member_id, f in zip(ids, pipe.execute()):
            if not f:
                continue
            try:
                if f.get(b"incarnation", b"").decode() != members[member_id].incarnation:
                    raise ValueError("incarnation differs")
                out[member_id] = Load(_u(f, b"pages_used"), _u(f, b"pages_capacity"),
                                      _u(f, b"open_sequences"), _u(f, b"queued_decode"),
                                      _u(f, b"updated_ms"))
            except (ValueError, UnicodeDecodeError):
                self.rejected += 1
        return out

    def close(self) -> None:
        self.redis.close()
