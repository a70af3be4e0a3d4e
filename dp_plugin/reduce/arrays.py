"""Array backends: the few operations the core needs on flat buffers.

The core never imports a framework at import time. A backend is chosen from
the tensors an adapter registers (numpy arrays or torch tensors); engines take
either kind and convert without copying (``as_numpy`` / ``as_torch`` give
views of the same memory for CPU buffers).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from dp_plugin.reduce.dtypes import canonical_dtype


def numpy_dtype(dtype: str) -> np.dtype:
    """numpy dtype of a canonical name; bfloat16 comes from ``ml_dtypes``."""
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def is_torch(x: object) -> bool:
    """True for a torch.Tensor, without importing torch when it was never loaded."""
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def as_numpy(buf: Any) -> np.ndarray:
    """A numpy view of a CPU buffer (numpy array or torch tensor), no copy."""
    if isinstance(buf, np.ndarray):
        return buf
    if is_torch(buf):
        if buf.device.type != "cpu":
            raise TypeError(
                f"a {buf.device} tensor cannot be viewed as numpy; this engine needs CPU "
                "buffers (use the nccl or horovod engine for GPU tensors)"
            )
        t = buf.detach()
        if str(t.dtype) == "torch.bfloat16":
            return t.view(_torch().int16).numpy().view(numpy_dtype("bfloat16"))
        return t.numpy()
    return np.asarray(buf)


def as_torch(buf: Any) -> Any:
    """A torch view of a buffer (numpy array or torch tensor), no copy."""
    if is_torch(buf):
        return buf
    torch = _torch()
    arr = np.asarray(buf)
    if arr.dtype == numpy_dtype("bfloat16"):
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _torch() -> Any:
    import torch

    return torch


def to_device(arr: np.ndarray, device: str) -> Any:
    """``arr`` itself for the CPU, else a torch copy on ``device`` (control buffers)."""
    return arr if device == "cpu" else as_torch(arr).to(device)


def to_host(buf: Any) -> np.ndarray:
    """A numpy view (or, for a device tensor, a host copy) of a control buffer."""
    if is_torch(buf) and buf.device.type != "cpu":
        buf = buf.cpu()
    return as_numpy(buf)

def device_of(tensor: Any) -> str:
    """Where ``tensor`` lives: "cpu", or torch's device string."""
    return str(tensor.device) if is_torch(tensor) else "cpu"


def spec_of(tensor: Any) -> tuple[tuple[int, ...], str, str]:
    """(shape, canonical dtype, device) of a numpy array or torch tensor."""
    if is_torch(tensor):
        return tuple(tensor.shape), canonical_dtype(tensor.dtype), str(tensor.device)
    arr = tensor if isinstance(tensor, np.ndarray) else np.asarray(tensor)
    return tuple(arr.shape), canonical_dtype(arr.dtype), "cpu"


class ArrayOps(Protocol):
    """Operations the scheduler runs on flat buffers and user tensors."""

    kind: str

    def empty(self, numel: int, dtype: str, device: str) -> Any: ...
    def zeros(self, shape: tuple[int, ...], dtype: str, device: str) -> Any: ...
    def slice(self, buf: Any, start: int, stop: int) -> Any: ...
    def pack(self, dst: Any, src: Any, factor: float = 1.0) -> None:
        """Copy ``src`` (any shape) flattened into the 1-D slice ``dst``, times
        ``factor`` in the same pass."""
    def unpack(self, dst: Any, src: Any, factor: float = 1.0) -> None:
        """Copy the 1-D slice ``src`` into ``dst`` (any shape), in place, times
        ``factor`` in the same pass."""
    def scale_(self, buf: Any, factor: float) -> None: ...
    def cast_into(self, dst: Any, src: Any) -> None:
        """Copy ``src`` into same-sized ``dst`` converting the dtype."""
    def flat_alias(self, tensor: Any) -> Any:
        """A 1-D view sharing ``tensor``'s memory, or None if it has none
        (non-contiguous, or of the other backend's kind)."""
    def shares_memory(self, a: Any, b: Any) -> bool:
        """True if ``a`` and ``b`` are views of exactly the same elements."""


