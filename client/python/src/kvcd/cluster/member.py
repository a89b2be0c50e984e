"""A cluster member as membership advertises it (docs/cluster.md "Membership"), and the
checks every advertised value goes through: etcd's content is written by other processes
and is treated as hostile, so a value that breaks a rule is refused with a message naming
the field, never half-used.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Dict

__all__ = ["Member", "MemberError", "parse_member", "MAX_MEMBER_VALUE_BYTES", "MEMBER_ID_RE"]

MAX_MEMBER_VALUE_BYTES = 4096
MEMBER_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}\Z")
_INCARNATION_RE = re.compile(r"[0-9a-f]{16}\Z")
_HOST_RE = re.compile(r"(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,253})\Z")
_MAX_PAGES = 1 << 40
_MAX_PAGE_BYTES = 1 << 32


class MemberError(ValueError):
    """An advertised member value that breaks the contract."""


@dataclass(frozen=True)
class Member:
    member_id: str
    address: str          # host:port of the member's gRPC listener
    backend: str          # "cpu" or "cuda"
    capacity_pages: int
    page_bytes: int
    incarnation: str      # 16 lowercase hex characters, new at every start
    started_unix_ms: int = 0
    version: str = ""
    events_endpoint: str = ""


def check_address(value: Any, field: str = "address") -> str:
    if not isinstance(value, str) or len(value) > 300:
        raise MemberError(f"{field} must be a host:port string of at most 300 characters")
    host, sep, port = value.rpartition(":")
    if not sep or not _HOST_RE.match(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise MemberError(f"{field} {value!r} is not host:port with a port in 1..65535")
    return value


def _int(obj: Dict[str, Any], field: str, lo: int, hi: int, default=None) -> int:
    v = obj.get(field, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise MemberError(f"{field} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def parse_member(member_id: str, raw: bytes) -> Member:
    """The member advertised under key ``<prefix>/members/<member_id>`` with value ``raw``."""
    if not MEMBER_ID_RE.match(member_id):
        raise MemberError(f"member id {member_id[:80]!r} is not [A-Za-z0-9._-]{{1,253}}")
    if len(raw) > MAX_MEMBER_VALUE_BYTES:
        raise MemberError(f"member value is {len(raw)} bytes; at most "
                          f"{MAX_MEMBER_VALUE_BYTES} are allowed")
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise MemberError(f"member value is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise MemberError("member value must be a JSON object")
    if obj.get("member_id") != member_id:
        raise MemberError(f"member_id {obj.get('member_id')!r} differs from the key's "
                          f"{member_id!r}")
    backend = obj.get("backend")
    if backend not in ("cpu", "cuda"):
        raise MemberError(f"backend must be \"cpu\" or \"cuda\", got {backend!r}")
    inc = obj.get("incarnation")
    if not isinstance(inc, str) or not _INCARNATION_RE.match(inc):
        raise MemberError(f"incarnation must be 16 lowercase hex characters, got {inc!r}")
    version = obj.get("version", "")
    if not isinstance(version, str) or len(version) > 64:
        raise MemberError("version must be a string of at most 64 characters")
    events = obj.get("events_endpoint", "")
    if events:
        if not isinstance(events, str) or not events.startswith("tcp://"):
            raise MemberError(f"events_endpoint must be empty or tcp://host:port, "
                              f"got {events!r}")
        check_address(events[len("tcp://"):], "events_endpoint")
    return Member(member_id=member_id, address=check_address(obj.get("address")),
                  backend=backend,
                  capacity_pages=_int(obj, "capacity_pages", 0, _MAX_PAGES),
                  page_bytes=_int(obj, "page_bytes", 0, _MAX_PAGE_BYTES),
                  incarnation=inc,
                  started_unix_ms=_int(obj, "started_unix_ms", 0, 1 << 53, 0),
                  version=version, events_endpoint=events or "")
