"""The collective-engine interface every engine implements.

An engine moves flat buffers between ranks; it knows nothing of tensors,
buckets or frameworks. Buffers are 1-D numpy arrays or torch tensors (see
``dp_plugin.reduce.arrays``); an engine converts them to what its library takes
without copying.

Contract shared by all engines:
- every rank calls the same collectives in the same order;
- ``allreduce_async`` works in place and returns a ``Handle``; the buffer
  must not be touched until ``Handle.wait()`` returns;
- every blocking wait honours ``config.timeout_s`` and raises
  ``CollectiveTimeoutError`` naming the collective and the rank, instead of
  hanging;
- ``allgather``, ``alltoall``, ``reducescatter`` and ``subgroup`` take a
  request the ranks have agreed on already (``dp_plugin.agree.check``:
  every rank's rows, the alltoall counts, the member list and hosts) and
  only move bytes; a buffer whose dtype cannot be reduced (bool, uint16,
  complex) moves as raw bytes. The base class implements alltoall,
  reducescatter and subgroup on top of all-gather and all-reduce; engines
  override the underscore methods where their library has a native path;
- Average is one definition on every engine, here: the library sums,
  then ``generic.average`` (the rule of ``hooks.ReducePolicy`` too); no
  library's native average is used, and ``_allreduce_async`` never sees it;
- open / closed / broken is the base class ``Lifecycle``'s (``lifecycle.py``);
  engines release their library's resources in ``_close``;
- subgroup engines are made by the engine's constructor with ``parent=``
  (plus the library's group object), never by copying private fields.
"""

from __future__ import annotations

import enum
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dp_plugin.config import Config
from dp_plugin.engines import generic
from dp_plugin.engines.generic import as_bytes, byte_rows
from dp_plugin.engines.handle import DoneHandle, Handle
from dp_plugin.engines.lifecycle import Lifecycle
from dp_plugin.launch.topology import Topology
from dp_plugin.reduce.dtypes import canonical_dtype

Started = tuple[Handle, Callable[[], Any]]
"""A collective in flight and the function that returns its output once
the handle is done (``allgather_async``, ``reducescatter_async``)."""


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


OP_FUNCTIONS = {ReduceOp.SUM: "add", ReduceOp.MIN: "minimum", ReduceOp.MAX: "maximum",
                ReduceOp.PRODUCT: "multiply"}
"""Each op's elementwise function, named alike in numpy and torch, for the
engines that combine buffers themselves (shared memory, MPI's emulated halves)."""

@dataclass(frozen=True)
class Availability:
    """Whether an engine can run here, and why (shown by ``make check``)."""

    ok: bool
    reason: str


