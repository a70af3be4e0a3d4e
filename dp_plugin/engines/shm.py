"""Shared-memory collectives for the ranks of one host: the gloo engine's
fast path, and the intra-host half of the hierarchical all-reduce.

Gloo moves bytes between the processes of one host through loopback TCP:
the kernel copies every byte twice and the CPU time comes out of the cores
that also run backward. Here the ranks of a single-host group share one
memory segment instead, as NCCL's SHM transport and MPI's shared-memory
channels do. One all-reduce, in chunks of at most ``chunk_bytes``:

1. every rank copies its chunk into its own slot of the segment;
2. barrier;
3. rank r reduces the r-th slice of all slots, in rank order (the same
   order on every rank and slice), into the result area;
4. barrier;
5. every rank copies the result area back into its buffer.

Every rank copies the same bytes out, so the ranks are bitwise equal. The
segment holds two sets of slots and result area, used by even and odd chunks:
step 1 of chunk k + 1 and step 5 of chunk k - 1 run beside step 3 of
chunk k, so barrier 4 of one chunk is barrier 2 of the next (m + 1
barriers for m chunks). A set is rewritten only two chunks later, after a
barrier that every rank reaches only once done reading it.

A reduce-scatter is the same with step 5 copying out only this rank's
shard (``shard``: rank r owns elements [r n / P, (r + 1) n / P)); an
all-gather copies each rank's shard into its slot (step 1), no step 3,
and every rank copies every slot's shard out (step 5).

A barrier is one byte sent to and read from every peer over UNIX sockets:
a blocking read with the collective's timeout (no spinning on cores that
compute), a peer that dies closes its sockets and fails the read at once,
and the system calls order the memory accesses around them.

**Every operation says what it is.** The first barrier of an operation
carries, instead of its one byte, the operation's header (``_HEADER``).
Every rank compares each peer's header with its own once it has read them
all; a difference raises ``LayoutMismatchError`` on every rank, naming
both sides, before any byte is combined. The layers above agree first;
this check does not trust them: a cached collective that skipped the
agreement would otherwise be mixed silently with another rank's different
one. Riding on the barrier, it costs one struct pack and a bytes
comparison per peer: ``dp-plugin bench --shm-check`` measures it.

**Nothing on disk, nothing left by a crash.** The segment is an anonymous
``memfd`` made by rank 0 and handed to the others over the UNIX sockets
(``SCM_RIGHTS``); the sockets live in the abstract namespace (Linux: no
file). Both vanish with the last process that holds them, whatever the
moment it dies. Abstract sockets obey no file mode: every connection is
checked with ``SO_PEERCRED`` and one from another user is dropped (both
directions), so the transport is private to the job's user whatever the
umask; the names also carry rank 0's 62 random bits.

**Budget.** The segment (``2 (ranks + 1)`` chunks,
its pages reserved when made: ``posix_fallocate``) is shared memory: it
counts against the same pool as ``/dev/shm`` (a container's 64 MiB by
default). All the segments this process holds stay within
``budget_bytes`` (``DP_PLUGIN_SHARED_MEMORY_BUDGET``; default a quarter of
``/dev/shm``'s size) and within the room left there; the chunk halves down
to ``MIN_CHUNK_BYTES`` to fit, and below that every rank keeps Gloo's TCP,
said once in the log.

All operations run on one thread per transport, in the order they were
started (the engine contract: same collectives, same order, every rank).
The pipelined hierarchical all-reduce holds two transports, one per
stage (``stage_async``): each runs its stages in the order they were
queued, so each segment sees the same sequence on every rank.
``close`` never unmaps the segment while that thread may still touch it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from dp_plugin.engines.base import OP_FUNCTIONS, ReduceOp
from dp_plugin.engines.deadline import is_standing
from dp_plugin.engines.handle import Handle
from dp_plugin.engines.waits import lost_text
from dp_plugin.errors import CollectiveTimeoutError, DPPluginError, LayoutMismatchError
from dp_plugin.reduce.dtypes import canonical_dtype

log = logging.getLogger("dp_plugin")

SHM_DIR = "/dev/shm"
"""Where the shared-memory pool's size and room are read (the segment itself
is a memfd, charged to the same pool, with no name there)."""
CHUNK_BYTES = 8 << 20
"""Largest chunk one round moves; smaller where the budget or the room is
(**Budget.**), down to ``MIN_CHUNK_BYTES``: the smallest any rank can afford."""
MIN_CHUNK_BYTES = 64 << 10
BUDGET_SHARE = 4
"""Default budget: 1/4 of ``/dev/shm``'s size for all of a process's segments."""
DTYPES = ("float16", "bfloat16", "float32", "float64",
          "int8", "uint8", "int16", "int32", "int64")
"""What the transport reduces (torch CPU kernels exist for each); other
dtypes take the engine's own path. The index is the dtype's code in a header."""
SCALED_DTYPES = frozenset({"float32", "float64"})
"""Where a post-scale folded into the reduction rounds exactly as the
scheduler's own multiply afterwards (``arrays.TorchOps`` and ``NumpyOps``
agree on these; numpy rounds the factor to a 16-bit dtype first, torch not)."""
KINDS = ("allreduce", "reducescatter", "allgather")
OPS = tuple(ReduceOp)
_PLAIN = b"\x01"
"""A barrier's byte: every barrier but an operation's first, which
carries its header instead (unless the transport is not ``checked``)."""
_HEADER = struct.Struct("<5qd2q")
"""An operation's header, 64 bytes: sequence, kind, count, dtype, op (int64s),
post-scale (a float64), and for a stage of a pipelined all-reduce
the piece's offset in its tensor and the tensor's element count (0 and 0
otherwise: a piece of the same size from another tensor does not pass)."""
MAX_RANKS = 512
_NAME = "dp_plugin-{token:x}-{rank}"
"""Abstract socket name of a rank (a leading NUL: no file)."""

_held_lock = threading.Lock()
_held_bytes = 0
"""Bytes of every segment this process maps now (its share of the budget)."""
_fallback_said: set[str] = set()
"""The ``instead`` texts already said (``_fall_back``)."""
TCP_INSTEAD = "all-reduces go through Gloo's TCP, not shared memory"


def shard(n: int, size: int, rank: int) -> tuple[int, int]:
    """Elements [lo, hi) of an n-element buffer that ``rank`` owns in a
    reduce-scatter or all-gather among ``size`` ranks."""
    return rank * n // size, (rank + 1) * n // size


class ShmTransport:
    """The shared segment, the sockets to every peer and the worker thread
    of one single-host group. Made by ``connect`` (collective)."""

    def __init__(self, rank: int, size: int, segment: mmap.mmap, socks: dict[int, socket.socket],
                 chunk_bytes: int, timeout_s: float, ranks: Sequence[int],
                 checked: bool = True) -> None:
        import torch

        global _held_bytes
        self.rank, self.size, self.chunk_bytes = rank, size, chunk_bytes
        self.ranks = tuple(ranks)
        """Each member's job rank, by its rank in this group: what messages name."""
        self.job_rank = self.ranks[rank]
        self.timeout_s = timeout_s
        self.checked = checked
        """Compare every operation's header on every rank (module docstring);
        only ``dp-plugin bench --shm-check`` makes unchecked transports, to time
        the check against."""
        self._segment = segment
        self._nbytes = len(segment)
        with _held_lock:
            _held_bytes += self._nbytes
        self._bytes: Any = torch.frombuffer(segment, dtype=torch.uint8)
        self._socks = socks
        self._seq = 0
        self._turn = 0  # the set the next chunk uses: alternation runs on across operations
        self._error: BaseException | None = None
        self.on_break: Callable[[BaseException], None] | None = None
        """Called on the thread with the error when an operation breaks the
        transport (the hierarchical all-reduce then breaks its other one)."""
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = self._stopped = self._released = False
        self._thread = threading.Thread(target=self._serve, name="dp_plugin-shm", daemon=True)
        self._thread.start()

    def takes(self, t: Any) -> bool:
        """Whether ``t`` (a contiguous torch tensor) goes through this transport."""
        return t.device.type == "cpu" and str(t.dtype).removeprefix("torch.") in DTYPES

    def allreduce_async(self, t: Any, op: ReduceOp, description: str,
                        on_timeout: Callable[[str], None], board: Any,
                        postscale: float = 1.0) -> Handle:
        """Queue an in-place all-reduce of ``t`` (``takes(t)`` is true).
        ``postscale`` (a sum of a ``SCALED_DTYPES`` tensor only) multiplies
        the result while it is copied out: no pass of its own. Issued inside
        ``deadline.standing()``: no deadline of its own."""
        handle = ShmHandle(description, self.job_rank, self.timeout_s, on_timeout, board)
        deadline = None if is_standing() else handle.started_at + self.timeout_s
        self._jobs.put(_Job(t, op, handle, postscale, deadline))
        return handle

    def stage_async(self, kind: Literal["reducescatter", "allgather"], data: Any, op: ReduceOp,
                    handle: ShmHandle, deadline: float | None, *,
                    before: Callable[[float | None], None] | None = None,
                    after: Callable[[Any], None] | None = None,
                    on_error: Callable[[BaseException], None] | None = None,
                    whole: tuple[int, int] = (0, 0)) -> None:
        """Queue one stage of a hierarchical all-reduce (``hierarchical.py``)
        on this transport's thread, after everything queued before it:
        ``before(deadline)``, then the ``kind`` of ``data`` in place (header
        check included), then ``after(shard)`` with the view of this rank's
        shard. ``handle`` has one part per stage of the all-reduce and counts
        this one once it has run, failed or been skipped (``ShmHandle``).
        ``on_error(exc)`` runs on the thread when this stage fails or is
        skipped because the transport broke earlier. ``deadline``: a
        ``time.perf_counter`` value, or None (a standing all-reduce).
        ``whole``: the piece's offset in its tensor and the tensor's element
        count, both in the header."""
        self._jobs.put(_Job(data, op, handle, 1.0, deadline, kind, before, after, on_error, whole))

    def fail(self, error: BaseException) -> None:
        """Break the transport from outside with ``error`` (the other stage
        of a pipelined hierarchical all-reduce failed): every operation not
        done yet fails with it and touches no buffer. A wait for a peer ends
        at once (the sockets are shut down), and so do the peers' waits for
        this rank: they break in turn, and no host waits out its deadline."""
        self._break(error)
        self._shut_sockets()

    def _shut_sockets(self) -> None:
        for sock in self._socks.values():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _break(self, error: BaseException) -> bool:
        """Keep the first error; True if it is this one."""
        with self._lock:
            if self._error is not None:
                return False
            self._error = error
            return True

    def close(self) -> None:
        """Stop the thread (bounded), then release the sockets and segment.
        A read blocked on a peer is woken by shutting the sockets down. A
        thread still running after the timeout (stuck in a reduction, or in
        the cross-host step of a hierarchical all-reduce) keeps the mapping:
        it releases it when it stops, never under its feet."""
        self._shut_sockets()
        self._jobs.put(None)
        self._thread.join(self.timeout_s)
        with self._lock:
            self._closed = True
            if self._stopped:
                self._release()
                return
        log.warning("dp_plugin: the shared-memory transport's thread (rank %d) did not stop "
                    "within %g s; its segment stays mapped until it does", self.job_rank,
                    self.timeout_s)

    def _release(self) -> None:
        """Close the sockets and unmap, once; under ``_lock``, the thread stopped."""
        global _held_bytes
        if self._released:
            return
        self._released = True
        for sock in self._socks.values():
            sock.close()
        self._bytes = None
        with contextlib.suppress(BufferError):  # a view still lives: the mapping goes with it
            self._segment.close()
        with _held_lock:
            _held_bytes -= self._nbytes

    # -- the worker thread -------------------------------------------------------
    def _serve(self) -> None:
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                failure = self._error
                if failure is None:
                    try:
                        self._run(job)
                    except BaseException as exc:
                        if self._break(exc) and self.on_break is not None:
                            self.on_break(exc)
                        failure = self._error
                if failure is not None and job.on_error is not None:
                    job.on_error(failure)
                job.handle.finish(failure)
        finally:
            with self._lock:
                self._stopped = True
                if self._closed:
                    self._release()

    def _run(self, job: _Job) -> None:
        data = job.tensor.view(-1)
        if job.before is not None:
            job.before(job.deadline)
        self._collective(job, job.kind, data)
        if job.after is not None:
            lo, hi = shard(data.numel(), self.size, self.rank)
            job.after(data[lo:hi])

    def _collective(self, job: _Job, kind: str, data: Any) -> None:
        """The module docstring's steps, pipelined over the two sets (m + 1
        barriers for m chunks); an all-gather copies out after each barrier."""
        chunk = self.chunk_bytes // data.element_size()  # elements per round
        sets = self._bytes.view(data.dtype).view(2, self.size + 1, chunk)
        rounds = [(self._turn + k) % 2 for k in range(-(-data.numel() // chunk))]
        self._turn += len(rounds)
        self._seq += 1
        first = self._header(kind, job, data) if self.checked else _PLAIN
        if kind == "reducescatter" and len(rounds) == 1:
            self._scatter_once(job, sets[rounds[0]], data, first)
            return
        self._stage(kind, sets[rounds[0]], data, 0, chunk)
        self._barrier(job, first)
        if kind == "allgather":
            for k, s in enumerate(rounds):
                if k:
                    self._stage(kind, sets[s], data, k * chunk, chunk)
                    self._barrier(job)
                self._finish(kind, job, sets[s], data, k * chunk, chunk)
            return
        for k, s in enumerate(rounds):
            # Every rank has copied chunk k in and reduced chunk k - 1.
            if k:
                self._finish(kind, job, sets[rounds[k - 1]], data, (k - 1) * chunk, chunk)
            n = min(chunk, data.numel() - k * chunk)
            lo, hi = shard(n, self.size, self.rank)
            if hi > lo:
                slots = sets[s]
                _reduce([slots[j, lo:hi] for j in range(self.size)], slots[self.size, lo:hi],
                        job.op)
            if k + 1 < len(rounds):
                self._stage(kind, sets[rounds[k + 1]], data, (k + 1) * chunk, chunk)
            self._barrier(job)
        self._finish(kind, job, sets[rounds[-1]], data, (len(rounds) - 1) * chunk, chunk)

    def _scatter_once(self, job: _Job, slots: Any, data: Any, first: bytes) -> None:
        """A reduce-scatter of one round (a piece of the pipelined
        hierarchical all-reduce): each rank stages only the shards the
        others own, and reduces its own shard, in rank order as always,
        from the others' slots and its own buffer, straight into the
        buffer: half the copy in and no copy out at 2 ranks, and one
        barrier (a set is rewritten two operations later, after the next
        operation's barrier, which every rank reaches only once done
        reading it)."""
        n = data.numel()
        lo, hi = shard(n, self.size, self.rank)
        if lo > 0:
            slots[self.rank, :lo].copy_(data[:lo])
        if hi < n:
            slots[self.rank, hi:n].copy_(data[hi:n])
        self._barrier(job, first)
        if hi <= lo:
            return
        mine = data[lo:hi]
        parts = [mine if j == self.rank else slots[j, lo:hi] for j in range(self.size)]
        if self.rank < 2:  # its own part is read by the first step, before it is written
            _reduce(parts, mine, job.op)
            return
        _reduce(parts, slots[self.size, lo:hi], job.op)
        mine.copy_(slots[self.size, lo:hi])

    def _stage(self, kind: str, slots: Any, data: Any, start: int, chunk: int) -> None:
        """Copy this rank's part of the chunk at ``start`` into its slot:
        all of it for a reduction, its shard's part for an all-gather."""
        lo, hi = start, min(start + chunk, data.numel())
        if kind == "allgather":
            mine = shard(data.numel(), self.size, self.rank)
            lo, hi = max(lo, mine[0]), min(hi, mine[1])
        if hi > lo:
            slots[self.rank, lo - start:hi - start].copy_(data[lo:hi])

    def _finish(self, kind: str, job: _Job, slots: Any, data: Any, start: int,
                chunk: int) -> None:
        """Copy the chunk at ``start`` out: the result (an all-reduce), its
        part of this rank's shard (a reduce-scatter) or the other ranks'
        shards from their slots (an all-gather)."""
        import torch

        end = min(start + chunk, data.numel())
        if kind == "allgather":
            for j in range(self.size):
                lo, hi = shard(data.numel(), self.size, j)
                lo, hi = max(lo, start), min(hi, end)
                if j != self.rank and hi > lo:
                    data[lo:hi].copy_(slots[j, lo - start:hi - start])
            return
        lo, hi = start, end
        if kind == "reducescatter":
            mine = shard(data.numel(), self.size, self.rank)
            lo, hi = max(lo, mine[0]), min(hi, mine[1])
            if hi <= lo:
                return
        result, piece = slots[self.size, lo - start:hi - start], data[lo:hi]
        if job.postscale != 1.0:  # as cheap as the copy: both read and write n once
            torch.mul(result, job.postscale, out=piece)
        else:
            piece.copy_(result)

    def _header(self, kind: str, job: _Job, data: Any) -> bytes:
        """This rank's header of the operation, sent with its first barrier."""
        return _HEADER.pack(self._seq, KINDS.index(kind), data.numel(),
                            DTYPES.index(canonical_dtype(data.dtype)), OPS.index(job.op),
                            job.postscale, *job.whole)

    def _gone(self, job: _Job, peer: int, exc: BaseException | None) -> BaseException:
        """The error when group rank ``peer``'s connection fails: the error
        this transport was broken with, where ``fail`` shut the sockets
        (this rank closed them: its cause is elsewhere). A peer that
        stopped because it lost a rank elsewhere said so on the board before
        it closed (a hierarchical all-reduce's cross-host step): name that
        rank. Otherwise the peer itself is gone, and this rank says so for
        its own host peers in turn."""
        with self._lock:
            if self._error is not None:
                return self._error
        handle, peer = job.handle, self.ranks[peer]
        board = handle.board
        theirs = None if board is None else board.lost_by(peer)
        if theirs is not None:
            lost = lost_text(*theirs)
            return DPPluginError(
                f"rank {handle.rank}: {handle.description} failed: rank {peer} of this "
                f"shared-memory group stopped, as {lost} cannot be reached from it; "
                f"{'that rank' if len(theirs[0]) == 1 else 'it'} has probably died, or its host is "
                f"down or cut off: check its log first.{handle.report()}"
            )
        if board is not None:
            board.post_lost([peer], "its peer on the same host, in the shared-memory transport")
        why = "closed its connection" if exc is None else f"cannot be reached ({exc})"
        return DPPluginError(
            f"rank {handle.rank}: {handle.description} failed: rank {peer} of this "
            f"shared-memory group {why}; it has probably died or shut down early: check its "
            f"log.{handle.report()}"
        )

    def _barrier(self, job: _Job, said: bytes = _PLAIN) -> None:
        """Wait until every rank has reached this point. ``said``: what this
        rank sends every peer, one byte or the operation's header (the first
        barrier, checked); a peer that sent other bytes raises
        ``LayoutMismatchError``, once every peer's have been read (the
        streams stay in step)."""
        for peer, sock in self._socks.items():
            try:
                sock.sendall(said)
            except OSError as exc:
                raise self._gone(job, peer, exc) from exc
        differs: tuple[int, bytes] | None = None
        for peer, sock in self._socks.items():
            got = b""
            while len(got) < len(said):
                remaining = None if job.deadline is None else job.deadline - time.perf_counter()
                if remaining is not None and remaining <= 0:
                    raise job.handle.timeout_error()
                sock.settimeout(remaining)
                try:
                    part = sock.recv(len(said) - len(got))
                except TimeoutError:
                    raise job.handle.timeout_error() from None
                except OSError as exc:
                    raise self._gone(job, peer, exc) from exc
                if not part:
                    raise self._gone(job, peer, None)
                got += part
            if got != said and differs is None:
                differs = (peer, got)
        if differs is not None:
            peer, theirs = differs
            me, peer = self.job_rank, self.ranks[peer]
            raise LayoutMismatchError(
                f"rank {me}: {job.handle.description} does not match what rank {peer} "
                f"started at the same point of the shared-memory transport: rank {me} "
                f"has {_said_bytes(said)}, rank {peer} has {_said_bytes(theirs)}. Every rank "
                "must start the same collectives "
                "in the same order, with the same element count, dtype and op; a rank that "
                "skips or reorders one (a collective only some ranks reach, buffers sized by "
                "rank-local data) pairs it with another. The transport is broken now; fix the "
                "program so that every rank issues the same sequence."
            )


@dataclass(slots=True)
class _Job:
    """One operation queued on a transport's thread; the fields after
    ``deadline`` are a stage's (``stage_async``)."""

    tensor: Any
    op: ReduceOp
    handle: ShmHandle
    postscale: float
    deadline: float | None
    kind: str = "allreduce"
    before: Callable[[float | None], None] | None = None
    after: Callable[[Any], None] | None = None
    on_error: Callable[[BaseException], None] | None = None
    whole: tuple[int, int] = (0, 0)


class ShmHandle(Handle):
    """An operation queued on a ``ShmTransport``: done when its thread(s)
    say so for each of its ``parts`` (the stages of a pipelined hierarchical
    all-reduce, one each; a plain operation is one part)."""

    def __init__(self, description: str, rank: int, timeout_s: float,
                 on_timeout: Callable[[str], None], board: Any, parts: int = 1) -> None:
        super().__init__(description, rank, timeout_s, on_timeout, board)
        self._event = threading.Event()
        self._finishing = threading.Lock()
        self._failure: BaseException | None = None
        self._left = parts

    def finish(self, failure: BaseException | None) -> None:
        """Called by a transport's thread once per part, when that part has
        run, failed or been skipped: done when every part is (nothing
        touches the buffer any more), failed with the first failure."""
        with self._finishing:
            if failure is not None and self._failure is None:
                self._failure = failure
            self._left -= 1
            if self._left == 0:
                self._event.set()

    def _test(self) -> bool:
        if not self._event.is_set():
            return False
        if self._failure is not None:
            raise self._failure
        return True

    def wait(self) -> None:
        """``Handle.wait``; where the wait runs out after a part has failed
        (the others wait to their deadline for a cross-host step that a
        broken peer never starts), that failure, which says what went
        wrong, not the timeout that followed from it."""
        try:
            super().wait()
        except CollectiveTimeoutError:
            with self._finishing:
                failure = self._failure
            if failure is None or isinstance(failure, CollectiveTimeoutError):
                raise
            raise failure from None

    def _block(self, timeout_s: float) -> bool:
        return self._event.wait(timeout_s) and self._test()


def _said_bytes(sent: bytes) -> str:
    """What a barrier's bytes say, as a person reads them: an operation's
    header ('operation #3: allreduce (sum) of 10 float32'), or the plain
    byte of a barrier inside an operation (the streams are out of step)."""
    if len(sent) != _HEADER.size:
        return "a barrier in the middle of an operation (no header)"
    seq, kind, count, dtype, op, factor, offset, whole = _HEADER.unpack(sent)
    names = (KINDS[kind] if 0 <= kind < len(KINDS) else f"kind {kind}",
             DTYPES[dtype] if 0 <= dtype < len(DTYPES) else f"dtype {dtype}",
             OPS[op].value if 0 <= op < len(OPS) else f"op {op}")
    scaled = "" if factor == 1.0 else f", scaled by {factor:g}"
    piece = "" if not whole else f" (elements {offset}.. of an all-reduce of {whole})"
    return f"operation #{seq}: {names[0]} ({names[2]}{scaled}) of {count} {names[1]}{piece}"


def _reduce(parts: list[Any], out: Any, op: ReduceOp) -> None:
    """``out = parts[0] op parts[1] op ...``, left to right."""
    import torch

    fn = getattr(torch, OP_FUNCTIONS[op])
    fn(parts[0], parts[1], out=out)
    for part in parts[2:]:
        fn(out, part, out=out)


# -- setup (collective) ----------------------------------------------------------------
def connect(exchange: Callable[[np.ndarray, str], np.ndarray], rank: int, size: int,
            eligible: bool, timeout_s: float, chunk_bytes: int | None = None,
            budget_bytes: int | None = None,
            instead: str = TCP_INSTEAD, members: Sequence[int] | None = None,
            ranks: Sequence[int] | None = None, checked: bool = True) -> ShmTransport | None:
    """Set up the transport among the ranks of one group, or None on every
    rank if any cannot (not eligible, no ``/dev/shm``, over the budget, a
    socket that fails).

    Collective over everyone ``exchange`` reaches: it all-gathers one int64
    row from each (the engine's ``exchange_rows``). ``members``: the rows of
    this group, by group rank (default every row); where the exchange
    reaches several groups (the hosts of a hierarchical all-reduce, each
    setting up its own segment), every group gives up if any participant
    cannot, so every rank of the job takes the same path. ``ranks``: the
    job rank of each row (default its index), which the log and the
    transport's errors name. ``instead``: what the log says happens instead
    when it cannot (once per process and text). A process that dies at any
    point leaves nothing behind (module docstring).
    """
    wanted = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if wanted <= 0 or wanted % 8:
        raise ValueError(f"chunk_bytes must be a positive multiple of 8, got {wanted}")
    token = secrets.randbits(62) if rank == 0 else 0
    eligible = eligible and 1 < size <= MAX_RANKS
    allowed = _allowed_bytes(budget_bytes)
    affordable = _chunk_within(size, wanted, allowed) if eligible else 0
    table = exchange(np.array([affordable, token, int(eligible), allowed], dtype=np.int64),
                     "shm setup")
    rows = list(range(len(table))) if members is None else list(members)
    names = list(range(len(table))) if ranks is None else list(ranks)
    me = names[rows[rank]]
    if not table[:, 0].all():
        if table[:, 2].all():  # wanted everywhere, but some rank has no room
            short = [f"rank {names[r]}: {int(row[3])} bytes" for r, row in enumerate(table)
                     if not row[0]]
            smallest = _segment_bytes(size, MIN_CHUNK_BYTES)
            _fall_back(instead, f"rank(s) have less than the {smallest} "
                       f"bytes of shared memory the smallest segment takes for {size} ranks "
                       f"within their budget ({'; '.join(short)}); raise "
                       "DP_PLUGIN_SHARED_MEMORY_BUDGET or give the host or container more "
                       "/dev/shm (docker run --shm-size=1g)")
        return None
    group = table[rows]
    chunk_bytes = int(group[:, 0].min())
    nbytes = _segment_bytes(size, chunk_bytes)
    token = int(group[0, 1])

    def everyone(failure: str | None, step: str) -> bool:
        """Whether every rank passed ``step`` (one exchange); says this one's failure."""
        if failure is not None:
            _fall_back(instead, f"rank {me} {failure}")
        return bool(exchange(np.array([int(failure is None)], dtype=np.int64), step)[:, 0].all())

    socks: dict[int, socket.socket] = {}  # closed, and unmapped, unless the transport takes them

    def close_sockets() -> None:
        for sock in socks.values():
            sock.close()

    # Nothing has a name to unlink: closing what setup opened is all the cleanup.
    with contextlib.ExitStack() as opened, contextlib.ExitStack() as unless_taken:
        unless_taken.callback(close_sockets)
        failure = None
        try:
            listener = opened.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            listener.bind(_address(token, rank))
            listener.listen(size)
            memfd = _memfd(nbytes) if rank == 0 else -1
            if memfd >= 0:
                opened.callback(os.close, memfd)
        except OSError as exc:
            failure = f"cannot listen or make the segment: {exc}"
        if not everyone(failure, "shm listen"):
            return None
        try:
            _mesh(listener, token, rank, size, timeout_s, socks, [names[r] for r in rows])
            segment = unless_taken.enter_context(_share(memfd, socks, rank, nbytes))
        except OSError as exc:
            failure = f"cannot connect to its peers: {exc}"
        if not everyone(failure, "shm connect"):
            return None
        transport = ShmTransport(rank, size, segment, dict(sorted(socks.items())), chunk_bytes,
                                 timeout_s, ranks=[names[r] for r in rows], checked=checked)
        unless_taken.pop_all()
        return transport


def describe(ranks: int) -> str:
    """What ``make check`` says of the transport for ``ranks`` ranks on this host."""
    allowed = _allowed_bytes(None)
    chunk = _chunk_within(ranks, CHUNK_BYTES, allowed)
    if not chunk:
        return (f"all-reduce through Gloo's TCP on one host (shared memory: {SHM_DIR} missing "
                f"or its budget, {allowed >> 20} MiB, too small)")
    return (f"all-reduce through shared memory when every rank is on one host "
            f"({_segment_bytes(ranks, chunk) >> 20} MiB for {ranks} ranks, within a "
            f"budget of {allowed >> 20} MiB)")


def _segment_bytes(size: int, chunk_bytes: int) -> int:
    """The segment of ``size`` ranks: two sets of a slot per rank and a
    result area."""
    return 2 * (size + 1) * chunk_bytes


def _allowed_bytes(budget_bytes: int | None) -> int:
    """What one more segment may take now: the budget (default a quarter of
    ``/dev/shm``'s size) less the segments this process holds, and no more
    than the room left in ``/dev/shm``; 0 without ``/dev/shm``."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    budget = stat.f_blocks * stat.f_frsize // BUDGET_SHARE if budget_bytes is None else budget_bytes
    with _held_lock:
        held = _held_bytes
    return max(0, min(budget - held, stat.f_bavail * stat.f_frsize))


def _chunk_within(size: int, wanted: int, allowed: int) -> int:
    """The largest chunk up to ``wanted`` (halving) whose segment takes at
    most ``allowed`` bytes; 0 if not even the smallest."""
    chunk = wanted
    while _segment_bytes(size, chunk) > allowed:
        if chunk <= MIN_CHUNK_BYTES:
            return 0
        chunk = max(MIN_CHUNK_BYTES, chunk // 2 - chunk // 2 % 8)
    return chunk


def _fall_back(instead: str, why: str) -> None:
    """Say once per process (and ``instead``), as a warning, what the gloo
    engine does instead of this transport and why."""
    level = logging.DEBUG if instead in _fallback_said else logging.WARNING
    _fallback_said.add(instead)
    log.log(level, "dp_plugin: %s: %s", instead, why)


def _address(token: int, rank: int) -> str:
    return "\0" + _NAME.format(token=token, rank=rank)


def _memfd(nbytes: int) -> int:
    """Make the segment: an anonymous memfd with every page reserved now
    (``posix_fallocate``): pages given at first touch would, once the
    pool filled meanwhile, kill the process with SIGBUS mid-all-reduce; a
    full pool fails here instead (OSError: every rank keeps Gloo's TCP)."""
    fd = os.memfd_create("dp_plugin-shm", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _share(memfd: int, socks: dict[int, socket.socket], rank: int, nbytes: int) -> mmap.mmap:
    """Rank 0 hands the segment's descriptor to every peer (``SCM_RIGHTS``);
    every rank maps it."""
    if rank == 0:
        for sock in socks.values():
            socket.send_fds(sock, [b"S"], [memfd])
        return mmap.mmap(memfd, nbytes)
    _msg, fds, _flags, _addr = socket.recv_fds(socks[0], 1, 1)
    try:
        if len(fds) != 1:
            raise OSError(f"rank 0 sent {len(fds)} descriptors, expected the segment's")
        size = os.fstat(fds[0]).st_size
        if size != nbytes:
            raise OSError(f"the segment has {size} bytes, expected {nbytes}")
        return mmap.mmap(fds[0], nbytes)
    finally:
        for fd in fds:
            os.close(fd)


def _peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def _mesh(listener: socket.socket, token: int, rank: int, size: int, timeout_s: float,
          socks: dict[int, socket.socket], names: Sequence[int]) -> None:
    """Connect to every peer, into ``socks`` (``connect`` closes them if
    setup fails): rank r dials every lower rank and accepts every higher
    one, which announces its rank first. Both ends check that the other
    runs as this process's user; a stranger's connection is dropped.
    ``names``: each group rank's job rank, for the messages."""
    uid = os.getuid()
    deadline = time.monotonic() + timeout_s
    for peer in range(rank):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        socks[peer] = sock
        sock.settimeout(timeout_s)
        sock.connect(_address(token, peer))
        if _peer_uid(sock) != uid:
            raise OSError(f"the socket of rank {names[peer]} belongs to user {_peer_uid(sock)}, "
                          f"not to this job's user {uid}")
        sock.sendall(rank.to_bytes(4, "little"))
    while sum(p > rank for p in socks) < size - rank - 1:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            late = [names[p] for p in range(rank + 1, size) if p not in socks]
            raise OSError(f"rank(s) {late} did not connect to rank {names[rank]} within "
                          f"{timeout_s:g} s")
        listener.settimeout(remaining)
        sock, _addr = listener.accept()
        if _peer_uid(sock) != uid:
            log.warning("dp_plugin: rank %d dropped a connection to its shared-memory socket "
                        "from user %d (this job runs as %d)", names[rank], _peer_uid(sock), uid)
            sock.close()
            continue
        sock.settimeout(timeout_s)
        got = b""
        while len(got) < 4 and (more := sock.recv(4 - len(got))):
            got += more
        peer = int.from_bytes(got, "little") if len(got) == 4 else -1
        if not rank < peer < size or peer in socks:
            sock.close()
            raise OSError(f"an unexpected connection to rank {names[rank]}'s shared-memory "
                          "socket")
        socks[peer] = sock
