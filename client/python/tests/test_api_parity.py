"""kvcd.Client and kvcd.aio.Client: one API, checked statically and by calling every method
of both against the real daemon with the same arguments."""
import asyncio
import inspect
import socket
import ssl
import threading

import numpy as np
import pytest

import kvcd
import kvcd.aio
from kvcd import _api
from conftest import random_kv, random_tokens

PAIRS = [
    (_api.ClientAPI, kvcd.Client, kvcd.aio.Client),
    (_api.SequenceAPI, kvcd.Sequence, kvcd.aio.Sequence),
    (_api.DecodeSessionAPI, kvcd.DecodeSession, kvcd.aio.DecodeSession),
]
# aio methods that are plain functions (they start work or return an object, never wait).
AIO_SYNC = {"decode_session", "start_renewing", "cancel"}


@pytest.mark.parametrize("spec,sync_cls,aio_cls", PAIRS, ids=lambda x: getattr(x, "__name__", ""))
def test_both_clients_have_the_spec_signatures(spec, sync_cls, aio_cls):
    for name in _api.spec_methods(spec):
        want = inspect.signature(getattr(spec, name)).parameters
        for cls in (sync_cls, aio_cls):
            fn = getattr(cls, name)
            assert inspect.signature(fn).parameters == want, f"{cls.__module__}.{name}"
            assert fn.__doc__ == getattr(spec, name).__doc__ and fn.__doc__, name
        aio_fn = getattr(aio_cls, name)
        is_async = inspect.iscoroutinefunction(aio_fn) or inspect.isasyncgenfunction(aio_fn)
        assert is_async == (name not in AIO_SYNC), f"kvcd.aio.{aio_cls.__name__}.{name}"
        assert not inspect.iscoroutinefunction(getattr(sync_cls, name))


def test_a_drifting_class_fails_at_import():
    class Spec:
        def call(self, a: int, *, b: str = "") -> None:
            """doc"""

    with pytest.raises(TypeError, match="differs from the spec"):
        @_api.implements(Spec)
        class Drifted:  # noqa: F841
            def call(self, a: int) -> None:
                pass

    with pytest.raises(TypeError, match="missing"):
        @_api.implements(Spec)
        class Missing:  # noqa: F841
            def other(self) -> None:
                pass


def _outcome(fn):
    """(result, None) or (None, (exception class, message))."""
    try:
        return fn(), None
    except kvcd.KvcdError as e:
        return None, (type(e), e.message)


