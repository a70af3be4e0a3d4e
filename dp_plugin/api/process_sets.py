"""Process sets: collectives over a subset of ranks, as in Horovod.

One registry for every adapter, as Horovod's ``horovod.common.process_sets``
is one for torch and TensorFlow: ``dp_plugin.torch`` and
``dp_plugin.tensorflow`` export these very objects. ``ProcessSet``,
``global_process_set``, ``add_process_set`` and ``remove_process_set`` keep
Horovod 0.28.1's names and semantics. A set is registered with
``add_process_set`` (or ``init(process_sets=[...])``); then its ``engine()``
is a dp_plugin engine whose collectives run among the set's ranks only
(``Engine.subgroup``), with ranks relative to the set.

Distributed contract (as in Horovod):
- ``add_process_set`` and ``remove_process_set`` are collective: every rank
  of the job calls them, members or not, in the same order, with the same
  ranks. Ids are then equal on every rank (0 is the global set; freed ids
  are reused first-freed, first-reused, as Horovod does). A rank list that
  differs between ranks raises on every rank;
- no two registered sets may have the same ranks (``ValueError``, as
  Horovod), and the global set can be neither added nor removed;
- adding sets after ``init()``: under the horovod engine, as in Horovod,
  only if ``init(process_sets=...)`` was given (``"dynamic"`` or a list) or
  ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` was set, because Horovod then checks for
  new sets in every background cycle; every other engine can always add them;
- set-relative ranks: ``ProcessSet.rank()`` and the ranks of the set's
  engine count members in ascending global order; root ranks passed to
  collectives stay job-wide (``dp_plugin.agree.roots.root_of``).

Sets built from an mpi4py communicator are not supported (Horovod needs an
MPI build for them); build them from the list of ranks instead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from dp_plugin.agree import checked
from dp_plugin.agree.edge import caller, calling, public
from dp_plugin.engines.base import Engine
from dp_plugin.errors import NotInitializedError
from dp_plugin.launch import runtime


class ProcessSet:
    """A set of ranks that run collectives together.

    Create it with a list of global ranks, then register it with
    ``add_process_set`` (or ``init(process_sets=[...])``); until then
    ``process_set_id``, ``size()`` and ``rank()`` are None, as in Horovod.
    Pass it as ``process_set=`` to collectives and to
    ``DistributedOptimizer``; only its members may call those.
    """

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        if not isinstance(ranks_or_comm, Iterable) or isinstance(ranks_or_comm, str | bytes):
            raise ValueError(
                "ProcessSet should be initialized with a list of process ranks; got "
                f"{ranks_or_comm!r}. dp_plugin does not support sets made from an mpi4py "
                "communicator: pass its ranks, e.g. comm.Get_group().Translate_ranks("
                "list(range(comm.Get_size())), MPI.COMM_WORLD.Get_group())"
            )
        ranks = sorted(ranks_or_comm)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(
                f"ProcessSet should be initialized with a list of int process ranks, got {ranks!r}"
            )
        self.ranks = ranks
        self._engine: Engine | None = None

    def size(self) -> int | None:
        """Number of ranks in the set, or None if it is not registered."""
        return None if self.process_set_id is None else len(self._all_ranks())

    def rank(self) -> int | None:
        """This process's rank within the set, or None if it is not registered.

        Raises ``ValueError`` on a rank outside the set (as Horovod). Note that
        Horovod's collectives take *global* root ranks even with a set."""
        if self.process_set_id is None:
            return None
        ranks = self._all_ranks()
        me = _global_engine().rank
        if me not in ranks:
            raise ValueError(f"Process is not part of provided process set: {self}")
        return ranks.index(me)

    def included(self) -> bool | None:
        """Whether this process belongs to the set (None if it has no ranks yet)."""
        return None if self.ranks is None else _global_engine().rank in self._all_ranks()

    def engine(self) -> Engine:
        """The engine that runs this set's collectives on this rank.

        Raises ``ValueError`` naming the caller (``dp_plugin.agree.edge``) if the set
        was not added (or was removed), or if this rank is not a member."""
        what = caller("process set")
        if self.process_set_id is None:
            raise ValueError(
                f"{what}: {self} is not registered: call hvd.add_process_set() with it (on every "
                "rank), or pass it to hvd.init(process_sets=[...]), before using it in a collective"
            )
        if self.process_set_id == 0:
            return _global_engine()
        if self._engine is None:
            raise ValueError(
                f"{what}: this rank ({_global_engine().rank}) is not in {self}; only its "
                "ranks may run its collectives"
            )
        return self._engine

    def _all_ranks(self) -> list[int]:
        return list(range(_global_engine().size) if self.process_set_id == 0 else self.ranks or [])

    def _invalidate(self) -> None:
        """Forget the registration; release this rank's engine of the set."""
        self.process_set_id = None
        sub, self._engine = self._engine, None
        if sub is not None:
            sub.shutdown()

    def __str__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__


global_process_set = ProcessSet([])
"""Every rank of the job (id 0); its ranks are filled in by ``init()``."""
global_process_set.process_set_id = 0

_registered: dict[int, ProcessSet] = {}
"""Registered sets other than the global one, by id (equal on every rank)."""
_free_ids: deque[int] = deque()
_next_id = 1
not_initialized_error: type[NotInitializedError] = NotInitializedError
"""Raised by a process-set call before ``init()``: the adapter's subclass,
whose message names its own ``init()`` (set by ``HorovodBasics``)."""


