"""gRPC codes -> kvcd exceptions: one test per code the daemon produces, with its message."""
import grpc
import numpy as np
import pytest

import kvcd
from conftest import Daemon, random_kv, random_tokens


def test_invalid_argument(client):
    with pytest.raises(kvcd.InvalidArgument) as e:
        client.register_model(name="bad-dim", num_layers=2, num_q_heads=4, num_kv_heads=2,
                              head_dim=12, page_size=4, memory_bytes=1 << 20)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "head_dim" in e.value.message
    # A shape the client cannot check (bare sequence id): the daemon's message names it.
    p = client.profile("tiny")
    toks = random_tokens(8, 30)
    k, v = random_kv(p, 8, 30)
    with client.open_sequence("tiny", toks, k=k, v=v) as seq:
        with pytest.raises(kvcd.InvalidArgument, match="q"):
            client.attention_decode(0, seq.id, np.zeros((1, 3, 16), np.float32))


def test_not_found(client):
    with pytest.raises(kvcd.NotFound, match="no-such-model"):
        client.match("no-such-model", [1, 2, 3, 4])
    with pytest.raises(kvcd.NotFound) as e:
        client.close_sequence(123456789)
    assert isinstance(e.value, kvcd.KvcdError) and "123456789" in str(e.value)


def test_already_exists(client):
    with pytest.raises(kvcd.AlreadyExists, match="tiny"):
        client.register_model(name="tiny", num_layers=3, num_q_heads=4, num_kv_heads=2,
                              head_dim=16, page_size=4, sink_tokens=4, recent_tokens=8,
                              memory_bytes=1 << 20)


def test_failed_precondition(client):
    p = client.profile("tiny")
    toks = random_tokens(8, 31)
    k, v = random_kv(p, 4, 31)
    # A chunk whose prefix (tokens[0:4]) is not cached.
    with pytest.raises(kvcd.FailedPrecondition, match="must already be cached"):
        client.put("tiny", toks, k, v, kv_first_token=4)
    # cuda_ipc tensors on the CPU backend.
    ref = kvcd.pb.TensorRef(dtype=kvcd.pb.DTYPE_F32, shape=[1, 4, 16])
    ref.cuda_ipc.buffer_id, ref.cuda_ipc.size = 1, 256
    with client.open_sequence("tiny", random_tokens(8, 32), k=random_kv(p, 8, 32)[0],
                              v=random_kv(p, 8, 32)[1]) as seq:
        with pytest.raises(kvcd.FailedPrecondition):
            client.attention_decode(0, seq, ref)


def test_resource_exhausted_carries_the_retry_hint(client):
    # 'cramped' holds 4 pages: pin 3 of them, then ask for two more.
    p = client.profile("cramped")
    toks = random_tokens(12, 33)
    k, v = random_kv(p, 12, 33)
    assert client.put("cramped", toks, k, v).inserted_tokens == 12
    with client.open_sequence("cramped", toks) as seq:
        assert seq.matched_tokens == 12
        other = random_tokens(8, 34)
        k2, v2 = random_kv(p, 8, 34)
        with pytest.raises(kvcd.ResourceExhausted) as e:
            client.put("cramped", other, k2, v2)
    assert e.value.retry_after_ms == 50  # the daemon's `grpc-retry-pushback-ms` trailer
    assert e.value.retry_after == pytest.approx(0.05)
    assert e.value.message


def test_retry_pushback_prefers_the_standard_trailer():
    e = kvcd.errors.error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "full",
                                      [("retry-after-ms", "50"), ("grpc-retry-pushback-ms", "7")])
    assert isinstance(e, kvcd.ResourceExhausted) and e.retry_after_ms == 7
    e = kvcd.errors.error_from_status(8, "full", [("grpc-retry-pushback-ms", "-1")])
    assert e.retry_after_ms is None  # negative pushback: no hint
    assert isinstance(kvcd.errors.error_from_status(16, "x"), kvcd.Unauthenticated)
    assert isinstance(kvcd.errors.error_from_status(7, "x"), kvcd.PermissionDenied)


DRAIN_CONFIG = """
listen: 127.0.0.1:0
metrics_listen: ""
memory_budget: 16MiB
drain_timeout_ms: 20000
models: [{builtin: tiny}]
"""


def test_unavailable_while_draining():
    d = Daemon(DRAIN_CONFIG)
    try:
        c = kvcd.Client(d.grpc, timeout=10)
        watch = c.watch_health()
        assert next(watch) == "SERVING"  # an in-flight stream: the drain waits for it
        d.signal_term()
        assert next(watch) == "NOT_SERVING"  # the event: the daemon is draining
        # New calls are refused. kvcd answers UNAVAILABLE ("kvcd is draining") to calls
        # that reach its service after the drain began; once gRPC's server shutdown has
        # started (right after), gRPC itself refuses new calls with CANCELLED.
        with pytest.raises((kvcd.Unavailable, kvcd.Cancelled)) as e:
            c.stats()
        assert e.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        watch.close()  # cancels the watch: the drain finishes early
        c.close()
        assert d.proc.wait(30) == 0
    finally:
        d.stop()


QUOTA_CONFIG = """
listen: 127.0.0.1:0
metrics_listen: ""
memory_budget: 64MiB
models: [{builtin: tiny}]
quotas:
  tenants: [{tenant: team-a, max_models: 1}]
"""


def _profile(name):
    return dict(name=name, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                page_size=4, sink_tokens=4, recent_tokens=8, history_format="bf16",
                memory_bytes=1 << 20)


def test_register_model_counts_against_the_named_tenant():
    d = Daemon(QUOTA_CONFIG)
    try:
        c = kvcd.Client(d.grpc, timeout=10)
        c.register_model(tenant="team-a", **_profile("a1"))
        with pytest.raises(kvcd.ResourceExhausted) as e:
            c.register_model(tenant="team-a", **_profile("a2"))
        assert "max_models" in str(e.value) and "team-a" in str(e.value)
        assert "a2" not in [m.profile.name for m in c.list_models()]  # nothing registered
        c.register_model(tenant="team-b", **_profile("b1"))  # another tenant's quota
        usage = {t.tenant: t for t in c.stats().tenants}
        assert usage["team-a"].registered_models == 1
        assert usage["team-b"].registered_models == 1
        c.close()
    finally:
        d.stop()
