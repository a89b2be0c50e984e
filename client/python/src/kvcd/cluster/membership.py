"""Membership (docs/cluster.md "Membership"): which daemons are alive, where they listen and
which incarnation they run.

:class:`EtcdMembership` reads ``<prefix>/members/`` through etcd's JSON gateway (one range,
then a watch from the next revision; a broken watch starts over with a range), and
:class:`DnsMembership` takes the A records of a headless Service, asking each address's
``Stats`` for its member id and incarnation. Both expose the same three calls: ``members()``
(a snapshot), ``wait_until(predicate, timeout)`` (waits on changes, no polling sleeps) and
``close()``. Values that break the contract are skipped and counted in ``rejected``.
"""
from __future__ import annotations

import base64
import http.client
import json
import logging
import socket
import threading
import urllib.parse
from typing import Callable, Dict, Optional, Sequence

from .member import Member, MemberError, MEMBER_ID_RE, parse_member

__all__ = ["EtcdMembership", "DnsMembership", "default_prefix"]

log = logging.getLogger("kvcd.cluster")

MAX_MEMBERS = 4096
MAX_RESPONSE_BYTES = 32 << 20   # a range answer larger than this is refused
MAX_WATCH_LINE_BYTES = 8 << 20  # one watch message


def default_prefix(cluster_name: str) -> str:
    return f"/kvcd/{cluster_name}"


def _b64(s: bytes) -> str:
    return base64.b64encode(s).decode()


def _prefix_end(prefix: bytes) -> bytes:
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return b"\x00"
    p[-1] += 1
    return bytes(p)


