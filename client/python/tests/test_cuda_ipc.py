"""CUDA IPC buffers with a daemon on `backend: cuda`: torch CUDA tensors registered once,
then put / attention_decode / fetch_pages through cuda_ipc regions (nothing inline).

Skipped without torch, without a CUDA device, or with a daemon binary built without the
CUDA backend. Command for the H200 machine: client/python/README.md ("CUDA IPC tests")."""
import numpy as np
import pytest

import kvcd
from conftest import Daemon, bf16_round, random_kv, random_tokens, reference_attention

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import kvcd.cuda  # noqa: E402

CUDA_CONFIG = """
listen: 127.0.0.1:0
metrics_listen: ""
backend: cuda
memory_budget: 256MiB
drain_timeout_ms: 300
models:   # the CUDA kernels serve head_dim 64/128/256 (as tests/integration/data_plane_test.cc)
  - name: small
    num_layers: 2
    num_q_heads: 8
    num_kv_heads: 2
    head_dim: 128
    page_size: 64
    sink_tokens: 64
    recent_tokens: 128
    history_format: int2-oscar
    memory: 96MiB
    bf16_fraction: 0.5
  - name: small-bf16
    num_layers: 2
    num_q_heads: 8
    num_kv_heads: 2
    head_dim: 128
    page_size: 64
    sink_tokens: 64
    recent_tokens: 128
    memory: 64MiB
"""


@pytest.fixture(scope="module")
def cuda_daemon():
    try:
        d = Daemon(CUDA_CONFIG)
    except RuntimeError as e:
        if "not available in this build" in str(e):
            pytest.skip("kvcd binary built without the CUDA backend")
        raise
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture
def cclient(cuda_daemon):
    with kvcd.Client(cuda_daemon.grpc, timeout=30) as c:
        yield c


@pytest.mark.parametrize("model", ["small-bf16", "small"])
def test_put_attend_fetch_through_ipc_regions(cclient, model):
    c = cclient
    p = c.profile(model)
    n = 256  # 4 pages: a BF16 sink page, then 3 history pages (INT2 for 'small')
    toks = random_tokens(n, 70)
    k, v = random_kv(p, n, 70)
    backing = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    with kvcd.cuda.CudaIpcBuffer(c, backing, name="pytest") as buf:
        assert buf.buffer_id is not None and buf.lease_ms > 0
        kd = buf.view(torch.bfloat16, k.shape)
        vd = buf.view(torch.bfloat16, v.shape)
        kd.copy_(torch.from_numpy(k).to("cuda", torch.bfloat16))
        vd.copy_(torch.from_numpy(v).to("cuda", torch.bfloat16))
        buf.mark_ready()
        r = c.put(model, toks, buf.ref(kd), buf.ref(vd))
        assert r.inserted_tokens == n
        with c.open_sequence(model, toks) as seq:
            # One more token appended through the buffer.
            k1 = buf.view(torch.bfloat16, (p.num_layers, 1, p.num_kv_heads, p.head_dim))
            v1 = buf.view(torch.bfloat16, (p.num_layers, 1, p.num_kv_heads, p.head_dim))
            k1.copy_(kd[:, :1])
            v1.copy_(vd[:, :1])
            buf.mark_ready()
            assert seq.append([5], buf.ref(k1), buf.ref(v1)) == n + 1
            # Inline reference of the same call.
            q = torch.randn(1, p.num_q_heads, p.head_dim, generator=torch.Generator().manual_seed(1))
            o_inline, lse_inline = seq.attention_decode(1, q)
            qd = buf.view(torch.float32, q.shape)
            od = buf.view(torch.float32, q.shape)
            lsed = buf.view(torch.float32, (1, p.num_q_heads))
            od.fill_(float("nan"))
            qd.copy_(q.to("cuda"))
            buf.mark_ready()
            res = c.attention_decode(1, [seq], buf.ref(qd), o_out=buf.ref(od),
                                     lse_out=buf.ref(lsed))
            assert res.o is None and res.lengths == (n + 1,)
            buf.wait_done()
            torch.testing.assert_close(od.cpu(), o_inline, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lsed.cpu(), lse_inline, rtol=1e-5, atol=1e-5)
            if model == "small-bf16":
                k_all = np.concatenate([k[1], k[1, :1]])  # the appended token repeats token 0
                v_all = np.concatenate([v[1], v[1, :1]])
                ro, _ = reference_attention(q[0].numpy(), bf16_round(k_all), bf16_round(v_all))
                np.testing.assert_allclose(od[0].cpu().numpy(), ro, rtol=1e-3, atol=1e-4)
            # Stored pages into the device buffer, byte-identical to the inline answer.
            inline = seq.fetch_pages()
            total = sum(len(pg.data) for pg in inline.pages)
            dst = buf.view(torch.uint8, (total,))
            buf.mark_ready()
            dev = seq.fetch_pages(destination=buf.ref(dst))
            assert dev.page_formats == inline.page_formats
            if model == "small":
                assert inline.page_formats == ["bf16"] + ["int2-oscar"] * 3 + ["bf16"]  # + recent
            buf.wait_done()
            assert bytes(dst.cpu().numpy()) == b"".join(pg.data for pg in inline.pages)
            assert buf.renew() > 0
            buffer_id = buf.buffer_id
    # Unregistered on exit: the id is gone.
    with pytest.raises(kvcd.NotFound):
        c.renew_buffer(buffer_id)


def test_tensor_inside_a_shared_allocator_segment(cclient):
    """torch's caching allocator packs small tensors into one segment: the region offset
    is relative to the segment base that the IPC handle maps."""
    c = cclient
    p = c.profile("small-bf16")
    pad = torch.empty(4096, dtype=torch.uint8, device="cuda")  # noqa: F841 (occupies the segment start)
    t = torch.empty(512 << 10, dtype=torch.uint8, device="cuda")  # same 2 MiB small-pool segment
    buf = kvcd.cuda.CudaIpcBuffer(c, t)
    try:
        assert buf.offset_of(t) >= 0 and buf.size >= buf.offset_of(t) + t.numel()
        # The driver's view (allocation base, handle) agrees with torch's own sharing.
        shared = t.untyped_storage()._share_cuda_()
        assert buf.ipc_handle in bytes(shared[1])
        assert buf.offset_of(t) == int(shared[3]) + (t.data_ptr() - t.untyped_storage().data_ptr())
        n = 64
        toks = random_tokens(n, 71)
        k, v = random_kv(p, n, 71)
        kd = buf.view(torch.float32, k.shape)
        vd = buf.view(torch.float32, v.shape)
        kd.copy_(torch.from_numpy(k).cuda())
        vd.copy_(torch.from_numpy(v).cuda())
        buf.mark_ready()
        assert c.put("small-bf16", toks, buf.ref(kd), buf.ref(vd)).inserted_tokens == n
        with c.open_sequence("small-bf16", toks) as seq:
            f = seq.fetch_pages(expand_to_bf16=True)
            np.testing.assert_array_equal(f.k, bf16_round(k))
    finally:
        buffer_id = buf.buffer_id
        buf.unregister()
    with pytest.raises(kvcd.NotFound):
        c.renew_buffer(buffer_id)
