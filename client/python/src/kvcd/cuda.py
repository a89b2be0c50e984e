"""CUDA IPC buffers: torch CUDA tensors the daemon reads and writes in place.

With a daemon on ``backend: cuda`` on the same node (same GPU), a worker registers a
device allocation once; afterwards requests carry only ``cuda_ipc`` regions (buffer id,
offset, size) and the K/V, queries and outputs never leave the GPU.

    buf = kvcd.cuda.CudaIpcBuffer(client, torch.empty(64 << 20, dtype=torch.uint8,
                                                      device="cuda"))
    q = buf.view(torch.float32, (B, Hq, D))            # tensors carved out of the buffer
    o = buf.view(torch.float32, (B, Hq, D)); lse = buf.view(torch.float32, (B, Hq))
    q.copy_(queries)
    buf.mark_ready()                                    # after writing inputs (current stream)
    client.attention_decode(layer, seqs, buf.ref(q), o_out=buf.ref(o), lse_out=buf.ref(lse))
    buf.wait_done()                                     # before reading o / lse (current stream)

Ordering (as client/workers/ipc_buffer.cc): the buffer's interprocess *ready* event is
recorded by :meth:`mark_ready` on the worker's stream after its writes, and the daemon's
stream waits on it before every read; the daemon records its *done* event after writing,
and :meth:`wait_done` makes the worker's stream wait on it (no host sleeps or polls).

How the handles are obtained: torch's caching allocator may place several tensors in one
``cudaMalloc`` allocation (a segment), and an IPC handle always maps a whole allocation
from its base. The allocation base comes from the CUDA driver (``cuMemGetAddressRange``)
and its handle from ``cuIpcGetMemHandle`` (libcuda through ctypes; when libcuda cannot be
loaded, from ``storage._share_cuda_()``, which returns the same handle and the storage's
offset in the segment). Regions are addressed relative to that base, and the registered
size ends at the storage's end. Events: ``torch.cuda.Event(interprocess=True).ipc_handle()``
and ``torch.cuda.Event.from_ipc_handle``. Requires torch with CUDA; nothing here runs on
the CPU backend (its calls answer FAILED_PRECONDITION for cuda_ipc tensors).
"""
from __future__ import annotations

import ctypes
from typing import Any, Optional, Sequence as Seq, Tuple

from .v1 import kvcache_pb2 as pb

__all__ = ["CudaIpcBuffer", "available"]

_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t) == sizeof(cudaIpcEventHandle_t)


def available() -> bool:
    """True when torch with a usable CUDA device is importable."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class _CuIpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _IPC_HANDLE_BYTES)]


def _libcuda() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _allocation_handle(storage: Any) -> Tuple[int, bytes]:
    """(allocation base address, cudaIpcMemHandle_t bytes) of the allocation holding a CUDA
    storage. REQUIRES: the storage's device is current."""
    ptr = storage.data_ptr()
    cu = _libcuda()
    if cu is not None:
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        _cu_check(cu, cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                 ctypes.c_uint64(ptr)), "cuMemGetAddressRange")
        raw = _CuIpcMemHandle()
        _cu_check(cu, cu.cuIpcGetMemHandle(ctypes.byref(raw), ctypes.c_uint64(base.value)),
                  "cuIpcGetMemHandle")
        return int(base.value), ctypes.string_at(ctypes.addressof(raw), _IPC_HANDLE_BYTES)
    # (device, handle, storage bytes, offset in the segment, ref-counter handle, ref-counter
    #  offset, event handle, event sync required); recent torch prefixes the handle with a
    #  one-byte type tag ('c' for cudaMalloc segments).
    shared = storage._share_cuda_()
    handle, offset = bytes(shared[1]), int(shared[3])
    if len(handle) == _IPC_HANDLE_BYTES + 1 and handle[:1] == b"c":
        handle = handle[1:]
    if len(handle) != _IPC_HANDLE_BYTES:
        raise RuntimeError(f"torch returned a {len(handle)}-byte CUDA IPC handle (expandable "
                           "segments?): expected a cudaIpcMemHandle_t of 64 bytes")
    return ptr - offset, handle


