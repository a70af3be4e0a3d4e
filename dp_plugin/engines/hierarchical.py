"""The hierarchical all-reduce of the gloo engine: for jobs with several
ranks per host and several hosts.

A flat ring over every rank sends each byte ``2 (N - 1) / N`` times across
the slowest link there is, and the ranks of one host all queue on their
host's link. Here each host reduces inside itself through shared memory
first, so only one host's worth of data crosses between hosts, split
among the host's ranks so that every rank's link share is used at once.
With P ranks per host, local rank j owns shard j (elements
[j n / P, (j + 1) n / P), ``shm.shard``) of every buffer:

1. reduce-scatter inside the host through the shared-memory segment
   (``shm.py``): local rank j holds the host's sum of shard j;
2. all-reduce of shard j across hosts, over Gloo, among the ranks of
   local rank j (one group per local rank: P all-reduces run at once, one
   per rank of the host);
3. all-gather inside the host through the segment: every rank has every
   shard.

Steps 1 and 3 copy the same bytes out on every rank of a host, and step 2
leaves the same bytes on every member of a cross group (Gloo reduces each
piece once and sends the result on), so the ranks stay bitwise equal. The
sum is taken in another order than a flat ring's (host first): within
rounding of it, not bitwise.

**When.** Decided once for the whole job, as Horovod does, from one
exchange of every rank's row (``row``): its vote and where its launcher
variables put it (host index, local rank, ranks on its host). A rank's
vote (``vote``): ``DP_PLUGIN_HIERARCHICAL_ALLREDUCE`` (or Horovod's
``HOROVOD_HIERARCHICAL_ALLREDUCE``, the same switch) forces it on (1) or
off (0); unset, it is on where the rank's own topology (``Topology``:
``cross_size`` hosts of ``local_size`` ranks) has more than one host and
more than one rank per host, and shared memory is allowed
(``DP_PLUGIN_SHARED_MEMORY``). ``decide`` reads the same table on every
rank, so every rank takes the same path: hierarchical where every rank
votes for it and the ranks form a full grid of hosts with the same
number of ranks each (``layout``). Anything else (hosts of 3, 1 and 2
ranks; under horovodrun, whose cross size counts the ranks of one local
rank and so differs between the ranks of such a host; ranks whose
settings differ) leaves every rank on the flat ring, said once in the
log (a warning where a rank forced it on). Shared memory that any rank
cannot set up does the same.

**Pipelined.** Run one after another, the three steps leave the link
idle during every shared-memory step and every gap between operations
(busy 75% of the time: docs/benchmarks-history.md). So each all-reduce is
cut into pieces of ``PIECE_BYTES`` and the steps run as a three-stage
pipeline, in FIFO order of pieces: the reduce-scatter of piece k + 1 runs
while piece k crosses the hosts while piece k - 1 is all-gathered. Two
transports, each with its own segment, sockets and thread: the *reduce*
transport reduce-scatters piece after piece and starts each shard's
cross-host all-reduce without waiting for it (Gloo's queue is FIFO too);
the *gather* transport waits for a piece's cross-host all-reduce, then
all-gathers it. Each transport's sequence is the order in which the
pieces were queued, the same on every rank whatever is in flight at any
moment: nothing depends on timing. Each stage keeps the transport's
per-operation header check; a failure in either (a mismatch, a peer gone,
a deadline) finishes the all-reduce's handle with that error on every
rank and breaks the transport, so later all-reduces fail too. A cross-host
step that fails names the job ranks it could not reach, and so do the
host's other ranks (``HierarchicalAllreduce.unreachable``). Where the
second segment does not fit the shared-memory budget, every rank of the
job runs the unpipelined steps (said once in the log).

**Contract.** The engine's: every rank starts the same all-reduces in the
same order. Each engine and optimizer channel has its own segments and its
own cross-host groups, and runs its all-reduces on the segments' threads in
order, so step 2 of one all-reduce never meets another's. Other
collectives (broadcast, all-gather, ...) stay on the flat Gloo group.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dp_plugin.config import Config
from dp_plugin.engines.base import ReduceOp
from dp_plugin.engines.deadline import is_standing, poll, standing
from dp_plugin.engines.handle import Handle
from dp_plugin.engines.shm import ShmHandle, ShmTransport
from dp_plugin.engines.waits import lost_text
from dp_plugin.errors import CollectiveTimeoutError, DPPluginError
from dp_plugin.launch.topology import Topology

log = logging.getLogger("dp_plugin")

CROSS_DTYPES = frozenset({"float16", "float32", "float64", "int8", "uint8", "int16", "int32",
                          "int64"})
"""What the cross-host step moves through Gloo (the engine widens int16);
other dtypes take the flat ring."""
PIECE_BYTES = 4 << 20
"""Bytes of one piece of the pipelined all-reduce: small enough that the
first reduce-scatter and the last all-gather, the only shared-memory steps
the link waits for, are short; large enough that a piece's fixed cost
(four barriers and one Gloo operation) stays small next to its transfer."""
WAKE_S = 0.05
"""How often a wait between the stages looks whether the engine is closing."""


NO, AUTOMATIC, FORCED = 0, 1, 2
"""A rank's vote (``vote``)."""