class Engine(Lifecycle):
    """One collective library. Subclasses set ``name`` and implement the
    underscore methods; the public methods check the engine is usable,
    validate input and add timeouts. ``parent``: the engine a subgroup
    engine was split from (None for the engine ``init`` made)."""

    def __init__(self, topology: Topology, config: Config, *,
                 parent: Engine | None = None) -> None:
        self.topology = topology
        self.config = config
        self.global_ranks: tuple[int, ...] = tuple(range(topology.size))
        """The job-wide ranks of this engine's members, indexed by its own
        rank (``range(size)`` for the engine ``init`` made; see ``subgroup``)."""
        super().__init__(parent)
        self.channels_made = 0
        """How many ``channel`` calls this engine answered (names streams)."""

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

    @property
    def job_rank(self) -> int:
        return self.global_ranks[self.rank]

    @property
    def buffer_device(self) -> str:
        """Where this engine takes buffers: "cpu", or "cuda:<i>" (nccl).
        Control buffers and staging copies belong there."""
        return "cpu"

    @property
    def native_reducescatter(self) -> bool:
        """Does ``reducescatter`` use the library's own reduce-scatter (each
        rank receives only its rows), rather than the generic all-reduce of
        a copy and a slice (``generic.reducescatter_by_allreduce``)?"""
        return type(self)._reducescatter_start is not Engine._reducescatter_start

    def allreduce_async(self, buf: Any, op: ReduceOp | str = ReduceOp.SUM,
                        name: str = "allreduce") -> Handle:
        """Start an in-place all-reduce of the 1-D buffer ``buf``."""
        self._check_usable(f"allreduce {name!r}")
        op = ReduceOp.parse(op)
        _check_flat(buf, f"allreduce {name!r}")
        if op is not ReduceOp.AVERAGE:
            return self._allreduce_async(buf, op, name)
        return self._allreduce_async(buf, ReduceOp.SUM, name).then(
            lambda: generic.average(buf, self.size))

    def scaled_sum_async(self, buf: Any, factor: float, name: str = "allreduce") -> Handle | None:
        """Start a sum all-reduce of ``buf`` times ``factor`` in one pass,
        bitwise what multiplying afterwards gives, or return None where this
        engine cannot (the caller multiplies; gloo on shared memory can)."""
        return None

    def broadcast_async(self, buf: Any, root: int, name: str = "broadcast") -> Handle:
        """Start an in-place broadcast of the 1-D buffer ``buf`` from ``root``."""
        self._check_usable(f"broadcast {name!r}")
        if not isinstance(root, int) or not 0 <= root < self.size:
            raise ValueError(
                f"{name}: root rank {root!r} is out of range; expected 0 <= root < {self.size}"
            )
        buf = generic.flat_bytes(buf)  # any dtype moves
        _check_flat(buf, f"broadcast {name!r}")
        return self._broadcast_async(buf, root, name)

    def broadcast(self, buf: Any, root: int, name: str = "broadcast") -> None:
        """In-place broadcast of ``buf`` from ``root`` to every rank."""
        self.broadcast_async(buf, root, name).wait()

    def allgather(self, buf: Any, rows: Sequence[int], name: str = "allgather") -> Any:
        """Concatenate every rank's buffer along the first dimension.

        ``rows[r]`` is rank r's first dimension, as the ranks agreed
        (``checked.allgather`` checks, then calls this); the other dimensions
        and the dtype are the same on every rank. Returns a new buffer of
        the same kind as ``buf``. Collective and a synchronization point.
        """
        handle, result = self.allgather_async(buf, rows, name)
        handle.wait()
        return result()

    def allgather_async(self, buf: Any, rows: Sequence[int],
                        name: str = "allgather") -> Started:
        """``allgather`` started: the rows move in the background where the
        engine can (torch.distributed, MPI). Returns ``(handle, result)``:
        wait for ``handle``, then ``result()`` is the output."""
        self._check_usable(f"allgather {name!r}")
        raw, restore = as_bytes(buf)
        handle, result = self._allgather_start(raw, [int(r) for r in rows], name)
        return handle, lambda: restore(result())

    def barrier(self) -> None:
        self._check_usable("barrier")
        self._barrier()

    def alltoall(self, buf: Any, counts: Any, name: str = "alltoall") -> tuple[Any, list[int]]:
        """Send row blocks of ``buf`` to every rank; return what this rank got.

        ``counts[i, j]`` (agreed by every rank: ``dp_plugin.agree.check``)
        is the number of rows rank i sends to rank j: rank r sends rows
        ``buf[o_j : o_j + counts[r, j]]`` to rank j, where ``o_j =
        sum(counts[r, :j])``. Returns ``(received, received_splits)``: the
        rows that ranks 0, 1, ... sent to this rank, concatenated in rank
        order (a new buffer of the same kind as ``buf``), and how many rows
        came from each rank. Collective and a synchronization point.
        """
        self._check_usable(f"alltoall {name!r}")
        table = np.asarray(counts, dtype=np.int64)
        raw, restore = byte_rows(buf)
        received = restore(self._alltoall(raw, table, name))
        return received, [int(c) for c in table[:, self.rank]]

    def reducescatter(self, buf: Any, op: ReduceOp | str = ReduceOp.SUM,
                      name: str = "reducescatter") -> Any:
        """Reduce ``buf`` over the ranks; return this rank's block of rows.

        ``buf`` (numpy or torch, at least 1-D) has the same shape and dtype
        on every rank (agreed). The reduced result is split along the first
        dimension as Horovod 0.28.1 does (``reducescatter_counts``). Returns
        a new buffer of the same kind as ``buf``; the input is not modified.
        ``op``: sum, average (the sum times ``1 / size``, ``generic.average``),
        min, max or product.
        """
        handle, result = self.reducescatter_async(buf, op, name)
        handle.wait()
        return result()

    def reducescatter_async(self, buf: Any, op: ReduceOp | str = ReduceOp.SUM,
                            name: str = "reducescatter") -> Started:
        """``reducescatter`` started, the reduction in the background where
        the engine can. Returns ``(handle, result)`` as ``allgather_async``."""
        op = ReduceOp.parse(op)
        self._check_usable(f"reducescatter {name!r}")
        counts = reducescatter_counts(int(buf.shape[0]), self.size)
        if op is not ReduceOp.AVERAGE:
            return self._reducescatter_start(buf, op, counts, name)
        handle, result = self._reducescatter_start(buf, ReduceOp.SUM, counts, name)
        return handle, lambda: generic.average(result(), self.size)

    def subgroup(self, members: Sequence[int], hosts: Sequence[int],
                 name: str = "process_set") -> Engine | None:
        """An engine whose collectives run among ``members`` only.

        ``members`` are this engine's ranks, sorted, unique and non-empty,
        and ``hosts[r]`` rank r's host key, as every rank agreed
        (``dp_plugin.agree.checked.subgroup`` checks, then calls this). Collective
        over *all* ranks of this engine. Members get a new engine with
        ``rank``/``size`` relative to the group (group rank i is
        ``members[i]``; broadcast roots are group ranks) and ``global_ranks``
        naming the job-wide ranks; non-members get None. ``_subgroup`` makes
        it with ``parent=self``; how long it lives: ``lifecycle.py``.
        """
        self._check_usable(f"subgroup {name!r}")
        members = tuple(members)
        topology = (group_topology(self.topology, members, self.rank, hosts)
                    if self.rank in members else None)
        child = self._subgroup(members, topology, name)
        if child is not None:
            child.global_ranks = tuple(self.global_ranks[m] for m in members)
        return child

    def channel(self, name: str = "channel") -> Engine:
        """A communicator of its own over this engine's ranks, for a stream of
        collectives whose timing differs between ranks (an optimizer's
        gradient buckets: a parameter unused on one rank makes its bucket
        start at the step's end there and mid-backward elsewhere). Its
        collectives never meet those of this engine or of another channel, so
        each stream only has to be in order by itself.

        Collective over this engine's ranks (it creates a group): every rank
        calls it at the same point. Released by ``shutdown`` of either.
        Engines that match collectives by name (horovod), or have one rank,
        return themselves: names must then differ per stream.
        """
        self._check_usable(f"channel {name!r}")
        self.channels_made += 1
        if self.size == 1:
            return self
        child = self._channel(name)
        if child is not self:
            child.global_ranks = self.global_ranks
            self._channels.append(child)
        return child

    # -- to implement ------------------------------------------------------
    @abstractmethod
    def _allreduce_async(self, buf: Any, op: ReduceOp, name: str) -> Handle: ...

    @abstractmethod
    def _broadcast_async(self, buf: Any, root: int, name: str) -> Handle: ...

    def _allgather(self, buf: Any, rows: list[int], name: str) -> Any:
        """``allgather`` of agreed rows, without calling it. Engines implement
        this or ``_allgather_start``; default: that one, waited for."""
        handle, result = self._allgather_start(buf, rows, name)
        handle.wait()
        return result()

    @abstractmethod
    def _barrier(self) -> None: ...

    # -- may override where the library has a native path -------------------
    def _alltoall(self, buf: Any, counts: np.ndarray, name: str) -> Any:
        """``alltoall`` of ``buf``'s rows of bytes (``generic.byte_rows``): the
        rows this rank receives, of the same kind. Generic path:
        ``generic.alltoall_by_allgather``."""
        return generic.alltoall_by_allgather(self, buf, counts, name)

    def _allgather_start(self, buf: Any, rows: list[int], name: str) -> Started:
        """Start ``_allgather``; engines with a non-blocking library call
        implement this instead. Default: the rows move now (the handle is done)."""
        out = self._allgather(buf, rows, name)
        return self._done(self.describe("allgather", name)), lambda: out

    def _reducescatter_start(self, buf: Any, op: ReduceOp, counts: list[int],
                             name: str) -> Started:
        """Start reducing with ``op`` (native for this engine); ``result()`` is
        this rank's ``counts[rank]`` rows. Generic path: all-reduce a copy,
        then slice (``generic.reducescatter_by_allreduce``)."""
        return generic.reducescatter_by_allreduce(self, buf, op, counts, name)

    def _channel(self, name: str) -> Engine:
        """A new communicator over the same ranks. Default: a subgroup of
        every rank, each in its own place: there is nothing to agree on."""
        child = self._subgroup(tuple(range(self.size)), self.topology, name)
        assert child is not None  # every rank is a member
        return child

    def _subgroup(self, members: tuple[int, ...], topology: Topology | None,
                  name: str) -> Engine | None:
        """Create the group; called on every rank. ``topology`` is the
        member's place in the group, None on non-members (return None)."""
        raise NotImplementedError(
            f"subgroup {name!r}: the {self.name} engine cannot create process sets; use the "
            "gloo, mpi or horovod engine (DP_PLUGIN_ENGINE)"
        )

    def _job_wide_only(self, members: tuple[int, ...], name: str, why: str) -> None:
        """Refuse to split a subgroup: the library makes groups over the whole job."""
        if self._parent is not None:
            raise NotImplementedError(
                f"subgroup {name!r}: a {self.name} subgroup cannot be split further ({why}); "
                "create it from the job-wide engine with the job-wide ranks "
                f"{[self.global_ranks[m] for m in members]}"
            )

    def _done(self, description: str) -> Handle:
        """The handle of a collective that needs no communication (done already)."""
        return DoneHandle(description, self.job_rank, self.config.timeout_s)

    def describe(self, collective: str, name: str, nbytes: int | None = None) -> str:
        size = "" if nbytes is None else f", {nbytes} bytes"
        return f"{self.name} {collective} of {name!r}{size}"