class _Snapshot:
    """The member map under a condition variable: readers wait on changes."""

    def __init__(self) -> None:
        self._members: Dict[str, Member] = {}
        self._cond = threading.Condition()
        self.rejected = 0
        self.changes = 0

    def members(self) -> Dict[str, Member]:
        with self._cond:
            return dict(self._members)

    def _publish(self, members: Dict[str, Member]) -> None:
        with self._cond:
            self._members = members
            self.changes += 1
            self._cond.notify_all()

    def wait_until(self, predicate: Callable[[Dict[str, Member]], bool],
                   timeout: float) -> bool:
        """Waits until ``predicate(members)`` holds; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(dict(self._members)), timeout)


class EtcdMembership(_Snapshot):
    """Members under ``prefix + "/members/"`` of the etcd at ``endpoint`` (``host:port`` or
    ``http://host:port``, its client URL), kept current by a watch thread.

    Raises :class:`ConnectionError` when the first range fails (etcd unreachable), so a
    client never starts with an empty cluster by mistake.
    """

    def __init__(self, endpoints: Sequence[str] | str, prefix: str, *,
                 timeout: float = 5.0) -> None:
        super().__init__()
        eps = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not eps:
            raise ValueError("etcd endpoints: at least one host:port is needed")
        self._endpoints = []
        for ep in eps:
            u = urllib.parse.urlsplit(ep if "://" in ep else "http://" + ep)
            if u.scheme != "http" or not u.hostname or not u.port:
                raise ValueError(f"etcd endpoint {ep!r} is not http://host:port")
            self._endpoints.append((u.hostname, u.port))
        self._key_prefix = (prefix.rstrip("/") + "/members/").encode()
        self._timeout = timeout
        self._stop = threading.Event()
        self._conn: Optional[http.client.HTTPConnection] = None
        self._next = 0
        revision = self._range()
        self._thread = threading.Thread(target=self._watch_loop, args=(revision,),
                                        name="kvcd-etcd-watch", daemon=True)
        self._thread.start()

    # -- gateway calls ------------------------------------------------------------------

    def _connect(self, timeout: Optional[float]) -> http.client.HTTPConnection:
        host, port = self._endpoints[self._next % len(self._endpoints)]
        self._next += 1
        return http.client.HTTPConnection(host, port, timeout=timeout)

    def _range(self) -> int:
        body = json.dumps({"key": _b64(self._key_prefix),
                           "range_end": _b64(_prefix_end(self._key_prefix))})
        last: Optional[Exception] = None
        for _ in self._endpoints:
            conn = self._connect(self._timeout)
            try:
                conn.request("POST", "/v3/kv/range", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read(MAX_RESPONSE_BYTES + 1)
                if resp.status != 200:
                    raise ConnectionError(f"etcd range answered HTTP {resp.status}: "
                                          f"{data[:200]!r}")
                if len(data) > MAX_RESPONSE_BYTES:
                    raise ConnectionError(f"etcd range answer exceeds {MAX_RESPONSE_BYTES} "
                                          f"bytes")
                obj = json.loads(data)
                members: Dict[str, Member] = {}
                for kv in obj.get("kvs", [])[:MAX_MEMBERS]:
                    self._apply(members, kv, deleted=False)
                self._publish(members)
                return int(obj.get("header", {}).get("revision", 0))
            except (OSError, ValueError, http.client.HTTPException) as e:
                last = e
            finally:
                conn.close()
        raise ConnectionError(f"etcd range of {self._key_prefix.decode()!r} failed on every "
                              f"endpoint: {last}")

    def _apply(self, members: Dict[str, Member], kv: dict, deleted: bool) -> None:
        try:
            key = base64.b64decode(kv.get("key", ""), validate=True)
        except ValueError:
            self.rejected += 1
            return
        if not key.startswith(self._key_prefix):
            self.rejected += 1
            return
        member_id = key[len(self._key_prefix):].decode("utf-8", "replace")
        if deleted:
            members.pop(member_id, None)
            return
        try:
            raw = base64.b64decode(kv.get("value", ""), validate=True)
            m = parse_member(member_id, raw)
        except (ValueError, MemberError) as e:
            self.rejected += 1
            members.pop(member_id, None)  # an unreadable value is no longer that member
            log.warning("kvcd.cluster: member %r refused: %s", member_id[:80], e)
            return
        if member_id in members or len(members) < MAX_MEMBERS:
            members[member_id] = m

    def _watch_loop(self, revision: int) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            try:
                self._watch(revision)
            except (OSError, ValueError, http.client.HTTPException) as e:
                if self._stop.is_set():
                    return
                log.info("kvcd.cluster: etcd watch broke (%s); resyncing", e)
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, 2.0)
            try:
                revision = self._range()
                backoff = 0.05
            except ConnectionError as e:
                log.info("kvcd.cluster: etcd range failed (%s); retrying", e)

    def _watch(self, revision: int) -> None:
        body = json.dumps({"create_request": {
            "key": _b64(self._key_prefix), "range_end": _b64(_prefix_end(self._key_prefix)),
            "start_revision": str(revision + 1)}})
        conn = self._connect(None)
        self._conn = conn
        try:
            conn.request("POST", "/v3/watch", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise ConnectionError(f"etcd watch answered HTTP {resp.status}")
            while not self._stop.is_set():
                line = resp.readline(MAX_WATCH_LINE_BYTES + 1)
                if not line:
                    raise ConnectionError("etcd watch stream ended")
                if len(line) > MAX_WATCH_LINE_BYTES or not line.endswith(b"\n"):
                    raise ValueError("etcd watch message too long")
                result = json.loads(line).get("result")
                if not isinstance(result, dict):
                    raise ValueError("etcd watch message without a result")
                if result.get("canceled") or result.get("compact_revision"):
                    raise ConnectionError("etcd watch canceled (compacted)")
                events = result.get("events") or []
                if not events:
                    continue
                members = self.members()
                for ev in events:
                    self._apply(members, ev.get("kv", {}), ev.get("type") == "DELETE")
                self._publish(members)
        finally:
            self._conn = None
            conn.close()

    def close(self) -> None:
        self._stop.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)

    def __enter__(self) -> "EtcdMembership":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DnsMembership(_Snapshot):
    """Members from the A records of ``dns_name`` (a headless Service) on ``port``: each
    address's ``Stats`` names its member id (the address when empty) and incarnation.
    ``refresh()`` re-resolves; ``stats_of(address)`` is the call used (injected so that the
    caller's credentials apply)."""

    def __init__(self, dns_name: str, port: int,
                 stats_of: Callable[[str], object], *, refresh_s: float = 5.0) -> None:
        super().__init__()
        if not 0 < int(port) < 65536:
            raise ValueError(f"port must be in 1..65535, got {port}")
        self._name, self._port, self._stats_of = dns_name, int(port), stats_of
        self._refresh_s = refresh_s
        self._stop = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="kvcd-dns-membership",
                                        daemon=True)
        self._thread.start()

    def refresh(self) -> None:
        try:
            infos = socket.getaddrinfo(self._name, self._port, socket.AF_INET,
                                       socket.SOCK_STREAM)
        except socket.gaierror as e:
            log.info("kvcd.cluster: %s does not resolve: %s", self._name, e)
            infos = []
        members: Dict[str, Member] = {}
        for addr in sorted({i[4][0] for i in infos})[:MAX_MEMBERS]:
            address = f"{addr}:{self._port}"
            try:
                st = self._stats_of(address)
                member_id = str(getattr(st, "member_id", "")) or addr
                if not MEMBER_ID_RE.match(member_id):
                    raise MemberError(f"member id {member_id[:80]!r} is not valid")
                members[member_id] = Member(
                    member_id=member_id, address=address,
                    backend=getattr(st, "backend", "") or "cpu",
                    capacity_pages=int(getattr(st, "pages_capacity", 0)), page_bytes=0,
                    incarnation=str(getattr(st, "incarnation", "")),
                    version=str(getattr(st, "version", ""))[:64])
            except Exception as e:  # noqa: BLE001 - an unreachable address is no member
                self.rejected += 1
                log.info("kvcd.cluster: %s skipped: %s", address, e)
        self._publish(members)

    def _loop(self) -> None:
        while not self._stop.wait(self._refresh_s):
            self.refresh()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self) -> "DnsMembership":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

