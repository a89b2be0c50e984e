"""The two ways the worker side moves whole blocks between the engine's KV caches and kvcd.

:class:`InlineTransport` (every device, every history format): K/V travel inside the gRPC
messages. A save copies the blocks to host memory on the forward thread and ``Put`` sends
them; a load fetches the blocks expanded to BF16 (``FetchPages(expand_to_bf16)``) and
writes them into the engine's blocks.

:class:`IpcTransport` (an engine on a CUDA device with a daemon on ``backend: cuda`` on the
same GPU): kvcd's CUDA IPC data plane (:mod:`kvcd.cuda`). Two buffers on the engine's GPU
are registered with the daemon once:

- saves: the blocks are gathered into a region of the save buffer on the engine's current
  stream, whose ready event is then recorded; ``Put`` names the region (``cuda_ipc``), the
  daemon's stream waits on that event and reads the rows device to device (encoding them
  on the GPU for a compressed format). ``Put`` answers once they are stored, and the
  region is then reused. The save buffer is a ring: regions are given out and returned in
  the order of the saves (one save thread).
- loads of a BF16-history model: ``FetchPages`` writes the pages as stored into the load
  buffer (``destination``, device to device), the engine's stream waits on the daemon's
  done event and scatters the pages into the blocks, then records the ready event so that
  the next fetch into the buffer waits for that scatter. Nothing waits on the host.
  A compressed model's pages are expanded by the daemon on its host (there is no device
  destination for expanded K/V in ``FetchPages``), so those loads stay inline.

Buffers live as long as the daemon keeps them: when an IPC call answers NOT_FOUND (the
buffer's lease ran out while the engine was idle, or the daemon restarted), the buffers are
registered again and the call is retried once.
"""
from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

import torch

import kvcd

from . import layout
from .specs import SaveSpec

log = logging.getLogger("kvcd.vllm")

_ALIGN = 256


@dataclass
class Staged:
    """A save copied out of the engine's blocks, waiting for its ``Put``."""
    spec: SaveSpec
    nbytes: int           # K and V bytes of the save
    k: Any = None         # inline: host tensors; IPC: views of the save buffer
    v: Any = None
    region: Optional[Tuple[int, int]] = None  # IPC: [start, end) in the save buffer


class InlineTransport:
    name = "inline"

    def __init__(self, client: kvcd.Client, model: str, head_dim: int) -> None:
        self.client, self.model, self.head_dim = client, model, head_dim

    def stage(self, layers: Sequence[torch.Tensor], spec: SaveSpec) -> Optional[Staged]:
        k, v = layout.gather(layers, spec.block_ids, self.head_dim)
        return Staged(spec, k.numel() * k.element_size() * 2, k, v)

    def put(self, s: Staged) -> None:
        self.client.put(self.model, s.spec.tokens, s.k, s.v, cache_salt=s.spec.cache_salt,
                        kv_first_token=s.spec.first_token)

    def release(self, s: Staged) -> None:
        s.k = s.v = None

    def load_chunk(self, seq: Any, first_token: int, layers: Sequence[torch.Tensor],
                   block_ids: Sequence[int]) -> int:
        """Fetches ``len(block_ids)`` blocks from ``first_token`` and writes them; returns
        the K/V bytes moved."""
        bs = layers[0].shape[2]
        got = self.client.fetch_pages(seq, first_token=first_token,
                                      num_tokens=len(block_ids) * bs, expand_to_bf16=True,
                                      as_torch=True)
        layout.scatter(layers, block_ids, got.k, got.v)
        return got.k.numel() * got.k.element_size() * 2

    def close(self) -> None:
        pass


