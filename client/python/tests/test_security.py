"""TLS/mTLS and bearer-token options.

The daemon on this branch serves plaintext only, so these tests check what the client
puts on the wire against a small gRPC server of the test's own: the ``authorization:
Bearer <token>`` metadata on unary calls, streams and health checks, and TLS / mTLS
handshakes with a CA the test creates (openssl CLI). Against the real plaintext daemon
the options must be harmless when unset (every other test) and a token is ignored.
"""
import shutil
import subprocess
from concurrent import futures

import grpc
import numpy as np
import pytest

import kvcd
from kvcd._health import health_pb2


class Recorder:
    """Serves Stats, AttentionDecodeStream and Health/Check; records the metadata."""

    def __init__(self, token):
        self.token = token
        self.seen = []

    def _auth(self, context, method):
        md = dict(context.invocation_metadata())
        self.seen.append((method, md.get("authorization")))
        if self.token is None:
            return
        if "authorization" not in md:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")
        if md["authorization"] != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "token not accepted")

    def handlers(self):
        def stats(req, context):
            self._auth(context, "Stats")
            return kvcd.pb.StatsResponse(backend="test", version="0")

        def stream(requests, context):
            self._auth(context, "AttentionDecodeStream")
            for r in requests:
                resp = kvcd.pb.AttentionDecodeStreamResponse(request_id=r.request_id)
                resp.response.o.CopyFrom(kvcd.tensors.to_tensor_ref(np.zeros((1, 1, 8), np.float32)))
                resp.response.lse.CopyFrom(kvcd.tensors.to_tensor_ref(np.zeros((1, 1), np.float32)))
                yield resp

        def check(req, context):
            self._auth(context, "Health")
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

        kv = grpc.method_handlers_generic_handler("kvcd.v1.KvCache", {
            "Stats": grpc.unary_unary_rpc_method_handler(
                stats, kvcd.pb.StatsRequest.FromString,
                kvcd.pb.StatsResponse.SerializeToString),
            "AttentionDecodeStream": grpc.stream_stream_rpc_method_handler(
                stream, kvcd.pb.AttentionDecodeRequest.FromString,
                kvcd.pb.AttentionDecodeStreamResponse.SerializeToString),
        })
        health = grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
            "Check": grpc.unary_unary_rpc_method_handler(
                check, health_pb2.HealthCheckRequest.FromString,
                health_pb2.HealthCheckResponse.SerializeToString),
        })
        return (kv, health)


def serve(recorder, credentials=None):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers(recorder.handlers())
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, port


def exercise(c):
    c.stats()
    with c.decode_session() as s:
        s.attend(0, [1], np.zeros((1, 1, 8), np.float32))
    assert c.health() == "SERVING"


def test_token_is_sent_on_every_call():
    rec = Recorder("s3cret")
    server, port = serve(rec)
    try:
        with kvcd.Client(f"127.0.0.1:{port}", token="s3cret") as c:
            exercise(c)
        assert rec.seen == [("Stats", "Bearer s3cret"), ("AttentionDecodeStream", "Bearer s3cret"),
                            ("Health", "Bearer s3cret")]
        with kvcd.Client(f"127.0.0.1:{port}") as c:
            with pytest.raises(kvcd.Unauthenticated, match="missing bearer token"):
                c.stats()
        with kvcd.Client(f"127.0.0.1:{port}", token="wrong") as c:
            with pytest.raises(kvcd.PermissionDenied, match="token not accepted"):
                c.stats()
    finally:
        server.stop(None)


def test_token_with_the_asyncio_client():
    import asyncio

    rec = Recorder("s3cret")
    server, port = serve(rec)

    async def main():
        async with kvcd.aio.Client(f"127.0.0.1:{port}", token="s3cret") as c:
            await c.stats()
            async with c.decode_session() as s:
                await s.attend(0, [1], np.zeros((1, 1, 8), np.float32))
            assert await c.health() == "SERVING"
        async with kvcd.aio.Client(f"127.0.0.1:{port}") as c:
            with pytest.raises(kvcd.Unauthenticated):
                await c.stats()

    try:
        asyncio.run(main())
        assert [a for _, a in rec.seen[:3]] == ["Bearer s3cret"] * 3
    finally:
        server.stop(None)


def test_token_options_are_validated():
    with pytest.raises(ValueError):
        kvcd.Client("127.0.0.1:1", token="a\nb", wait_ready=None)
    with pytest.warns(UserWarning, match="without TLS"):
        kvcd.Client("10.1.2.3:50051", token="t", wait_ready=None).close()


def test_token_is_harmless_on_a_plaintext_daemon(daemon):
    with kvcd.Client(daemon.grpc, token="ignored-by-this-daemon") as c:
        assert c.health() == "SERVING" and c.stats().backend == "cpu"


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
             "/CN=kvcd-test-ca", "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
             "/CN=unrelated-ca", "-keyout", "other.key", "-out", "other.pem", cwd=d)
    for name, ext in (("server", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
                      ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=kvcd-{name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext",
                 "-out", f"{name}.pem", cwd=d)
    return d


def test_tls_with_root_ca_file_and_bytes(pki):
    creds = grpc.ssl_server_credentials(
        [((pki / "server.key").read_bytes(), (pki / "server.pem").read_bytes())])
    rec = Recorder("tok")
    server, port = serve(rec, creds)
    try:
        with kvcd.Client(f"localhost:{port}", tls=kvcd.TLS(root_certificates=pki / "ca.pem"),
                         token="tok") as c:
            exercise(c)
        # CA as bytes, reached by IP with the certificate's name checked as 'localhost'.
        tls = kvcd.TLS(root_certificates=(pki / "ca.pem").read_bytes(), server_name="localhost")
        with kvcd.Client(f"127.0.0.1:{port}", tls=tls, token="tok") as c:
            assert c.stats().backend == "test"
        # A plaintext client cannot talk to a TLS server; an untrusting one neither.
        with pytest.raises(kvcd.Unavailable):
            kvcd.Client(f"localhost:{port}", wait_ready=1.0)
        other = kvcd.TLS(root_certificates=(pki / "other.pem").read_bytes())
        with pytest.raises(kvcd.Unavailable):
            kvcd.Client(f"localhost:{port}", tls=other, wait_ready=1.0)
    finally:
        server.stop(None)


def test_mutual_tls(pki):
    creds = grpc.ssl_server_credentials(
        [((pki / "server.key").read_bytes(), (pki / "server.pem").read_bytes())],
        root_certificates=(pki / "ca.pem").read_bytes(), require_client_auth=True)
    server, port = serve(Recorder(None), creds)
    try:
        mtls = kvcd.TLS(root_certificates=pki / "ca.pem", client_certificate=pki / "client.pem",
                        client_key=pki / "client.key")
        with kvcd.Client(f"localhost:{port}", tls=mtls) as c:
            assert c.stats().backend == "test"
        # Without the client certificate the handshake fails.
        with pytest.raises(kvcd.KvcdError) as e:
            with kvcd.Client(f"localhost:{port}", tls=kvcd.TLS(root_certificates=pki / "ca.pem"),
                             wait_ready=None) as c:
                c.stats()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(ValueError, match="both client_certificate and client_key"):
            kvcd.TLS(client_certificate=pki / "client.pem").channel_credentials()
        with pytest.raises(ValueError, match="cannot read"):
            kvcd.TLS(root_certificates=pki / "missing.pem").channel_credentials()
    finally:
        server.stop(None)
