"""The vLLM connector's GPU path (kvcd.vllm.worker / kvcd.vllm.transfer) against a real CUDA
daemon: torch CUDA tensors laid out as vLLM 0.32's GPU KV cache (per layer the physical
[num_blocks, block_size, num_kv_heads, 2 * head_dim] of KVCacheLayout.LBNHC, handed to the
connector as the view [num_blocks, num_kv_heads, block_size, 2 * head_dim]), the blocks
stored through CUDA IPC buffers and loaded back, compared element by element.

No vLLM needed (the worker side imports none). Skipped without torch, without a CUDA device,
or with a daemon built without the CUDA backend. Not run yet: no device this session
(bench/run-h200-vllm-gpu.sh runs it)."""
import os
import signal

import pytest

import kvcd
from conftest import Daemon, random_tokens

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from kvcd.vllm import config as vconfig  # noqa: E402
from kvcd.vllm.specs import LoadSpec, SaveSpec  # noqa: E402
from kvcd.vllm.store import Geometry, Store  # noqa: E402
from kvcd.vllm.transfer import InlineTransport, IpcTransport  # noqa: E402
from kvcd.vllm.worker import WorkerTransfers  # noqa: E402

L, HQ, H, D, BS, NB = 4, 8, 2, 128, 16, 48
GEOMETRY = Geometry(num_layers=L, num_q_heads=HQ, num_kv_heads=H, head_dim=D, block_size=BS)


def daemon_yaml(backend):
    return f"""
listen: 127.0.0.1:0
metrics_listen: ""
backend: {backend}
memory_budget: 512MiB
drain_timeout_ms: 300
"""


def start(backend="cuda"):
    try:
        return Daemon(daemon_yaml(backend))
    except RuntimeError as e:
        if "not available in this build" in str(e):
            pytest.skip("kvcd binary built without the CUDA backend")
        raise


@pytest.fixture(scope="module")
def cuda_daemon():
    d = start()
    yield d
    assert d.stop() == 0, d.log()


def gpu_cache(seed, fill=True):
    """One tensor per layer: physical [NB, BS, H, 2D] BF16, returned as vLLM's view."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    phys = []
    for _ in range(L):
        p = torch.zeros(NB, BS, H, 2 * D, dtype=torch.bfloat16, device="cuda")
        if fill:
            p.copy_(torch.randn(p.shape, generator=g, device="cuda"))
        phys.append(p)
    return phys, [p.permute(0, 2, 1, 3) for p in phys]


def reference_kv(phys, block_ids):
    """K/V [L, n, H, D] read element by element from the physical tensors (host)."""
    n = len(block_ids) * BS
    k = torch.empty(L, n, H, D, dtype=torch.bfloat16)
    v = torch.empty(L, n, H, D, dtype=torch.bfloat16)
    host = [p.cpu() for p in phys]
    for layer in range(L):
        for j, b in enumerate(block_ids):
            for t in range(BS):
                for h in range(H):
                    k[layer, j * BS + t, h] = host[layer][b, t, h, :D]
                    v[layer, j * BS + t, h] = host[layer][b, t, h, D:]
    return k, v


class Counts(dict):
    def __call__(self, **kw):
        for key, value in kw.items():
            self[key] = self.get(key, 0) + value


def worker_for(daemon, layers, model, **extra):
    cfg = vconfig.parse({"target": daemon.grpc, "model": model, "memory_bytes": 96 << 20,
                         **extra}, served_model="test", block_size=BS)
    counts = Counts()
    w = WorkerTransfers(Store(cfg, GEOMETRY, timeout=30.0), counts)
    w.set_layers(layers)
    return w, counts


def stored_kv(client, model, tokens, salt=""):
    with client.open_sequence(model, tokens, cache_salt=salt) as seq:
        assert seq.matched_tokens == len(tokens)
        f = seq.fetch_pages(expand_to_bf16=True, as_torch=True)
    return f.k, f.v


@pytest.mark.parametrize("chunk", [None, 2 * BS])
def test_bf16_blocks_stored_and_loaded_through_ipc(cuda_daemon, chunk):
    model = f"ipc-bf16-{chunk or 0}"
    phys, layers = gpu_cache(1)
    tokens = [int(t) for t in random_tokens(5 * BS + 3, 80)]
    src = [7, 3, 12, 40, 9]
    # A 1 MiB save buffer: the 5-block save goes in two pieces (4 + 1 blocks).
    extra = {"transport": "cuda_ipc", "ipc_save_bytes": 1 << 20}
    if chunk:
        extra["fetch_chunk_tokens"] = chunk
    w, counts = worker_for(cuda_daemon, layers, model, **extra)
    w.save(SaveSpec("a", "", tokens[:5 * BS], 0, src))
    assert w.flush(60)
    assert isinstance(w.transport(), IpcTransport)
    assert counts.get("failed_saves", 0) == 0 and counts.get("dropped_saves", 0) == 0
    assert counts["saved_tokens"] == 5 * BS and counts["save_bytes"] == 4 * L * 5 * BS * H * D
    # Stored: exactly the engine's blocks, read element by element.
    k_ref, v_ref = reference_kv(phys, src)
    with kvcd.Client(cuda_daemon.grpc, timeout=30) as c:
        k, v = stored_kv(c, model, tokens[:5 * BS])
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    # Loaded into other blocks of a fresh engine cache: equal, nothing else touched.
    phys2, layers2 = gpu_cache(2, fill=False)
    w2, counts2 = worker_for(cuda_daemon, layers2, model, **extra)
    dst = [1, 2, 5, 6, 8]
    w2.load(LoadSpec("b", "", tokens[:5 * BS], 0, dst))
    torch.cuda.synchronize()
    assert w2.take_failed_blocks() == set()
    assert counts2["loaded_tokens"] == 5 * BS and counts2["failed_load_blocks"] == 0
    assert w2.transport()._load_buf is not None  # a BF16 model loads through IPC
    for layer in range(L):
        for s, d in zip(src, dst):
            assert torch.equal(phys2[layer][d], phys[layer][s])
        others = [b for b in range(NB) if b not in dst]
        assert phys2[layer][others].abs().sum().item() == 0
    # A load after a local hit of two blocks: only the last three are written.
    phys3, layers3 = gpu_cache(3, fill=False)
    w3, _ = worker_for(cuda_daemon, layers3, model, **extra)
    w3.load(LoadSpec("c", "", tokens[:5 * BS], 2 * BS, [20, 21, 22]))
    torch.cuda.synchronize()
    assert w3.take_failed_blocks() == set()
    for layer in range(L):
        for s, d in zip(src[2:], [20, 21, 22]):
            assert torch.equal(phys3[layer][d], phys[layer][s])
    for x in (w, w2, w3):
        x.shutdown()


def test_save_larger_than_the_ipc_buffer(cuda_daemon):
    """40 blocks (2.6 MB) through a 1 MiB save buffer: pieces of 4 blocks, those that find
    the buffer full go inline; what is stored is the engine's blocks all the same."""
    model = "ipc-ring"
    phys, layers = gpu_cache(11)
    tokens = [int(t) for t in random_tokens(40 * BS, 85)]
    src = list(range(47, 7, -1))
    w, counts = worker_for(cuda_daemon, layers, model, transport="cuda_ipc",
                           ipc_save_bytes=1 << 20)
    w.save(SaveSpec("a", "", tokens, 0, src))
    assert w.flush(60)
    assert counts.get("failed_saves", 0) == 0 and counts["saved_tokens"] == 40 * BS
    k_ref, v_ref = reference_kv(phys, src)
    k, v = stored_kv(w.store.client, model, tokens)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert w.transport()._ring.used() == 0  # every region given back
    w.shutdown()


