"""The connector's worker side (kvcd.vllm.worker) on the CPU with a real daemon: blocks saved
and loaded inline (chunked fetches), the transport chosen from the configuration, a dead
daemon's load reported block by block, and kvcd's stored BF16 pages read as the CUDA IPC
load reads them (layout.scatter_bf16_pages on the bytes FetchPages returns as stored), so
that the page layout the GPU path relies on is checked against the daemon here. The IPC
transport itself needs a GPU: tests/test_vllm_gpu.py."""
import importlib.util
import os
import signal
from pathlib import Path

import pytest
import torch

import kvcd
from kvcd.vllm import config as vconfig
from kvcd.vllm import layout
from kvcd.vllm.specs import LoadSpec, SaveSpec
from kvcd.vllm.store import Geometry, Store
from kvcd.vllm.transfer import InlineTransport
from kvcd.vllm.worker import WorkerTransfers

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("kvcd_test_daemon",
                                               HERE.parent / "tests" / "conftest.py")
_daemon_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_daemon_mod)
Daemon = _daemon_mod.Daemon

L, HQ, H, D, BS, NB = 2, 4, 2, 64, 16, 12
GEOMETRY = Geometry(num_layers=L, num_q_heads=HQ, num_kv_heads=H, head_dim=D, block_size=BS)
YAML = "listen: 127.0.0.1:0\nmetrics_listen: \"\"\nbackend: cpu\nmemory_budget: 128MiB\n" \
       "drain_timeout_ms: 300\n"


@pytest.fixture(scope="module")
def daemon():
    d = Daemon(YAML)
    yield d
    assert d.stop() == 0, d.log()


class Counts(dict):
    def __call__(self, **kw):
        for key, value in kw.items():
            self[key] = self.get(key, 0) + value


def worker_for(d, model, layers, **extra):
    cfg = vconfig.parse({"target": d.grpc, "model": model, "memory_bytes": 16 << 20, **extra},
                        served_model="test", block_size=BS)
    counts = Counts()
    w = WorkerTransfers(Store(cfg, GEOMETRY, timeout=10.0), counts)
    w.set_layers(layers)
    return w, counts


def cpu_cache(seed, fill=True):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NB, H, BS, 2 * D, generator=g).to(torch.bfloat16) if fill
            else torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]


def tokens_of(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 30000, (n,), generator=g).tolist()


def test_inline_blocks_saved_and_loaded_in_chunks(daemon):
    src_cache = cpu_cache(1)
    toks = tokens_of(5 * BS, 1)
    w, counts = worker_for(daemon, "w-inline", src_cache, fetch_chunk_tokens=2 * BS)
    assert isinstance(w.transport(), InlineTransport)  # the default
    src = [7, 3, 11, 0, 9]
    w.save(SaveSpec("a", "", toks, 0, src))
    assert w.flush(30)
    assert counts["saved_tokens"] == 5 * BS and counts.get("failed_saves", 0) == 0
    dst_cache = cpu_cache(2, fill=False)
    w.set_layers(dst_cache)
    dst = [1, 2, 4, 5, 6]
    w.load(LoadSpec("b", "", toks, 0, dst))  # three FetchPages calls (2 + 2 + 1 blocks)
    assert w.take_failed_blocks() == set()
    assert counts["loaded_tokens"] == 5 * BS and counts["load_bytes"] == 4 * L * 5 * BS * H * D
    for layer in range(L):
        assert torch.equal(dst_cache[layer][dst], src_cache[layer][src])
        assert dst_cache[layer][[0, 3, 7, 8, 9, 10, 11]].abs().sum() == 0
    # After a local hit of two blocks only the other three are fetched and written.
    third = cpu_cache(3, fill=False)
    w.set_layers(third)
    w.load(LoadSpec("c", "", toks, 2 * BS, [8, 9, 10]))
    assert w.take_failed_blocks() == set()
    for layer in range(L):
        assert torch.equal(third[layer][[8, 9, 10]], src_cache[layer][src[2:]])
    w.shutdown()


