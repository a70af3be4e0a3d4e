"""An in-process fake engine group: N ranks as N threads, no processes.

``make_thread_group(n)`` returns one ``FakeEngine`` per rank; each is used
from its own thread (``run_ranks``). Collectives meet through shared memory:
the k-th collective of every rank is matched with the k-th of the others, and
when the last rank arrives the result is computed in numpy, in rank order,
and written into every rank's buffer. A mismatch (different kind, name,
dtype, size, op or root at the same position) fails the collective on every
rank with a message naming both sides, which makes ordering bugs loud.

``absent`` ranks (or a rank after ``go_silent()``) never contribute: every
collective then stays incomplete and ``Handle.wait()`` raises
``CollectiveTimeoutError`` after ``config.timeout_s``, like a real engine
whose peer died.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dp_plugin.config import Config
from dp_plugin.engines.base import Availability, Engine, Handle, ReduceOp
from dp_plugin.errors import DPPluginError
from dp_plugin.launch.launchers import Topology
from dp_plugin.reduce.arrays import as_numpy, as_torch, is_torch

_REDUCE: dict[ReduceOp, Callable[[Any, Any], Any]] = {
    ReduceOp.SUM: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}


@dataclass
class _Collective:
    kind: str
    name: str
    signature: tuple[Any, ...]
    first_rank: int
    inputs: dict[int, np.ndarray] = field(default_factory=dict)
    targets: dict[int, Any] = field(default_factory=dict)
    result: np.ndarray | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


class _Group:
    def __init__(self, size: int, absent: Iterable[int]) -> None:
        self.size = size
        self.absent = set(absent)
        self.lock = threading.Lock()
        self.pending: dict[int, _Collective] = {}
        self.logs: list[list[tuple[str, str, int]]] = [[] for _ in range(size)]
        """Per rank: (kind, name, bytes) of every collective it started, in order."""

    def submit(self, rank: int, seq: int, kind: str, name: str, buf: Any,
               signature: tuple[Any, ...], op: ReduceOp | None = None,
               root: int = 0) -> _Collective:
        data = np.array(as_numpy(buf), copy=True)
        with self.lock:
            self.logs[rank].append((kind, name, int(data.nbytes)))
            coll = self.pending.get(seq)
            if coll is None:
                coll = self.pending[seq] = _Collective(kind, name, signature, rank)
            elif coll.error is None and (coll.kind, coll.name, coll.signature) != (
                kind, name, signature
            ):
                coll.error = (
                    f"collective #{seq} mismatch: rank {coll.first_rank} called {coll.kind} "
                    f"{coll.name!r} {coll.signature}, rank {rank} called {kind} {name!r} "
                    f"{signature}"
                )
            if rank in self.absent:
                return coll  # this rank never arrives
            coll.inputs[rank] = data
            coll.targets[rank] = buf
            if len(coll.inputs) == self.size:
                del self.pending[seq]
                if coll.error is None:
                    self._complete(coll, op, root)
                coll.done.set()
        return coll

    def _complete(self, coll: _Collective, op: ReduceOp | None, root: int) -> None:
        ordered = [coll.inputs[r] for r in range(self.size)]
        if coll.kind == "allreduce":
            assert op is not None
            acc = ordered[0].copy()
            for x in ordered[1:]:
                acc = _REDUCE[op](acc, x).astype(acc.dtype)
            coll.result = acc
        elif coll.kind == "broadcast":
            coll.result = ordered[root]
        elif coll.kind == "allgather":
            coll.result = np.concatenate(ordered, axis=0)
        else:
            coll.result = np.empty(0)
        if coll.kind in ("allreduce", "broadcast"):
            for target in coll.targets.values():
                np.copyto(as_numpy(target), coll.result)


class FakeHandle(Handle):
    def __init__(self, coll: _Collective, description: str, rank: int, timeout_s: float) -> None:
        super().__init__(description, rank, timeout_s)
        self._coll = coll

    def _test(self) -> bool:
        return self._coll.done.is_set()

    def _block(self, timeout_s: float) -> bool:
        return self._coll.done.wait(timeout_s)

    def wait(self) -> None:
        super().wait()
        if self._coll.error is not None:
            raise DPPluginError(f"rank {self.rank}: {self.description}: {self._coll.error}")


class FakeEngine(Engine):
    """One rank of a thread group. Use each engine from one thread only."""

    name = "fake"

    def __init__(self, topology: Topology, config: Config, group: _Group) -> None:
        super().__init__(topology, config)
        self.group = group
        self._seq = 0
        self.shut_down = False

    @classmethod
    def availability(cls, topology: Topology) -> Availability:
        return Availability(True, "in-process test double")

    @property
    def log(self) -> list[tuple[str, str, int]]:
        """(kind, name, bytes) of every collective this rank started, in order."""
        return self.group.logs[self.rank]

    def _close(self) -> None:
        self.shut_down = True

    def go_silent(self) -> None:
        """From now on this rank never arrives at a collective (a dead peer)."""
        with self.group.lock:
            self.group.absent.add(self.rank)

    def _start(self, kind: str, name: str, buf: Any, signature: tuple[Any, ...],
               op: ReduceOp | None = None, root: int = 0) -> FakeHandle:
        seq = self._seq
        self._seq += 1
        coll = self.group.submit(self.rank, seq, kind, name, buf, signature, op, root)
        nbytes = int(as_numpy(buf).nbytes)
        return FakeHandle(coll, self.describe(kind, name, nbytes), self.rank,
                          self.config.timeout_s)

    def _allreduce_async(self, buf: Any, op: ReduceOp, name: str) -> Handle:
        arr = as_numpy(buf)
        return self._start("allreduce", name, buf, (op.value, str(arr.dtype), arr.shape), op)

    def _broadcast_async(self, buf: Any, root: int, name: str) -> Handle:
        arr = as_numpy(buf)
        return self._start("broadcast", name, buf, (root, str(arr.dtype), arr.shape), root=root)

    def _allgather(self, buf: Any, rows: list[int], name: str) -> Any:
        arr = as_numpy(buf)
        handle = self._start("allgather", name, buf, (str(arr.dtype), arr.shape[1:]))
        return self._result(handle, buf)

    @staticmethod
    def _result(handle: FakeHandle, buf: Any) -> Any:
        handle.wait()
        result = handle._coll.result
        assert result is not None
        out = result.copy()
        return as_torch(out) if is_torch(buf) else out

    def _barrier(self) -> None:
        self._start("barrier", "barrier", np.empty(0, np.uint8), ()).wait()

    def _channel(self, name: str) -> Engine:
        # One stream, so the tests can read every collective in ``log``;
        # separate communicators are tested on real engines
        # (tests/multiproc/test_torch_unused.py).
        return self


def make_thread_group(
    n: int, *, config: Config | None = None, absent: Iterable[int] = ()
) -> list[FakeEngine]:
    """``n`` fake engines sharing one rendezvous; ``absent`` ranks never arrive."""
    config = Config(timeout_s=30.0) if config is None else config
    group = _Group(n, absent)
    return [
        FakeEngine(
            Topology(launcher="torchrun", rank=r, size=n, local_rank=r, local_size=n,
                     cross_rank=0, cross_size=1),
            config,
            group,
        )
        for r in range(n)
    ]


def run_ranks_outcomes(
    engines: Sequence[FakeEngine], fn: Callable[[FakeEngine], Any], timeout: float = 60.0
) -> list[Any]:
    """Run ``fn(engine)`` on one thread per rank; per rank its result or exception.

    A thread still running after ``timeout`` seconds is a hang: AssertionError.
    """
    outcomes: list[Any] = [None] * len(engines)

    def body(r: int) -> None:
        try:
            outcomes[r] = fn(engines[r])
        except BaseException as exc:
            outcomes[r] = exc

    threads = [
        threading.Thread(target=body, args=(r,), name=f"fake-rank-{r}", daemon=True)
        for r in range(len(engines))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if hung:
        raise AssertionError(f"HANG: ranks {hung} did not finish within {timeout:g} s")
    return outcomes


def run_ranks(
    engines: Sequence[FakeEngine], fn: Callable[[FakeEngine], Any], timeout: float = 60.0
) -> list[Any]:
    """Like ``run_ranks_outcomes`` but re-raise when any rank failed."""
    outcomes = run_ranks_outcomes(engines, fn, timeout)
    errors = [(r, o) for r, o in enumerate(outcomes) if isinstance(o, BaseException)]
    if errors:
        detail = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in errors)
        raise AssertionError(f"ranks {[r for r, _ in errors]} failed: {detail}") from errors[0][1]
    return outcomes