def _check_flat(buf: Any, what: str) -> str:
    shape = tuple(buf.shape)
    if len(shape) != 1:
        raise ValueError(f"{what}: expected a 1-D buffer, got shape {shape}; flatten it first")
    return canonical_dtype(buf.dtype)


def reducescatter_counts(rows: int, size: int) -> list[int]:
    """Rows each rank keeps after a reduce-scatter of ``rows`` rows.

    Horovod 0.28.1's rule (``ReducescatterOp::ComputeOutputShapeForRank``):
    ``rows // size`` each, and ranks ``0 .. rows % size - 1`` one more.
    """
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


def group_topology(parent: Topology, members: Sequence[int], me: int,
                   hosts: Sequence[int]) -> Topology:
    """The topology of parent-rank ``me`` inside the group ``members``.

    ``hosts[r]`` is parent rank r's host key. Local rank and size count the
    members on this host; cross rank and size follow Horovod's meaning
    (position among the members with the same local rank).
    """
    same_host = [m for m in members if hosts[m] == hosts[me]]
    local_of = {m: sum(1 for n in members if n < m and hosts[n] == hosts[m]) for m in members}
    peers = [m for m in members if local_of[m] == local_of[me]]
    return Topology(
        launcher=parent.launcher,
        rank=list(members).index(me),
        size=len(members),
        local_rank=local_of[me],
        local_size=len(same_host),
        cross_rank=peers.index(me),
        cross_size=len(peers),
        rendezvous_addr=parent.rendezvous_addr,
        rendezvous_port=parent.rendezvous_port,
        hostname=parent.hostname,
    )