@pytest.mark.parametrize("gpu_view", [False, True])
def test_stored_bf16_pages_are_read_as_the_ipc_load_reads_them(daemon, monkeypatch, gpu_view):
    """FetchPages as stored (what the IPC load receives in its buffer) for a BF16 model:
    [pages][layers][K, V][heads][tokens][dims] BF16, written into blocks equal to the
    saved ones, in the CPU block and in the GPU backends' view."""
    if gpu_view:
        monkeypatch.setattr(layout, "_cpu_block", lambda cache: False)

    def cache(seed, fill=True):
        if not gpu_view:
            return cpu_cache(seed, fill)
        g = torch.Generator().manual_seed(seed)
        phys = [torch.randn(NB, BS, H, 2 * D, generator=g).to(torch.bfloat16) if fill
                else torch.zeros(NB, BS, H, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
        return [p.permute(0, 2, 1, 3) for p in phys]  # vLLM's view of the LBNHC layer

    src_cache = cache(4)
    toks = tokens_of(3 * BS, 4 + gpu_view)
    model = f"w-pages-{int(gpu_view)}"
    w, _ = worker_for(daemon, model, src_cache)
    src = [10, 2, 6]
    w.save(SaveSpec("a", "", toks, 0, src))
    assert w.flush(30)
    with w.store.client.open_sequence(model, toks) as seq:
        got = seq.fetch_pages()  # as stored, inline
    assert [p.format for p in got.pages] == ["bf16"] * 3
    data = b"".join(p.data for p in got.pages)
    page_bytes = L * 2 * H * BS * D * 2  # IpcTransport.page_bytes
    assert len(data) == 3 * page_bytes
    pages = torch.frombuffer(bytearray(data), dtype=torch.bfloat16).view(3, L, 2, H, BS, D)
    dst_cache = cache(5, fill=False)
    layout.scatter_bf16_pages(dst_cache, [0, 1, 2], pages)
    for layer in range(L):
        assert torch.equal(dst_cache[layer][[0, 1, 2]], src_cache[layer][src])
    w.shutdown()


def test_transport_from_the_configuration(daemon):
    layers = cpu_cache(6)
    with pytest.raises(ValueError, match="transport 'cuda_ipc' needs the engine's KV caches "
                                         "on a CUDA device; they are on cpu"):
        worker_for(daemon, "w-sel", layers, transport="cuda_ipc")
    w, _ = worker_for(daemon, "w-sel", layers, transport="auto")
    assert isinstance(w.transport(), InlineTransport)  # CPU caches: nothing to register
    assert w.store.client.stats() is not None
    w.shutdown()


def test_dead_daemon_load_fails_every_block_and_saves_are_skipped():
    d = Daemon(YAML)
    try:
        src_cache = cpu_cache(7)
        toks = tokens_of(3 * BS, 7)
        w, counts = worker_for(d, "w-dead", src_cache, backoff_s=30.0)
        w.save(SaveSpec("a", "", toks, 0, [0, 1, 2]))
        assert w.flush(30) and counts["saved_tokens"] == 3 * BS
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait()
        dst_cache = cpu_cache(8, fill=False)
        w.set_layers(dst_cache)
        w.load(LoadSpec("b", "", toks, 0, [5, 6, 7]))
        assert w.take_failed_blocks() == {5, 6, 7}
        assert counts["failed_load_blocks"] == 3 and counts["loaded_tokens"] == 0
        assert all(c.abs().sum() == 0 for c in dst_cache)  # nothing half-written
        assert not w.store.available()  # backing off
        w.save(SaveSpec("c", "", toks, 0, [0, 1, 2]))  # skipped at once, counted
        assert counts["failed_saves"] == 1
        w.shutdown()
    finally:
        d.stop()


def test_saves_beyond_the_pending_bytes_are_dropped(daemon):
    w, counts = worker_for(daemon, "w-drop", cpu_cache(9), max_pending_save_bytes=1000)
    w.save(SaveSpec("a", "", tokens_of(BS, 9), 0, [0]))
    assert w.flush(30)
    assert counts["dropped_saves"] == 1 and counts.get("saved_tokens", 0) == 0
    assert w.store.match(tokens_of(BS, 9), "") == 0  # nothing stored
    w.shutdown()