class _Ring:
    """Regions of ``capacity`` bytes given out and returned in the same order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._live: "collections.deque[Tuple[int, int]]" = collections.deque()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Optional[Tuple[int, int]]:
        n = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        with self._lock:
            if n > self.capacity:
                return None
            if not self._live:
                start = 0
            else:
                oldest, newest_end = self._live[0][0], self._live[-1][1]
                wrapped = self._live[-1][0] < oldest
                if wrapped:
                    start = newest_end if newest_end + n <= oldest else None
                elif newest_end + n <= self.capacity:
                    start = newest_end
                else:
                    start = 0 if n <= oldest else None
            if start is None:
                return None
            self._live.append((start, start + n))
            return start, start + n

    def give_back(self, region: Tuple[int, int]) -> None:
        with self._lock:
            if not self._live or self._live[0] != region:
                raise RuntimeError(f"save buffer region {region} returned out of order")
            self._live.popleft()

    def used(self) -> int:
        with self._lock:
            return sum(e - s for s, e in self._live)


class IpcTransport:
    """See the module docstring. ``save_bytes``: the save ring's size (saves that do not
    fit wait nowhere: the caller drops them); ``load_tokens``: tokens per fetch into the
    load buffer (0: no load buffer, loads inline)."""

    name = "cuda_ipc"

    def __init__(self, client: kvcd.Client, model: str, *, device: torch.device,
                 num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 save_bytes: int, load_tokens: int, lease_ms: int = 0) -> None:
        import kvcd.cuda as kcuda  # torch with CUDA only

        self._kcuda = kcuda
        self.client, self.model = client, model
        self.device = torch.device(device)
        self.geometry = (num_layers, num_kv_heads, head_dim, block_size)
        self.page_bytes = num_layers * 2 * num_kv_heads * block_size * head_dim * 2
        self.load_tokens = load_tokens // block_size * block_size
        self._lease_ms = lease_ms
        self._inline = InlineTransport(client, model, head_dim)
        self._ring = _Ring(save_bytes)
        self._save_mem = torch.empty(save_bytes, dtype=torch.uint8, device=self.device)
        self._load_mem = None
        if self.load_tokens:
            self._load_mem = torch.empty(self.load_tokens // block_size * self.page_bytes,
                                         dtype=torch.uint8, device=self.device)
        self._reg_lock = threading.Lock()
        self._save_buf = self._load_buf = None
        self._register()

    # -- buffers --------------------------------------------------------------------------

    def _register(self) -> None:
        """(Re)registers both buffers. Errors propagate (kvcd errors from RegisterBuffer)."""
        with self._reg_lock:
            for b in (self._save_buf, self._load_buf):
                if b is not None:  # one may still be registered: drop it (errors ignored)
                    try:
                        b.unregister()
                    except kvcd.KvcdError:
                        b.buffer_id = None
            self._save_buf = self._kcuda.CudaIpcBuffer(self.client, self._save_mem,
                                                       lease_ms=self._lease_ms,
                                                       name="vllm-save")
            self._load_buf = None
            if self._load_mem is not None:
                self._load_buf = self._kcuda.CudaIpcBuffer(self.client, self._load_mem,
                                                           lease_ms=self._lease_ms,
                                                           name="vllm-load")

    def _retrying(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except kvcd.NotFound as e:
            if "buffer" not in str(e):
                raise
            log.info("kvcd: IPC buffers not registered any more (%s); registering again", e)
            self._register()
            return call()

    # -- saves ----------------------------------------------------------------------------

    def stage(self, layers: Sequence[torch.Tensor], spec: SaveSpec) -> Optional[Staged]:
        """Gathers the blocks into a region of the save buffer (on the current stream);
        None when the ring has no room (the caller drops the save)."""
        L, H, D, bs = self.geometry
        n = len(spec.block_ids) * bs
        half = L * n * H * D * 2
        half_aligned = (half + _ALIGN - 1) // _ALIGN * _ALIGN
        region = self._ring.take(half_aligned + half)
        if region is None:
            return None
        start = region[0]
        flat = self._save_mem
        k = flat[start:start + half].view(torch.bfloat16).view(L, n, H, D)
        v = flat[start + half_aligned:start + half_aligned + half].view(torch.bfloat16) \
            .view(L, n, H, D)
        layout.gather_into(layers, spec.block_ids, D, k, v)
        self._save_buf.mark_ready()
        return Staged(spec, 2 * half, k, v, region)

    def put(self, s: Staged) -> None:
        def call() -> None:
            buf = self._save_buf
            self.client.put(self.model, s.spec.tokens, buf.ref(s.k), buf.ref(s.v),
                            cache_salt=s.spec.cache_salt, kv_first_token=s.spec.first_token)
        self._retrying(call)

    def release(self, s: Staged) -> None:
        if s.region is not None:
            self._ring.give_back(s.region)
            s.region = None

    # -- loads ----------------------------------------------------------------------------

    def load_chunk(self, seq: Any, first_token: int, layers: Sequence[torch.Tensor],
                   block_ids: Sequence[int]) -> int:
        if self._load_buf is None:
            return self._inline.load_chunk(seq, first_token, layers, block_ids)
        L, H, D, bs = self.geometry
        nb = len(block_ids)
        if nb * bs > self.load_tokens:
            raise ValueError(f"{nb} blocks do not fit the load buffer ({self.load_tokens} "
                             f"tokens)")
        nbytes = nb * self.page_bytes
        dst = self._load_mem[:nbytes]

        def call() -> Any:
            return self.client.fetch_pages(seq, first_token=first_token, num_tokens=nb * bs,
                                           destination=self._load_buf.ref(dst))
        got = self._retrying(call)
        if any(f != "bf16" for f in got.page_formats):
            raise kvcd.FailedPrecondition(
                f"kvcd answered pages {sorted(set(got.page_formats))} for a BF16 load")
        self._load_buf.wait_done()
        pages = dst.view(torch.bfloat16).view(nb, L, 2, H, bs, D)
        layout.scatter_bf16_pages(layers, block_ids, pages)
        self._load_buf.mark_ready()  # the next fetch into the buffer waits for this scatter
        return nbytes

    def close(self) -> None:
        for b in (self._save_buf, self._load_buf):
            if b is not None:
                try:
                    b.unregister()
                except kvcd.KvcdError:
                    pass