def vote(topology: Topology, config: Config) -> int:
    """This rank's vote (module docstring, **When.**); only ``decide``, over
    every rank's vote, says what the job does."""
    if config.hierarchical_allreduce is not None:
        return FORCED if config.hierarchical_allreduce and topology.size > 1 else NO
    several = topology.cross_size > 1 and topology.local_size > 1
    return AUTOMATIC if config.shared_memory and several else NO


def row(topology: Topology, config: Config) -> np.ndarray:
    """This rank's row of the exchange ``decide`` reads: its vote, host
    index, local rank and the number of ranks on its host."""
    return np.array([vote(topology, config), topology.cross_rank, topology.local_rank,
                     topology.local_size], dtype=np.int64)


def decide(table: np.ndarray) -> tuple[Layout | None, str]:
    """The job's one answer from every rank's ``row`` (the same table on
    every rank, so the same answer): the layout where every rank votes for
    the hierarchical path and the ranks form a grid; else None, and why
    ("" when no rank wants it: nothing to say)."""
    votes = table[:, 0]
    if not votes.any():
        return None, ""
    grid, why = layout(table[:, 1:])
    if grid is None:
        return None, why
    against = [r for r, v in enumerate(votes.tolist()) if v == NO]
    if against:
        return None, (f"rank(s) {_ranks(against)} do not want it (DP_PLUGIN_HIERARCHICAL_ALLREDUCE"
                      "=0 or DP_PLUGIN_SHARED_MEMORY=0 there) and the others do; set the same "
                      "values on every rank")
    return grid, ""


@dataclass(frozen=True)
class Layout:
    """The job as hosts of ranks, from every rank's (host index, local rank)."""

    hosts: tuple[tuple[int, ...], ...]
    """Every host's job ranks, by local rank; hosts by index."""

    def host_of(self, rank: int) -> tuple[int, ...]:
        """The ranks on ``rank``'s host, by local rank."""
        return next(h for h in self.hosts if rank in h)

    def peer_groups(self) -> list[tuple[int, ...]]:
        """For each local rank j, the ranks of local rank j on every host."""
        return [tuple(h[j] for h in self.hosts) for j in range(len(self.hosts[0]))]


def layout(table: np.ndarray) -> tuple[Layout | None, str]:
    """The layout from row r = (host index, local rank, ranks on its host)
    of rank r, or None and why it is not a grid of hosts with the same
    number of ranks each (naming job ranks)."""
    said: dict[int, list[int]] = {}
    for rank, local_size in enumerate(table[:, 2].tolist()):
        said.setdefault(local_size, []).append(rank)
    if len(said) > 1:
        counts = "; ".join(f"{_ranks(ranks, True)}: {n}" for n, ranks in said.items())
        return None, f"the hosts run different numbers of ranks (ranks on its host: {counts})"
    hosts: dict[int, dict[int, int]] = {}
    for rank, (host, local, _) in enumerate(table.tolist()):
        if local in hosts.setdefault(host, {}):
            return None, (f"ranks {hosts[host][local]} and {rank} both say they are local rank "
                          f"{local} of host {host}")
        hosts[host][local] = rank
    sizes = {len(h) for h in hosts.values()}
    if len(sizes) != 1:
        counts = "; ".join(f"host {k}: {_ranks(sorted(v.values()), True)}"
                           for k, v in sorted(hosts.items()))
        return None, f"the hosts run different numbers of ranks ({counts})"
    per_host = sizes.pop()
    if per_host < 2:
        return None, "every host runs one rank: nothing to reduce inside a host"
    for k, h in hosts.items():
        if sorted(h) != list(range(per_host)):
            return None, f"host {k}'s local ranks are {sorted(h)}, not 0..{per_host - 1}"
    return Layout(tuple(tuple(h[j] for j in range(per_host))
                        for _, h in sorted(hosts.items()))), ""


