"""The collective-engine interface every engine implements.

An engine moves flat buffers between ranks; it knows nothing of tensors,
buckets or frameworks. Buffers are 1-D numpy arrays or torch tensors (see
``dp_plugin.arrays``); an engine converts them to what its library takes
without copying.

Contract shared by all engines:
- every rank calls the same collectives in the same order;
- ``allreduce_async`` works in place and returns a ``Handle``; the buffer
  must not be touched until ``Handle.wait()`` returns;
- every blocking wait honours ``config.timeout_s`` and raises
  ``CollectiveTimeoutError`` naming the collective and the rank, instead of
  hanging.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from dp_plugin.arrays import as_numpy
from dp_plugin.config import Config
from dp_plugin.dtypes import canonical_dtype, is_floating
from dp_plugin.errors import CollectiveTimeoutError
from dp_plugin.launch import Topology


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        if isinstance(op, ReduceOp):
            return op
        try:
            return cls(str(op).lower())
        except ValueError:
            valid = ", ".join(o.value for o in cls)
            raise ValueError(f"reduce op {op!r} is not known; valid ops: {valid}") from None


@dataclass(frozen=True)
class Availability:
    """Whether an engine can run here, and why (shown by ``make check``)."""

    ok: bool
    reason: str


class Handle(ABC):
    """An in-flight collective. ``wait`` blocks until done or the timeout."""

    def __init__(self, description: str, rank: int, timeout_s: float) -> None:
        self.description = description
        self.rank = rank
        self.timeout_s = timeout_s
        self.started_at = time.perf_counter()
        self.completed_at: float | None = None
        self._finishers: list[Any] = []

    @abstractmethod
    def _test(self) -> bool:
        """Non-blocking: True once the collective has finished."""

    def _block(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s``; True if finished. Override where the
        library can block efficiently; the default polls ``_test``."""
        deadline = time.perf_counter() + timeout_s
        pause = 0.0
        while not self._test():
            if time.perf_counter() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2 + 2e-5, 1e-3)
        return True

    def done(self) -> bool:
        if self.completed_at is None and self._test():
            self.completed_at = time.perf_counter()
        return self.completed_at is not None

    def wait(self) -> None:
        """Wait for completion; raise ``CollectiveTimeoutError`` after the timeout."""
        if self.completed_at is None:
            if not self._block(self.timeout_s):
                raise self.timeout_error()
            self.completed_at = time.perf_counter()
        while self._finishers:
            self._finishers.pop(0)()

    def timeout_error(self) -> CollectiveTimeoutError:
        """The error for this collective passing ``timeout_s`` (also used by
        engines whose library reports the timeout itself)."""
        return CollectiveTimeoutError(
            f"rank {self.rank}: {self.description} did not finish within "
            f"{self.timeout_s:g} s (DP_PLUGIN_TIMEOUT). Another rank has probably "
            "stopped calling collectives, called them in a different order, or died; "
            "check its log. If the step is legitimately this slow, raise "
            "DP_PLUGIN_TIMEOUT."
        )

    def then(self, fn: Any) -> Handle:
        """Run ``fn()`` once, in the waiting thread, after completion."""
        self._finishers.append(fn)
        return self


class DoneHandle(Handle):
    """A collective that completed synchronously."""

    def __init__(self, description: str, rank: int, timeout_s: float) -> None:
        super().__init__(description, rank, timeout_s)
        self.completed_at = self.started_at

    def _test(self) -> bool:
        return True


class Engine(ABC):
    """One collective library. Subclasses set ``name`` and implement the
    underscore methods; the public methods validate input and add timeouts."""

    name: ClassVar[str]
    native_ops: ClassVar[frozenset[ReduceOp]] = frozenset(
        {ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT}
    )

    def __init__(self, topology: Topology, config: Config) -> None:
        self.topology = topology
        self.config = config

    @classmethod
    @abstractmethod
    def availability(cls, topology: Topology) -> Availability:
        """Can this engine run under this launcher and installation?"""

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def size(self) -> int:
        return self.topology.size

    # -- public API --------------------------------------------------------
    def allreduce_async(self, buf: Any, op: ReduceOp | str = ReduceOp.SUM,
                        name: str = "allreduce") -> Handle:
        """Start an in-place all-reduce of the 1-D buffer ``buf``."""
        op = ReduceOp.parse(op)
        dtype = _check_flat(buf, f"allreduce {name!r}")
        if op is ReduceOp.AVERAGE and not is_floating(dtype):
            raise TypeError(
                f"allreduce {name!r}: op=average is not defined for {dtype} buffers; "
                "use op='sum' and divide, or cast to a floating dtype"
            )
        if op in self.native_ops:
            return self._allreduce_async(buf, op, name)
        handle = self._allreduce_async(buf, ReduceOp.SUM, name)
        size = self.size
        return handle.then(lambda: _divide(buf, size))

    def broadcast(self, buf: Any, root: int, name: str = "broadcast") -> None:
        """In-place broadcast of ``buf`` from ``root`` to every rank."""
        self._check_root(root, name)
        _check_flat(buf, f"broadcast {name!r}")
        self._broadcast_async(buf, root, name).wait()

    def allgather(self, buf: Any, name: str = "allgather") -> Any:
        """Concatenate every rank's buffer along the first dimension.

        The first dimension may differ between ranks; the others, and the
        dtype, must match. Returns a new buffer of the same kind as ``buf``.
        """
        return self._allgather(buf, name)

    def barrier(self) -> None:
        self._barrier()

    @abstractmethod
    def shutdown(self) -> None: ...

    # -- to implement ------------------------------------------------------
    @abstractmethod
    def _allreduce_async(self, buf: Any, op: ReduceOp, name: str) -> Handle: ...

    @abstractmethod
    def _broadcast_async(self, buf: Any, root: int, name: str) -> Handle: ...

    @abstractmethod
    def _allgather(self, buf: Any, name: str) -> Any: ...

    @abstractmethod
    def _barrier(self) -> None: ...

    # -- helpers -----------------------------------------------------------
    def _check_root(self, root: int, name: str) -> None:
        if not isinstance(root, int) or not 0 <= root < self.size:
            raise ValueError(
                f"{name}: root rank {root!r} is out of range; expected 0 <= root < {self.size}"
            )

    def describe(self, collective: str, name: str, nbytes: int | None = None) -> str:
        size = "" if nbytes is None else f", {nbytes} bytes"
        return f"{self.name} {collective} of {name!r}{size}"


def _check_flat(buf: Any, what: str) -> str:
    shape = tuple(buf.shape)
    if len(shape) != 1:
        raise ValueError(f"{what}: expected a 1-D buffer, got shape {shape}; flatten it first")
    return canonical_dtype(buf.dtype)


def _divide(buf: Any, size: int) -> None:
    if hasattr(buf, "div_"):
        buf.div_(size)
    else:
        arr = as_numpy(buf)
        arr /= arr.dtype.type(size)


def check_gatherable(buf: Any, what: str) -> str:
    """Validate an all-gather input (at least 1-D, a supported dtype); return
    its canonical dtype. Raises on the rank that passed it."""
    shape = tuple(buf.shape)
    if len(shape) == 0:
        raise ValueError(
            f"{what}: a 0-dim buffer has no first dimension to concatenate along; "
            "reshape it to (1,) first"
        )
    return canonical_dtype(buf.dtype)