def _cu_check(cu: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        cu.cuGetErrorString(result, ctypes.byref(msg))
        text = msg.value.decode() if msg.value else f"CUresult {result}"
        raise RuntimeError(f"{what}: {text}")


def _dtype_code(dtype: Any) -> "pb.DType":
    import torch

    if dtype == torch.bfloat16:
        return pb.DTYPE_BF16
    if dtype == torch.float32:
        return pb.DTYPE_F32
    if dtype == torch.float16:
        return pb.DTYPE_F16
    if dtype == torch.uint8:
        return pb.DTYPE_U8
    raise TypeError(f"{dtype} has no kvcd DType (bfloat16, float32, float16, uint8)")


class CudaIpcBuffer:
    """A torch CUDA tensor registered with the daemon as an IPC buffer.

    Args:
        client: a :class:`kvcd.Client` (blocking; with kvcd.aio use
            :meth:`register_async`).
        tensor: a contiguous CUDA tensor that owns the memory (kept alive by this object).
        lease_ms: buffer lease (0 = the daemon's default); every use renews it, and
            :meth:`renew` does explicitly.
        name: label in the daemon's logs.
    """

    def __init__(self, client: Any, tensor: Any, *, lease_ms: int = 0, name: str = "python",
                 _register: bool = True) -> None:
        import torch

        if not tensor.is_cuda:
            raise ValueError("CudaIpcBuffer needs a CUDA tensor")
        if not tensor.is_contiguous():
            raise ValueError("CudaIpcBuffer needs a contiguous tensor")
        self.client = client
        self.tensor = tensor
        self.device = tensor.device
        storage = tensor.untyped_storage()
        self._storage_ptr = storage.data_ptr()
        with torch.cuda.device(self.device):
            # A runtime call on this thread makes the device's primary context current for
            # the driver calls below (and the allocation is complete).
            torch.cuda.synchronize(self.device)
            base, handle = _allocation_handle(storage)
        self.ipc_handle: bytes = handle
        self._segment_base = base
        # bytes from the allocation base the daemon may address: up to the storage's end
        self.size = self._storage_ptr - base + storage.nbytes()
        with torch.cuda.device(self.device):
            self._ready = torch.cuda.Event(interprocess=True, blocking=False)
            # The ready event must have been recorded once before the daemon waits on it.
            self._ready.record()
            self.ready_event_handle: bytes = bytes(self._ready.ipc_handle())
        self.buffer_id: Optional[int] = None
        self._done: Any = None
        self.lease_ms = 0
        self._name = name
        self._lease_request = int(lease_ms)
        self._used = 0
        if _register:
            self._registered(client.register_buffer(
                self.ipc_handle, self.size, self.ready_event_handle, lease_ms=lease_ms,
                name=name))

    @classmethod
    async def register_async(cls, client: Any, tensor: Any, *, lease_ms: int = 0,
                             name: str = "python") -> "CudaIpcBuffer":
        """The same for a :class:`kvcd.aio.Client`."""
        b = cls(client, tensor, lease_ms=lease_ms, name=name, _register=False)
        b._registered(await client.register_buffer(b.ipc_handle, b.size, b.ready_event_handle,
                                                   lease_ms=lease_ms, name=name))
        return b

    def _registered(self, resp: pb.RegisterBufferResponse) -> None:
        import torch

        self.buffer_id = int(resp.buffer_id)
        self.lease_ms = int(resp.lease_ms)
        if len(resp.done_event_handle) != _IPC_HANDLE_BYTES:
            raise RuntimeError("the daemon's done_event_handle has the wrong size")
        self._done = torch.cuda.Event.from_ipc_handle(self.device, resp.done_event_handle)

    # -- regions ----------------------------------------------------------------------

    def offset_of(self, t: Any) -> int:
        """Byte offset of tensor ``t`` (a view into this buffer) from the segment base."""
        if t.device != self.device:
            raise ValueError(f"tensor on {t.device}, buffer on {self.device}")
        off = t.data_ptr() - self._segment_base
        end = off + t.numel() * t.element_size()
        if t.data_ptr() < self._storage_ptr or end > self.size:
            raise ValueError("tensor does not lie inside the registered buffer")
        if not t.is_contiguous():
            raise ValueError("cuda_ipc regions must be contiguous")
        if off % 16:
            raise ValueError(f"region offset {off} is not a multiple of 16 bytes")
        return off

    def ref(self, t: Any, shape: Optional[Seq[int]] = None) -> pb.TensorRef:
        """The ``cuda_ipc`` TensorRef of ``t`` (a contiguous view of this buffer), with
        t's dtype and shape (or ``shape``). Pass it wherever the client takes a tensor:
        put/append k/v, attention q/k_new/v_new, o_out/lse_out, fetch_pages destination,
        push_pages device_pages."""
        if self.buffer_id is None:
            raise ValueError("buffer is not registered")
        ref = pb.TensorRef(dtype=_dtype_code(t.dtype))
        ref.shape.extend(int(s) for s in (shape if shape is not None else t.shape))
        ref.cuda_ipc.buffer_id = self.buffer_id
        ref.cuda_ipc.offset = self.offset_of(t)
        ref.cuda_ipc.size = t.numel() * t.element_size()
        return ref

    def view(self, dtype: Any, shape: Seq[int]) -> Any:
        """Carves the next free, 256-byte aligned region of the buffer as a tensor (a simple
        bump allocator over the registered tensor; :meth:`reset` starts over)."""
        import torch

        n = 1
        for s in shape:
            n *= int(s)
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        start = (self._used + 255) // 256 * 256
        flat = self.tensor.view(torch.uint8).reshape(-1)
        if start + nbytes > flat.numel():
            raise ValueError(f"buffer full: {start + nbytes} > {flat.numel()} bytes")
        self._used = start + nbytes
        return flat[start:start + nbytes].view(dtype).view(*[int(s) for s in shape])

    def reset(self) -> None:
        self._used = 0

    # -- ordering ---------------------------------------------------------------------

    def mark_ready(self, stream: Any = None) -> None:
        """Records the ready event on ``stream`` (default: current) after writing inputs."""
        self._ready.record(stream)

    def wait_done(self, stream: Any = None) -> None:
        """Makes ``stream`` (default: current) wait for the daemon's writes."""
        self._done.wait(stream)

    def synchronize_done(self) -> None:
        """Host-side wait for the daemon's writes (cudaEventSynchronize of done)."""
        self._done.synchronize()

    # -- lifetime ---------------------------------------------------------------------

    def renew(self, lease_ms: int = 0) -> int:
        self.lease_ms = self.client.renew_buffer(self.buffer_id, lease_ms)
        return self.lease_ms

    def unregister(self) -> None:
        """Unregisters now (the daemon drops its mapping); the tensor stays valid."""
        if self.buffer_id is not None:
            bid, self.buffer_id = self.buffer_id, None
            self.client.unregister_buffer(bid)

    async def unregister_async(self) -> None:
        if self.buffer_id is not None:
            bid, self.buffer_id = self.buffer_id, None
            await self.client.unregister_buffer(bid)

    def __enter__(self) -> "CudaIpcBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.unregister()
