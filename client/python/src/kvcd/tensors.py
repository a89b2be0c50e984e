"""Conversions between numpy arrays / torch tensors and kvcd ``TensorRef`` messages.

Inputs accepted wherever the client takes a tensor:
  * ``numpy.ndarray`` of a floating dtype: sent as F32 (float16/float64 are converted),
    or as BF16 when the call's ``wire_dtype="bf16"`` (round to nearest even, half the bytes);
  * ``torch.Tensor`` (CPU or CUDA; CUDA tensors are copied to the host for inline
    transfer): ``torch.bfloat16`` is sent as BF16, other floats as F32 (or BF16 with
    ``wire_dtype="bf16"``);
  * a ``kvcd.v1.kvcache_pb2.TensorRef`` built elsewhere, e.g. a ``cuda_ipc`` region of a
    :class:`kvcd.cuda.CudaIpcBuffer`; it is sent unchanged (its shape is still checked).

Outputs (attention ``o``/``lse``, expanded pages) are ``numpy.float32`` arrays, or torch
tensors when the input they answer was a torch tensor.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

from .v1 import kvcache_pb2 as pb

__all__ = ["float_to_bf16_bits", "bf16_bits_to_float", "to_tensor_ref", "tensor_ref_to_numpy",
           "is_torch", "shape_of"]

_BF16 = pb.DTYPE_BF16
_F32 = pb.DTYPE_F32


def float_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even, NaN kept quiet.

    Bit-identical to the daemon's ``kernels::FloatToBf16``."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))))
               >> np.uint32(16)).astype(np.uint16)
    if nan.any():
        rounded = np.where(nan, ((u >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16),
                           rounded)
    return rounded


def bf16_bits_to_float(b: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    return (np.ascontiguousarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(
        np.float32)


def is_torch(x: Any) -> bool:
    t = type(x)
    return t.__module__.startswith("torch") and t.__name__ in ("Tensor", "Parameter")


def shape_of(x: Any) -> Tuple[int, ...]:
    if isinstance(x, pb.TensorRef):
        return tuple(int(s) for s in x.shape)
    return tuple(int(s) for s in x.shape)


def _wire(wire_dtype: Optional[str]) -> "Optional[pb.DType]":
    if wire_dtype is None:
        return None
    w = wire_dtype.lower()
    if w == "bf16":
        return _BF16
    if w == "f32":
        return _F32
    raise ValueError(f"wire_dtype is '{wire_dtype}', expected 'bf16', 'f32' or None")


def to_tensor_ref(x: Any, wire_dtype: Optional[str] = None,
                  out: Optional[pb.TensorRef] = None) -> pb.TensorRef:
    """Builds (or fills ``out`` with) the TensorRef of ``x`` (see the module docstring)."""
    ref = out if out is not None else pb.TensorRef()
    if isinstance(x, pb.TensorRef):
        ref.CopyFrom(x)
        return ref
    want = _wire(wire_dtype)
    if is_torch(x):
        import torch  # only reached with a torch tensor in hand

        t = x.detach()
        if t.is_cuda:
            t = t.cpu()
        t = t.contiguous()
        shape = tuple(t.shape)
        if t.dtype == torch.bfloat16 and want in (None, _BF16):
            data = t.view(torch.int16).numpy().tobytes()
            dtype = _BF16
        elif t.is_floating_point():
            arr = t.to(torch.float32).numpy()
            dtype = want or _F32
            data = float_to_bf16_bits(arr).tobytes() if dtype == _BF16 else arr.tobytes()
        else:
            raise TypeError(f"tensor of dtype {t.dtype}: expected a floating-point tensor")
    else:
        arr = np.asarray(x)
        if not np.issubdtype(arr.dtype, np.floating):
            raise TypeError(f"array of dtype {arr.dtype}: expected a floating-point array")
        shape = arr.shape
        dtype = want or _F32
        if dtype == _BF16:
            data = float_to_bf16_bits(arr).tobytes()
        else:
            data = np.ascontiguousarray(arr, dtype="<f4").tobytes()
    ref.dtype = dtype
    del ref.shape[:]
    ref.shape.extend(int(s) for s in shape)
    ref.inline_data = data
    return ref


def tensor_ref_to_numpy(ref: pb.TensorRef) -> np.ndarray:
    """The elements of an inline TensorRef as float32 (BF16 expanded exactly)."""
    if ref.WhichOneof("payload") != "inline_data":
        raise ValueError("TensorRef has no inline data (the result was written to a device "
                         "buffer)")
    shape = tuple(int(s) for s in ref.shape)
    if ref.dtype == _F32:
        return np.frombuffer(ref.inline_data, dtype="<f4").reshape(shape).astype(np.float32)
    if ref.dtype == _BF16:
        return bf16_bits_to_float(np.frombuffer(ref.inline_data, dtype="<u2")).reshape(shape)
    raise ValueError(f"unexpected dtype {pb.DType.Name(ref.dtype)} in a result tensor")


def like(arr: np.ndarray, template: Any) -> Any:
    """``arr`` as a torch tensor on the template's device when the template is torch."""
    if template is not None and is_torch(template):
        import torch

        return torch.from_numpy(np.array(arr, copy=True)).to(template.device)
    return arr


def bf16_tensor_from_ref(ref: pb.TensorRef):  # pragma: no cover - torch only
    """A BF16 TensorRef as a ``torch.bfloat16`` tensor (bit-exact)."""
    import torch

    shape = tuple(int(s) for s in ref.shape)
    raw = np.frombuffer(ref.inline_data, dtype="<i2").reshape(shape).copy()
    return torch.from_numpy(raw).view(torch.bfloat16)


def check_shape(name: str, x: Any, expected: Sequence[int]) -> None:
    """ValueError naming the argument unless x's shape equals ``expected``."""
    got = shape_of(x)
    if got != tuple(expected):
        raise ValueError(f"{name} has shape {list(got)}, expected {list(expected)}")
