"""The connector's worker side without vLLM: the loads of a step (synchronous, before the
forward), its saves (copied out of the blocks on the forward thread, stored by one
background thread so that a slow daemon never holds the forward), the blocks whose load
failed (vLLM recomputes them) and the counters. ``KvcdConnector`` hands it the engine's
layers and the step's specs; the device tests drive it directly with CUDA tensors laid out
as vLLM's GPU cache.

The transport (:mod:`kvcd.vllm.transfer`) follows ``transport`` in the configuration:
``inline`` (the default) always sends bytes in the messages; ``cuda_ipc`` uses CUDA IPC
buffers on the engine's GPU (caches elsewhere are a ``ValueError``); ``auto`` uses them
when the caches are CUDA tensors and the daemon accepts the buffers (a daemon on
``backend: cuda`` on the same GPU), else inline. The IPC path is opt-in; it has run
with the engine and the daemon on one GPU (tests/test_vllm_gpu.py,
bench/run-h200-vllm-gpu.sh: 10 tests, compute-sanitizer memcheck 0 errors).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence, Set

import torch

import kvcd

from .config import ConnectorConfig
from .specs import LoadSpec, SaveSpec
from .store import Store
from .transfer import InlineTransport, IpcTransport, Staged

log = logging.getLogger("kvcd.vllm")

_FETCH_BYTES = 64 << 20  # default K/V bytes per FetchPages call (fetch_chunk_tokens)


class WorkerTransfers:
    """``count(**counters)`` receives the counters of :mod:`kvcd.vllm.stats`."""

    def __init__(self, store: Store, count: Callable[..., None]) -> None:
        self.store = store
        self.cfg: ConnectorConfig = store.cfg
        self.geometry = store.geometry
        self._count = count
        self.layers: List[torch.Tensor] = []
        self._failed_blocks: Set[int] = set()
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcd-save")
        self._pending_bytes = 0
        self._lock = threading.Lock()
        g = self.geometry
        token_bytes = 4 * g.num_layers * g.num_kv_heads * g.head_dim
        bs = g.block_size
        self.chunk_tokens = self.cfg.fetch_chunk_tokens or \
            max(bs, _FETCH_BYTES // token_bytes // bs * bs)
        self._inline = InlineTransport(store.client, self.cfg.model, g.head_dim)
        self._ipc: Optional[IpcTransport] = None
        self._ipc_refused = False

    # -- the engine's caches and the transport --------------------------------------------

    def set_layers(self, layers: Sequence[torch.Tensor]) -> None:
        """The engine's per-layer caches, in model order."""
        layers = list(layers)
        if self.cfg.transport == "cuda_ipc" and layers and layers[0].device.type != "cuda":
            raise ValueError(f"kvcd connector: transport 'cuda_ipc' needs the engine's KV "
                             f"caches on a CUDA device; they are on {layers[0].device}. Use "
                             f"transport 'inline' or 'auto'")
        self.layers = layers

    def _wants_ipc(self) -> bool:
        return (self.cfg.transport != "inline" and bool(self.layers)
                and self.layers[0].device.type == "cuda" and not self._ipc_refused)

    def transport(self):
        """The transport for the next call: IPC once its buffers are registered (tried on
        each call until then), else inline. With ``transport: cuda_ipc`` an IPC failure is
        raised (the call fails) instead of falling back."""
        if self._ipc is not None or not self._wants_ipc():
            return self._ipc or self._inline
        g = self.geometry
        try:
            self.store.ensure_model()
            profile = self.store.client.profile(self.cfg.model)
            bf16 = profile.history_format in (kvcd.pb.HISTORY_FORMAT_UNSPECIFIED,
                                              kvcd.pb.HISTORY_FORMAT_BF16)
            self._ipc = IpcTransport(
                self.store.client, self.cfg.model, device=self.layers[0].device,
                num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
                block_size=g.block_size, save_bytes=self.cfg.ipc_save_bytes,
                load_tokens=self.chunk_tokens if bf16 else 0)
            log.info("kvcd: CUDA IPC buffers registered (save ring %d bytes, loads %s)",
                     self.cfg.ipc_save_bytes, "through IPC" if bf16 else
                     "inline: the daemon expands compressed pages on its host")
            return self._ipc
        except (kvcd.Unavailable, kvcd.DeadlineExceeded, kvcd.Cancelled):
            raise
        except (kvcd.KvcdError, RuntimeError) as e:
            if self.cfg.transport == "cuda_ipc":
                raise
            self._ipc_refused = True
            log.warning("kvcd: CUDA IPC not available (%s); blocks move inline", e)
            return self._inline

    # -- loads ----------------------------------------------------------------------------

    def load(self, spec: LoadSpec) -> None:
        """Writes the blocks of ``spec`` kvcd still holds; the others are reported by
        :meth:`take_failed_blocks`."""
        bs = self.geometry.block_size
        done = 0  # blocks written
        nbytes = 0
        t0 = time.perf_counter()
        try:
            if not self.store.try_ensure_model("load"):
                raise kvcd.Unavailable("the daemon is being skipped after a failure")
            client = self.store.client
            tr = self.transport()
            seq = client.open_sequence(self.cfg.model, spec.tokens, cache_salt=spec.cache_salt,
                                       auto_renew=False)
            try:
                have = min(len(spec.block_ids),
                           max(0, seq.matched_tokens - spec.first_token) // bs)
                step = self.chunk_tokens // bs
                while done < have:
                    n = min(step, have - done)
                    nbytes += tr.load_chunk(seq, spec.first_token + done * bs, self.layers,
                                            spec.block_ids[done:done + n])
                    done += n
            finally:
                try:
                    seq.close(missing_ok=True)
                except kvcd.KvcdError:
                    pass
            if done < len(spec.block_ids):
                log.warning("kvcd load of request %s: %d of %d blocks still cached; the rest "
                            "is recomputed", spec.req_id, done, len(spec.block_ids))
        except (kvcd.KvcdError, RuntimeError, ValueError) as e:
            self.store.failed(f"load of request {spec.req_id}", e)
        failed = spec.block_ids[done:]
        self._failed_blocks.update(failed)
        self._count(loaded_tokens=done * bs, load_bytes=nbytes,
                    load_seconds=time.perf_counter() - t0, failed_load_blocks=len(failed))

    def take_failed_blocks(self) -> Set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # -- saves ----------------------------------------------------------------------------

    def save(self, spec: SaveSpec) -> None:
        """Copies the blocks of ``spec`` out (forward thread) and queues their ``Put``. With
        CUDA IPC a long save goes in pieces of at most a quarter of the save buffer (each a
        ``Put`` with ``kv_first_token``); a piece that finds the buffer full is copied to the
        host and sent inline instead."""
        if not self.store.available():
            self._count(failed_saves=1)
            return
        try:
            tr = self.transport()
        except (kvcd.KvcdError, RuntimeError) as e:
            self.store.failed(f"save of request {spec.req_id}", e)
            self._count(failed_saves=1)
            return
        g = self.geometry
        block_bytes = 4 * g.num_layers * g.block_size * g.num_kv_heads * g.head_dim
        per_piece = len(spec.block_ids)
        if tr is not self._inline:
            per_piece = max(1, self.cfg.ipc_save_bytes // 4 // block_bytes)
        for i in range(0, len(spec.block_ids), per_piece):
            blocks = spec.block_ids[i:i + per_piece]
            first = spec.first_token + i * g.block_size
            piece = spec if len(blocks) == len(spec.block_ids) else SaveSpec(
                spec.req_id, spec.cache_salt, spec.tokens[:first + len(blocks) * g.block_size],
                first, list(blocks))
            nbytes = block_bytes * len(blocks)
            with self._lock:
                if self._pending_bytes + nbytes > self.cfg.max_pending_save_bytes:
                    self._count(dropped_saves=1)
                    return
                self._pending_bytes += nbytes
            piece_tr = tr
            staged = tr.stage(self.layers, piece)
            if staged is None:  # the IPC save buffer is full: this piece goes inline
                piece_tr = self._inline
                staged = piece_tr.stage(self.layers, piece)
            self._saver.submit(self._put, piece_tr, staged, nbytes)

    def _put(self, tr, s: Staged, nbytes: int) -> None:
        t0 = time.perf_counter()
        try:
            if not self.store.try_ensure_model("save"):
                self._count(failed_saves=1)
                return
            tr.put(s)
            self._count(saved_tokens=len(s.spec.tokens) - s.spec.first_token,
                        save_bytes=s.nbytes, save_seconds=time.perf_counter() - t0)
        except (kvcd.KvcdError, RuntimeError, ValueError) as e:
            self.store.failed(f"save of request {s.spec.req_id}", e)
            self._count(failed_saves=1)
        finally:
            tr.release(s)
            with self._lock:
                self._pending_bytes -= nbytes

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Waits until every queued save has been answered; False on ``timeout``."""
        done = threading.Event()
        try:
            self._saver.submit(done.set)
        except RuntimeError:  # the executor was shut down (interpreter exit): nothing queued
            return True
        return done.wait(timeout)

    def shutdown(self) -> None:
        self.flush(self.cfg.timeout_s)
        self._saver.shutdown(wait=False, cancel_futures=True)
        if self._ipc is not None:
            self._ipc.close()