def test_compressed_model_ipc_save_equals_inline_save(cuda_daemon):
    """int2-oscar (Hadamard): the pages stored from the IPC buffer are byte-identical to the
    ones stored inline; the load (expanded by the daemon, inline) writes the daemon's
    expansion into the blocks."""
    model = "ipc-int2"
    phys, layers = gpu_cache(4)
    tokens = [int(t) for t in random_tokens(6 * BS, 81)]
    src = [30, 31, 2, 17, 11, 44]
    w, counts = worker_for(cuda_daemon, layers, model, history_format="int2-oscar",
                           transport="cuda_ipc")
    w.save(SaveSpec("a", "ipc", tokens, 0, src))
    assert isinstance(w.transport(), IpcTransport)
    inline = InlineTransport(w.store.client, model, D)
    inline.put(inline.stage(layers, SaveSpec("a", "inline", tokens, 0, src)))
    assert w.flush(60) and counts.get("failed_saves", 0) == 0
    with kvcd.Client(cuda_daemon.grpc, timeout=30) as c:
        pages = {}
        for salt in ("ipc", "inline"):
            with c.open_sequence(model, tokens, cache_salt=salt) as seq:
                f = seq.fetch_pages()
                pages[salt] = [(p.format, p.data) for p in f.pages]
        assert [fmt for fmt, _ in pages["ipc"]] == ["bf16"] + ["int2-oscar"] * 5
        assert pages["ipc"] == pages["inline"]
        k_exp, v_exp = stored_kv(c, model, tokens, "ipc")
    phys2, layers2 = gpu_cache(5, fill=False)
    w2, counts2 = worker_for(cuda_daemon, layers2, model, history_format="int2-oscar",
                             transport="cuda_ipc")
    dst = [0, 1, 2, 3, 4, 5]
    w2.load(LoadSpec("b", "ipc", tokens, 0, dst))
    torch.cuda.synchronize()
    assert w2.take_failed_blocks() == set() and counts2["loaded_tokens"] == 6 * BS
    assert w2.transport()._load_buf is None  # compressed pages come expanded, inline
    k_got, v_got = reference_kv(phys2, dst)
    assert torch.equal(k_got, k_exp) and torch.equal(v_got, v_exp)
    for x in (w, w2):
        x.shutdown()