@public("hvd.add_process_set()")
def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set after ``init()`` and return it, ready to use
    (collective: the module docstring's contract; a set whose ranks equal a
    registered set's, the global set's included, raises ``ValueError``)."""
    global _next_id
    engine = _global_engine()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    ranks = list(process_set.ranks or [])
    if ranks == list(range(engine.size)) or any(ps.ranks == ranks for ps in _registered.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    set_id = _free_ids[0] if _free_ids else _next_id
    process_set._engine = checked.subgroup(engine, ranks, f"process_set.{set_id}")
    if _free_ids:
        _free_ids.popleft()
    else:
        _next_id += 1
    process_set.process_set_id = set_id
    _registered[set_id] = process_set
    return process_set


@public("hvd.remove_process_set()")
def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set``; True if it was registered (the global set
    cannot be removed). Collective like ``add_process_set``: a job-wide
    barrier first, so that no rank releases the set (or exits, which ends a
    Horovod job) while its members still run collectives on it. The set's
    engine is then shut down on its members; the object may be added again."""
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0 or _registered.get(set_id) is not process_set:
        return False
    eng = _global_engine()
    if eng.size > 1:
        eng.barrier()
    del _registered[set_id]
    _free_ids.append(set_id)
    process_set._invalidate()
    return True


def registered(process_set_id: int) -> ProcessSet:
    """The set registered under ``process_set_id`` (0: the global set), else
    ``ValueError`` naming the id."""
    if process_set_id == 0:
        _global_engine()
        return global_process_set
    if process_set_id in _registered:
        return _registered[process_set_id]
    raise ValueError(
        f"{caller()}: process_set_id={process_set_id} is not a registered process set; use the "
        "process_set_id of a set returned by hvd.add_process_set(ranks) (0: the whole job)"
    )


def setup(process_sets: Any, adapter: str) -> None:
    """Register the sets passed to ``init(process_sets=...)``; called by an
    adapter's ``init`` right after the engine started (collective).

    ``process_sets``: None or ``"dynamic"`` (nothing to add; sets can always
    be added later), or a list of ``ProcessSet`` registered in list order.
    A duplicate entry raises ``ValueError`` naming its position, as Horovod's
    init does; ``adapter`` names the module whose init failed."""
    with calling("hvd.init()"):
        engine = _global_engine()
    global_process_set.ranks = list(range(engine.size))
    if process_sets is None or (isinstance(process_sets, str)
                                and process_sets.lower() == "dynamic"):
        return
    if isinstance(process_sets, ProcessSet) or not isinstance(process_sets, Iterable):
        raise ValueError(
            f"init(process_sets=...) expects a list of hvd.ProcessSet or 'dynamic', got "
            f"{process_sets!r}"
        )
    for index, process_set in enumerate(process_sets):
        if not isinstance(process_set, ProcessSet):
            raise ValueError(
                f"init(process_sets=...): entry number {index} is {process_set!r}, not an "
                "hvd.ProcessSet; wrap the ranks: hvd.ProcessSet([0, 1])"
            )
        try:
            add_process_set(process_set)
        except ValueError as exc:
            if "duplicate" not in str(exc):
                raise
            raise ValueError(
                f"{adapter} could not be initialized because process_sets entry number "
                f"{index} is a duplicate: {process_set}"
            ) from exc


def reset() -> None:
    """Forget every registered set and release its engines; called by an
    adapter's ``shutdown`` before the global engine goes."""
    global _next_id
    sets = list(_registered.values())
    _registered.clear()
    _free_ids.clear()
    _next_id = 1
    for process_set in sets:
        process_set._invalidate()


def engine_of(process_set: Any) -> Engine:
    """The engine that runs ``process_set``'s collectives on this rank.

    The one rule every caller uses: ``None`` or the global set means every
    rank; anything else must be a registered ``ProcessSet`` that contains
    this rank (else ``ValueError`` naming the rank and the set).
    """
    eng = engine_or_none(process_set)
    if eng is None:
        raise ValueError(
            f"{caller()}: this rank ({_global_engine().rank}) is not in its process set "
            f"{process_set!r}; call it only on the ranks of the process set"
        )
    return eng


def engine_or_none(process_set: Any) -> Engine | None:
    """``engine_of``, but None on a rank outside the set (``DistributedOptimizer``
    then steps on local gradients, as in Horovod)."""
    if process_set is None:
        return _global_engine()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(
            f"{caller()}: process_set must be an hvd.ProcessSet, got {type(process_set).__name__}; "
            "pass hvd.global_process_set (the default) or one made by hvd.add_process_set(ranks)"
        )
    if process_set.process_set_id is not None and not process_set.included():
        return None
    return process_set.engine()  # the global engine for the global set


def member_engines() -> list[Engine]:
    """The global engine, then the engine of every registered set this rank is in."""
    return [_global_engine(), *(ps.engine() for ps in _registered.values() if ps.included())]


def _global_engine() -> Engine:
    """``runtime.engine()``, or the adapter's ``NotInitializedError`` naming the caller."""
    if not runtime.is_initialized():
        raise not_initialized_error(caller("hvd.ProcessSet"))
    return runtime.engine()


__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]