class NumpyOps:
    kind = "numpy"

    def empty(self, numel: int, dtype: str, device: str) -> np.ndarray:
        _cpu_only(device)
        return np.empty(numel, dtype=numpy_dtype(dtype))

    def zeros(self, shape: tuple[int, ...], dtype: str, device: str) -> np.ndarray:
        _cpu_only(device)
        return np.zeros(shape, dtype=numpy_dtype(dtype))

    def slice(self, buf: np.ndarray, start: int, stop: int) -> np.ndarray:
        return buf[start:stop]

    def pack(self, dst: np.ndarray, src: Any, factor: float = 1.0) -> None:
        _np_scaled(dst, as_numpy(src).reshape(-1), factor)

    def unpack(self, dst: Any, src: np.ndarray, factor: float = 1.0) -> None:
        out = as_numpy(dst)
        _np_scaled(out, src.reshape(out.shape), factor)

    def scale_(self, buf: np.ndarray, factor: float) -> None:
        _np_scaled(buf, buf, factor)

    def cast_into(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src, casting="unsafe")

    def flat_alias(self, tensor: Any) -> np.ndarray | None:
        if not isinstance(tensor, np.ndarray) or not tensor.flags.c_contiguous:
            return None
        return tensor.reshape(-1) if tensor.flags.writeable else None

    def shares_memory(self, a: Any, b: Any) -> bool:
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        return (
            a.size == b.size
            and a.dtype == b.dtype
            and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.flags.c_contiguous
            and b.flags.c_contiguous
        )


class TorchOps:
    kind = "torch"

    def __init__(self) -> None:
        self._torch = _torch()

    def empty(self, numel: int, dtype: str, device: str) -> Any:
        return self._torch.empty(numel, dtype=getattr(self._torch, dtype), device=device)

    def zeros(self, shape: tuple[int, ...], dtype: str, device: str) -> Any:
        return self._torch.zeros(shape, dtype=getattr(self._torch, dtype), device=device)

    def slice(self, buf: Any, start: int, stop: int) -> Any:
        return buf[start:stop]

    def pack(self, dst: Any, src: Any, factor: float = 1.0) -> None:
        self._scaled(dst, as_torch(src).reshape(-1), factor)

    def unpack(self, dst: Any, src: Any, factor: float = 1.0) -> None:
        out = as_torch(dst)
        self._scaled(out, src.view(out.shape), factor)

    def scale_(self, buf: Any, factor: float) -> None:
        self._scaled(buf, buf, factor)

    def _scaled(self, dst: Any, src: Any, factor: float) -> None:
        """``dst = src * factor`` (a plain copy for 1); integers as Horovod's
        ScaleBuffer does: in double precision, truncated toward zero."""
        with self._torch.no_grad():
            if factor == 1.0:
                dst.copy_(src)
            elif dst.is_floating_point():
                self._torch.mul(src, factor, out=dst)
            else:
                dst.copy_((src.double() * factor).to(dst.dtype))

    def cast_into(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def flat_alias(self, tensor: Any) -> Any:
        if not is_torch(tensor) or not tensor.is_contiguous() or tensor.is_sparse:
            return None
        return tensor.detach().view(-1)

    def shares_memory(self, a: Any, b: Any) -> bool:
        if not (is_torch(a) and is_torch(b)):
            return False
        return (
            a.data_ptr() == b.data_ptr()
            and a.numel() == b.numel()
            and a.dtype == b.dtype
            and a.device == b.device
            and a.is_contiguous()
            and b.is_contiguous()
        )


def _np_scaled(dst: np.ndarray, src: np.ndarray, factor: float) -> None:
    """``dst = src * factor`` (a plain copy for 1); integers in float64,
    truncated toward zero, and 16-bit floats in float32, rounded once
    (Horovod's ScaleBuffer; torch's half multiply does the same)."""
    if factor == 1.0:
        np.copyto(dst, src, casting="no")
    elif np.issubdtype(dst.dtype, np.integer):
        np.copyto(dst, np.trunc(src.astype(np.float64) * factor), casting="unsafe")
    elif dst.dtype.itemsize < 4:
        np.copyto(dst, src.astype(np.float32) * np.float32(factor), casting="unsafe")
    else:
        np.multiply(src, dst.dtype.type(factor), out=dst)


def ops_for(tensor: Any) -> ArrayOps:
    """The backend matching a tensor: torch tensors -> TorchOps, else NumpyOps."""
    return TorchOps() if is_torch(tensor) else NumpyOps()


def _cpu_only(device: str) -> None:
    if device != "cpu":
        raise TypeError(f"numpy buffers live on the CPU; got device {device!r}")
