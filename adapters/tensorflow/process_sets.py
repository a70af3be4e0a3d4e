"""Process sets for TensorFlow: collectives over a subset of ranks, as ``horovod.tensorflow``.

``ProcessSet``, ``global_process_set``, ``add_process_set`` and
``remove_process_set`` keep Horovod 0.28.1's names and semantics; a
registered set's ``engine()`` is a subgroup of the running engine
(``Engine.subgroup``) whose ranks count the members in ascending order.

Distributed contract (as in Horovod): ``add_process_set`` and
``remove_process_set`` are collective over every rank of the job, members or
not, in the same order with the same ranks; ids are then equal everywhere
(0 is the global set, freed ids are reused first). A duplicate set raises
``ValueError``. Unlike Horovod, no ``HOROVOD_DYNAMIC_PROCESS_SETS`` is needed.
Sets made from an mpi4py communicator are not supported (pass the ranks).

The PyTorch adapter has the same registry (``dp_plugin.torch.process_sets``);
this one is separate so that the TensorFlow adapter does not import torch's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from dp_plugin import runtime
from dp_plugin.engines.base import Engine


class ProcessSet:
    """A set of job-wide ranks that run collectives together (register it with
    ``add_process_set`` first; until then ``process_set_id``, ``size()`` and
    ``rank()`` are None, as in Horovod)."""

    process_set_id: int | None = None
    mpi_comm: Any = None

    def __init__(self, ranks: Sequence[int]) -> None:
        if not isinstance(ranks, Iterable) or isinstance(ranks, str | bytes):
            raise ValueError(
                f"ProcessSet takes a list of job-wide ranks, got {ranks!r}; sets made from an "
                "mpi4py communicator are not supported by dp_plugin: pass the ranks instead"
            )
        ranks = sorted(ranks)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet takes int ranks, got {ranks!r}")
        self.ranks: list[int] = ranks
        self._engine: Engine | None = None

    def _members(self) -> list[int]:
        return list(range(runtime.size())) if self.process_set_id == 0 else list(self.ranks)

    def size(self) -> int | None:
        return None if self.process_set_id is None else len(self._members())

    def rank(self) -> int | None:
        """This process's rank within the set (``ValueError`` outside it)."""
        if self.process_set_id is None:
            return None
        members = self._members()
        if runtime.rank() not in members:
            raise ValueError(f"Process is not part of provided process set: {self}")
        return members.index(runtime.rank())

    def included(self) -> bool:
        return runtime.rank() in self._members()

    def engine(self, what: str = "process set") -> Engine:
        """The engine running this set's collectives on this rank."""
        if self.process_set_id == 0:
            return runtime.engine()
        if self.process_set_id is None:
            raise ValueError(
                f"{what}: {self} is not registered; call dp.add_process_set() with it on every "
                "rank before using it"
            )
        if self._engine is None:
            raise ValueError(
                f"{what}: this rank ({runtime.rank()}) is not in {self}; call it only on the "
                "set's ranks"
            )
        return self._engine

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
_registered: dict[int, ProcessSet] = {}
_free_ids: list[int] = []


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register ``process_set`` (or a list of ranks) and return it. Collective over the job."""
    engine = runtime.engine()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    ranks = process_set.ranks
    if ranks == list(range(engine.size)) or any(p.ranks == ranks for p in _registered.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    set_id = _free_ids[0] if _free_ids else len(_registered) + 1
    process_set._engine = engine.subgroup(ranks, name=f"process_set.{set_id}")
    if _free_ids:
        _free_ids.pop(0)
    process_set.process_set_id = set_id
    _registered[set_id] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set``; True if it was registered. Collective: a job-wide
    barrier first, so no rank releases the set while its members still use it."""
    set_id = process_set.process_set_id
    if not set_id or _registered.get(set_id) is not process_set:
        return False
    engine = runtime.engine()
    if engine.size > 1:
        engine.barrier()
    _free_ids.append(set_id)
    remove_local(process_set)
    return True


def reset() -> None:
    """Forget every set (called by ``shutdown()`` before the engine goes)."""
    for process_set in list(_registered.values()):
        remove_local(process_set)
    _free_ids.clear()


def remove_local(process_set: ProcessSet) -> None:
    """Forget ``process_set`` on this rank and release its engine (no communication)."""
    _registered.pop(process_set.process_set_id or 0, None)
    process_set.process_set_id = None
    sub, process_set._engine = process_set._engine, None
    if sub is not None:
        sub.shutdown()


def engine_of(process_set: Any, what: str) -> Engine:
    """The engine for ``process_set`` (None or the global set: every rank)."""
    if process_set is None:
        return runtime.engine()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(
            f"{what}: process_set must be a dp.ProcessSet, got {type(process_set).__name__}; "
            "pass dp.global_process_set (the default) or one made by dp.add_process_set(ranks)"
        )
    return process_set.engine(what)