class Both:
    """Runs the same call on a sync and an async client; the async one in an event loop of
    its own thread (so the sync test can drive both)."""

    def __init__(self, target):
        self.sync = kvcd.Client(target, timeout=20)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.aio = self.run(self._make_aio(target))

    @staticmethod
    async def _make_aio(target):
        c = kvcd.aio.Client(target, timeout=20)
        await c.wait_ready(10)
        return c

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def call(self, method, /, *args, **kwargs):
        """Both clients' outcomes of ``method(*args, **kwargs)``."""
        s = _outcome(lambda: getattr(self.sync, method)(*args, **kwargs))
        a = _outcome(lambda: self.run(getattr(self.aio, method)(*args, **kwargs)))
        return s, a

    def close(self):
        self.sync.close()
        self.run(self.aio.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@pytest.fixture
def both(daemon):
    b = Both(daemon.grpc)
    yield b
    b.close()


def _same_error(s, a):
    assert s[1] is not None and a[1] is not None, (s, a)
    assert s[1] == a[1]


def test_every_client_method_on_both_clients(both, daemon):
    called = set()

    def call(method, /, *args, **kwargs):
        called.add(method)
        return both.call(method, *args, **kwargs)

    # models
    (s, _), (a, _) = call("list_models")
    assert [m.profile.name for m in s] == [m.profile.name for m in a]
    (s, _), (a, _) = call("get_model", "tiny")
    assert s.profile == a.profile
    (s, _), (a, _) = call("profile", "tiny")
    assert s == a
    p = s
    for tenant in ("", "parity"):
        fields = dict(name=f"parity-{tenant or 'default'}", num_layers=1, num_q_heads=4,
                      num_kv_heads=2, head_dim=16, page_size=4, memory_bytes=1 << 16)
        (s, se), (a, ae) = call("register_model", tenant=tenant, **fields)
        assert se is None and ae is None, (se, ae)  # idempotent: the second call is a no-op
        assert s.profile == a.profile
    s, a = call("register_model", name="tiny", num_layers=3, num_q_heads=4, num_kv_heads=2,
                head_dim=16, page_size=4, memory_bytes=1 << 20)
    _same_error(s, a)
    assert s[1][0] is kvcd.AlreadyExists

    # prefix cache
    toks = random_tokens(10, 700)
    k, v = random_kv(p, 10, 700)
    (s, _), (a, _) = call("put", "tiny", toks, k, v, cache_salt="parity")
    assert (s.inserted_tokens, s.ignored_tokens) == (8, 2)
    assert (a.inserted_tokens, a.cached_tokens, a.ignored_tokens) == (0, 8, 2)
    (s, _), (a, _) = call("match", "tiny", toks, cache_salt="parity")
    assert s == a == kvcd.MatchResult(8, 2)

    # prefix pins: each client pins the cached prefix (two pins of the same 2 pages)
    (s, _), (a, _) = call("pin_prefix", "tiny", toks, ttl_ms=60000, cache_salt="parity")
    assert (s.pinned_tokens, s.pinned_pages) == (a.pinned_tokens, a.pinned_pages) == (8, 2)
    assert s.pin_id != a.pin_id and s.expires_unix_ms > 0
    pins = {p.pin_id: p for p in both.sync.stats().pins}
    assert pins[s.pin_id].tenant == "parity" and pins[a.pin_id].pinned_pages == 2
    assert both.sync.unpin_prefix(s.pin_id) == both.run(both.aio.unpin_prefix(a.pin_id)) == 2
    called.add("unpin_prefix")
    s, a = call("unpin_prefix", s.pin_id)
    _same_error(s, a)
    assert s[1][0] is kvcd.NotFound
    s, a = call("pin_prefix", "tiny", toks, ttl_ms=0, cache_salt="parity")
    _same_error(s, a)
    assert s[1][0] is kvcd.InvalidArgument and "ttl_ms is 0" in s[1][1]

    # sequences: open on both, append, renew, attention, pages, close
    (ss, _), (sa, _) = call("open_sequence", "tiny", toks, cache_salt="parity", lease_ms=5000,
                            auto_renew=False)
    assert ss.matched_tokens == sa.matched_tokens == 8
    assert ss.pending_tokens == sa.pending_tokens
    kr, vr = k[:, 8:], v[:, 8:]
    assert both.sync.append(ss, toks[8:], kr, vr) == 10
    called.add("append")
    assert both.run(both.aio.append(sa, toks[8:], kr, vr)) == 10
    assert both.sync.renew_lease(ss, 4000) == both.run(both.aio.renew_lease(sa, 4000)) == 4000
    called.add("renew_lease")
    q = np.random.default_rng(5).standard_normal((1, p.num_q_heads, p.head_dim)).astype(
        np.float32)
    rs = both.sync.attention_decode(1, ss, q)
    ra = both.run(both.aio.attention_decode(1, sa, q))
    called.add("attention_decode")
    np.testing.assert_array_equal(rs.o, ra.o)
    np.testing.assert_array_equal(rs.lse, ra.lse)
    fs = both.sync.fetch_pages(ss, expand_to_bf16=True)
    fa = both.run(both.aio.fetch_pages(sa, expand_to_bf16=True))
    called.add("fetch_pages")
    np.testing.assert_array_equal(fs.k, fa.k)
    stored = both.sync.fetch_pages(ss)
    (s, _), (a, _) = call("push_pages", "tiny", toks, stored, cache_salt="parity-push")
    assert (s, a) == (8, 0)
    with both.sync.decode_session() as ds:
        o1 = ds.attend(0, ss, q).o

    async def aio_session():
        async with both.aio.decode_session() as da:
            return (await da.attend(0, sa, q)).o

    called.add("decode_session")
    np.testing.assert_array_equal(o1, both.run(aio_session()))
    # sessions: a commit that keeps the sequence open, a fork of it
    assert both.sync.commit_sequence(ss) == both.run(both.aio.commit_sequence(sa)) == \
        kvcd.CommitResult(8, 0, 0)
    called.add("commit_sequence")
    fs = both.sync.fork_sequence(ss, lease_ms=5000)
    fa = both.run(both.aio.fork_sequence(sa, lease_ms=5000))
    called.add("fork_sequence")
    assert (fs.length, fs.lease_ms, fs.renewing) == (fa.length, fa.lease_ms, fa.renewing) == \
        (10, 5000, False)
    assert both.sync.close_sequence(fs, commit=True) == \
        both.run(both.aio.close_sequence(fa, commit=True)) == 10
    assert fs.last_commit == fa.last_commit == kvcd.CommitResult(8, 0, 0)
    assert both.sync.close_sequence(ss) == both.run(both.aio.close_sequence(sa)) == 10
    called.add("close_sequence")
    _same_error(*call("renew_lease", ss.id))
    _same_error(*call("close_sequence", ss.id))
    _same_error(*call("close_sequence", ss.id, commit=True))
    _same_error(*call("commit_sequence", ss.id))
    _same_error(*call("fork_sequence", ss.id, lease_ms=5000))

    # cluster: a daemon without a cluster section refuses a pull alike on both clients
    s, a = call("pull_prefix", "tiny", toks, "peer-0", cache_salt="parity")
    _same_error(s, a)

    # stats and health
    (s, _), (a, _) = call("stats")
    assert s.backend == a.backend == "cpu"
    (s, _), (a, _) = call("health")
    assert s == a == "SERVING"
    it = both.sync.watch_health()
    assert next(it) == "SERVING"
    it.close()

    async def aio_watch():
        gen = both.aio.watch_health()
        first = await gen.__anext__()
        await gen.aclose()
        return first

    assert both.run(aio_watch()) == "SERVING"
    called.add("watch_health")

    # data plane: the CPU backend refuses these the same way on both clients
    for name, args in (("register_buffer", (b"\0" * 64, 4096, b"\0" * 64)),
                       ("unregister_buffer", (12345,)), ("renew_buffer", (12345,)),
                       ("nccl_connect", ("x",)), ("nccl_disconnect", (12345,)),
                       ("open_decode_channel", ("/kvcd-parity-none",)),
                       ("close_decode_channel", (12345,))):
        _same_error(*call(name, *args))

    # wait_ready and close are exercised by the fixture (Both) and below
    called.update({"wait_ready", "close"})
    assert called == set(_api.spec_methods(_api.ClientAPI)), \
        set(_api.spec_methods(_api.ClientAPI)) - called


def test_calls_after_close_raise_a_kvcd_error(daemon):
    c = kvcd.Client(daemon.grpc)
    c.close()
    with pytest.raises(kvcd.Cancelled, match="closed"):
        c.stats()
    with pytest.raises(kvcd.Cancelled, match="closed"):
        c.health()

    async def main():
        a = kvcd.aio.Client(daemon.grpc)
        await a.close()
        with pytest.raises(kvcd.Cancelled, match="closed"):
            await a.stats()
        with pytest.raises(kvcd.Cancelled, match="closed"):
            a.decode_session()

    asyncio.run(main())


def _self_signed_tls_listener():
    """A loopback TLS server socket (self-signed certificate made with the ssl module's
    test helper is not public, so the certificate comes from the openssl CLI)."""
    import subprocess
    import tempfile

    d = tempfile.mkdtemp(prefix="kvcd-tls-probe-")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj",
                    "/CN=localhost", "-days", "1", "-keyout", f"{d}/k.pem", "-out",
                    f"{d}/c.pem"], check=True, capture_output=True)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(f"{d}/c.pem", f"{d}/k.pem")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    stop = threading.Event()

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            try:
                with ctx.wrap_socket(conn, server_side=True) as t:
                    t.recv(1)
            except (OSError, ssl.SSLError):
                pass

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    return srv, stop, th


def test_plaintext_client_on_a_tls_port_is_told_so():
    srv, stop, th = _self_signed_tls_listener()
    target = f"127.0.0.1:{srv.getsockname()[1]}"
    try:
        with pytest.raises(kvcd.Unavailable, match="speaks TLS"):
            kvcd.Client(target, wait_ready=1.0)

        async def main():
            a = kvcd.aio.Client(target)
            try:
                with pytest.raises(kvcd.Unavailable, match="speaks TLS"):
                    await a.wait_ready(1.0)
            finally:
                await a.close()

        asyncio.run(main())
    finally:
        stop.set()
        th.join()
        srv.close()


def test_tls_client_on_a_plaintext_port_is_told_so(daemon):
    with pytest.raises(kvcd.Unavailable, match="does not speak TLS"):
        kvcd.Client(daemon.grpc, tls=True, wait_ready=1.0)


def test_nothing_listening_is_told_so():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(kvcd.Unavailable, match="nothing accepts connections"):
        kvcd.Client(f"127.0.0.1:{port}", wait_ready=0.5)