def test_bad_handle_and_region_get_clear_errors(cuda_daemon):
    with kvcd.Client(cuda_daemon.grpc, timeout=30) as c:
        with pytest.raises(kvcd.InvalidArgument, match="ipc_handle has 10 bytes, expected 64"):
            c.register_buffer(b"x" * 10, 1 << 20, b"")
        with pytest.raises(kvcd.InvalidArgument, match="ipc_handle cannot be opened"):
            c.register_buffer(bytes(64), 1 << 20, b"")
    phys, layers = gpu_cache(6)
    model = "ipc-bad"
    w, _ = worker_for(cuda_daemon, layers, model, transport="cuda_ipc")
    tr = w.transport()
    tokens = [int(t) for t in random_tokens(2 * BS, 82)]
    staged = tr.stage(layers, SaveSpec("a", "", tokens, 0, [1, 2]))
    buf = tr._save_buf
    k_ref, v_ref = buf.ref(staged.k), buf.ref(staged.v)
    k_ref.cuda_ipc.size += 16  # the region no longer matches the shape
    with pytest.raises(kvcd.InvalidArgument, match="size"):
        w.store.client.put(model, tokens, k_ref, v_ref)
    k_ref = buf.ref(staged.k)
    k_ref.cuda_ipc.offset = buf.size - 64  # past the registered bytes
    with pytest.raises(kvcd.InvalidArgument, match="covers bytes"):
        w.store.client.put(model, tokens, k_ref, v_ref)
    k_ref = buf.ref(staged.k)
    k_ref.cuda_ipc.buffer_id ^= 1  # not a registered buffer
    with pytest.raises(kvcd.NotFound, match="not registered"):
        w.store.client.put(model, tokens, k_ref, v_ref)
    assert w.store.client.match(model, tokens).matched_tokens == 0  # nothing stored
    tr.release(staged)
    # The daemon dropped the buffer (as after a restart or a lease's end): the transport
    # registers again and the save goes through.
    w.store.client.unregister_buffer(tr._save_buf.buffer_id)
    w.save(SaveSpec("a", "", tokens, 0, [1, 2]))
    assert w.flush(60)
    k, v = stored_kv(w.store.client, model, tokens)
    k_exp, v_exp = reference_kv(phys, [1, 2])
    assert torch.equal(k, k_exp) and torch.equal(v, v_exp)
    w.shutdown()


def test_cpu_daemon_auto_falls_back_inline_and_cuda_ipc_fails():
    d = start("cpu")
    try:
        phys, layers = gpu_cache(7)
        tokens = [int(t) for t in random_tokens(3 * BS, 83)]
        w, counts = worker_for(d, layers, "auto-on-cpu", transport="auto")
        w.save(SaveSpec("a", "", tokens, 0, [4, 5, 6]))
        assert w.flush(60) and counts["saved_tokens"] == 3 * BS
        assert isinstance(w.transport(), InlineTransport)
        strict, scounts = worker_for(d, layers, "auto-on-cpu", transport="cuda_ipc")
        strict.save(SaveSpec("b", "", tokens, 0, [4, 5, 6]))
        assert scounts["failed_saves"] == 1
        with pytest.raises(kvcd.FailedPrecondition):
            strict.transport()
        _, layers2 = gpu_cache(8, fill=False)
        strict.set_layers(layers2)
        strict.load(LoadSpec("c", "", tokens, 0, [0, 1, 2]))
        assert strict.take_failed_blocks() == {0, 1, 2}
        w2, _ = worker_for(d, layers2, "auto-on-cpu", transport="auto")
        w2.load(LoadSpec("c", "", tokens, 0, [0, 1, 2]))
        torch.cuda.synchronize()
        assert w2.take_failed_blocks() == set()
        for layer in range(L):
            assert torch.equal(layers2[layer][:3], layers[layer][4:7])
        for x in (w, strict, w2):
            x.shutdown()
    finally:
        d.stop()


def test_dead_daemon_load_reports_every_block_failed():
    d = start()
    try:
        phys, layers = gpu_cache(9)
        tokens = [int(t) for t in random_tokens(4 * BS, 84)]
        w, counts = worker_for(d, layers, "ipc-dead", transport="cuda_ipc", timeout_s=3.0)
        w.save(SaveSpec("a", "", tokens, 0, [0, 1, 2, 3]))
        assert w.flush(60) and counts["saved_tokens"] == 4 * BS
        phys2, layers2 = gpu_cache(10, fill=False)
        w.set_layers(layers2)
        assert isinstance(w.transport(), IpcTransport)
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait()
        w.load(LoadSpec("b", "", tokens, 0, [10, 11, 12, 13]))
        torch.cuda.synchronize()
        assert w.take_failed_blocks() == {10, 11, 12, 13}
        assert counts["failed_load_blocks"] == 4 and counts.get("loaded_tokens", 0) == 0
        assert all(p.abs().sum().item() == 0 for p in phys2)  # nothing written
        assert not w.store.available()  # backing off: the next steps skip kvcd at once
        w.shutdown()
    finally:
        d.stop()