def _ranks(ranks: Sequence[int], named: bool = False) -> str:
    """Job ranks as a message lists them: '0, 1, 2' ('ranks 0, 1, 2', 'rank 3')."""
    text = ", ".join(map(str, ranks))
    return text if not named else f"rank{'s' if len(ranks) > 1 else ''} {text}"


class HierarchicalAllreduce:
    """One engine's (or channel's) hierarchical all-reduce: the host's
    shared-memory transport, the second one of the all-gather stage
    (``gather``; None: unpipelined) and the Gloo engine over this rank's
    peers of the same local rank on the other hosts (None with one host)."""

    def __init__(self, transport: ShmTransport, cross: Any,
                 gather: ShmTransport | None = None) -> None:
        self._transport = transport
        self._gather = gather
        self._cross = cross
        self._queueing = threading.Lock()
        self._closing = threading.Event()
        (gather or transport).on_break = self._break

    @property
    def pipelined(self) -> bool:
        """Whether the steps run as a pipeline of pieces (module docstring)."""
        return self._gather is not None

    def takes(self, t: Any) -> bool:
        """Whether ``t`` (a contiguous torch tensor) goes this way."""
        return self._transport.takes(t) and str(t.dtype).removeprefix("torch.") in CROSS_DTYPES

    def allreduce_async(self, t: Any, op: ReduceOp, description: str, on_timeout: Any,
                        board: Any) -> Handle:
        """Queue the three steps of the module docstring: pipelined in
        pieces over the two transports, or unpipelined, the whole buffer as
        one piece whose two stages run one after the other on the host's
        transport thread. The handle has a part per stage of every piece
        (``ShmHandle``). Issued inside ``deadline.standing()``: no step has
        a deadline of its own, its cross-host one included; the caller
        bounds the wait."""
        reduce_t, gather_t = self._transport, self._gather or self._transport
        data = t.view(-1)
        n = data.numel()
        step = max(1, PIECE_BYTES // t.element_size() if self.pipelined else n)
        handle = ShmHandle(description, reduce_t.job_rank, reduce_t.timeout_s, on_timeout, board,
                           parts=2 * -(-n // step))
        deadline = None if is_standing() else handle.started_at + reduce_t.timeout_s
        with self._queueing:  # both queues take the pieces in the same order
            for lo in range(0, n, step):
                piece = data[lo:lo + step]
                elements = f"elements {lo}..{lo + piece.numel()}" if self.pipelined else ""
                where = f", {elements}" if elements else ""
                whole = (lo, n) if self.pipelined else (0, 0)
                crossing = _Crossing(self, handle, op, f"{description} (across hosts{where})",
                                     elements, deadline)
                reduce_t.stage_async("reducescatter", piece, op, handle, deadline,
                                     after=crossing.start, on_error=crossing.fail, whole=whole)
                gather_t.stage_async("allgather", piece, op, handle, deadline,
                                     before=crossing.wait, on_error=crossing.settle, whole=whole)
        return handle

    def _break(self, error: BaseException) -> None:
        """The last stage's transport broke (on its thread): every piece
        before the failed one is done. Break the reduce stage's too, whose
        queue holds only pieces at or past it, and shut both down so that
        the host's peers stop at once (``ShmTransport.fail``). A reduce
        stage that breaks first reaches here through its pieces' crossings."""
        for t in (self._transport, self._gather):
            if t is not None:
                t.fail(error)

    def until(self, done: Any, deadline: float | None, job: ShmHandle, name: str) -> None:
        """Wait for ``done()`` on a transport's thread: by ``deadline`` (a
        ``time.perf_counter`` value; ``job``'s timeout error after it), or
        with none (a standing all-reduce) while the engine is open. Closing
        ends the wait at once, with an error naming ``name``."""
        while True:
            left = WAKE_S if deadline is None else min(WAKE_S, deadline - time.perf_counter())
            if poll(done, max(0.0, left), step=2e-5, longest=1e-3):
                return
            if self._closing.is_set():
                raise DPPluginError(f"rank {job.rank}: {name} was still waiting when the "
                                    "engine shut down")
            if deadline is not None and time.perf_counter() >= deadline:
                raise job.timeout_error()

    def unreachable(self, error: BaseException, job: ShmHandle, elements: str) -> DPPluginError:
        """The error of a cross-host step that failed (not by its deadline),
        in dp_plugin's words: which job ranks could not be reached, said on
        the board first (``WaitBoard.post_lost``) so that this host's ranks,
        which see only this rank close its shared-memory connections, can
        name them too. The library's own text follows, shortened."""
        me = getattr(self._cross, "job_rank", None)
        peers = [r for r in getattr(self._cross, "global_ranks", ()) if r != me]
        place = ("its peer on another host" if len(peers) == 1 else
                 "its peers on the other hosts") + ", in the cross-host step"
        if job.board is not None:
            job.board.post_lost(peers, place)
        place += f" of {elements}" if elements else ""
        who = lost_text(peers, place) if peers else f"a peer ({place})"
        return DPPluginError(
            f"rank {job.rank}: {job.description} failed: {who} cannot be reached; it has "
            "probably died, or its host is down or cut off: check its log first (the "
            "cross-host library said: "
            f"{_first_sentence(error)}).{job.report()}"
        )

    def close(self) -> None:
        """Stop the transports (their threads may be in a cross step or
        waiting for one: ``_closing`` ends a wait with no deadline), then
        the cross group."""
        self._closing.set()
        self._transport.close()
        if self._gather is not None:
            self._gather.close()
        if self._cross is not None:
            self._cross.shutdown()


class _Crossing:
    """One piece's cross-host all-reduce, between its two stages: started by
    the reduce transport's thread once the piece is reduce-scattered (or
    failed, if that stage failed or was skipped), waited for by the gather
    transport's thread before the piece's all-gather (or, if that stage
    fails or is skipped, until it no longer writes into the piece: ``settle``).

    No stand-in is started for a piece this rank skips: the peers on the
    other hosts would take its bytes for this host's sum and succeed with a
    wrong result. A peer that started its own waits for it to its deadline."""

    __slots__ = ("_deadline", "_elements", "_error", "_handle", "_job", "_name", "_op", "_owner",
                 "_ready")

    def __init__(self, owner: HierarchicalAllreduce, job: ShmHandle, op: ReduceOp, name: str,
                 elements: str, deadline: float | None) -> None:
        self._owner, self._job, self._op, self._name = owner, job, op, name
        self._elements = elements
        self._deadline = deadline  # None: a standing all-reduce
        self._ready = threading.Event()
        self._handle: Handle | None = None
        self._error: BaseException | None = None

    def start(self, part: Any) -> None:
        """Start the cross-host all-reduce of this rank's shard of the piece
        (none with one host or an empty shard: the same on every peer)."""
        cross = self._owner._cross
        if cross is not None and part.numel():
            with standing(self._deadline is None):  # on this transport's thread
                self._handle = cross.allreduce_async(part, self._op, name=self._name)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    def settle(self, _: BaseException) -> None:
        """The all-gather of this piece failed or was skipped: ``wait`` all
        the same (class docstring); its outcome is not the handle's."""
        with contextlib.suppress(Exception):
            self.wait(self._deadline)

    def wait(self, deadline: float | None) -> None:
        """Until the cross-host all-reduce is done (``HierarchicalAllreduce.until``)."""
        self._owner.until(self._ready.is_set, deadline, self._job, self._name)
        if self._error is not None:
            raise self._error
        if self._handle is not None:
            self._owner.until(self._crossed, deadline, self._job, self._name)

    def _crossed(self) -> bool:
        """Whether the cross-host all-reduce is over; its failure raised in
        the words of the all-reduce it is a step of (the cross engine's own
        message would wrap that all-reduce's description in its own)."""
        assert self._handle is not None
        try:
            if not self._handle.done():
                return False
            self._handle.wait()  # done: raises the cross step's own error, if any
        except CollectiveTimeoutError:
            raise self._job.timeout_error() from None
        except DPPluginError as exc:
            raise self._owner.unreachable(exc, self._job, self._elements) from exc
        return True


def _first_sentence(error: BaseException) -> str:
    """The library's own reason, without its source location or its advice:
    Gloo's "[.../pair.cc:537] Read error [10.0.0.2]:13209: Connection reset
    by peer. This is typically caused by ..." becomes "Read error
    [10.0.0.2]:13209: Connection reset by peer"."""
    text = str(error.__cause__ or error).strip()
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". ")[0].rstrip(".")[:300]
