"""Shared-memory all-reduce for the ranks of one host: the gloo engine's
fast path.

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
segment holds two sets of slots and result area, used by alternate chunks:
step 1 of chunk k + 1 and step 5 of chunk k - 1 run beside step 3 of
chunk k, so barrier 4 of one chunk is barrier 2 of the next (m + 1
barriers for m chunks). A set is rewritten only two chunks later, after a
barrier that every rank reaches only once done reading it.

A barrier is one byte sent to and read from every peer over UNIX sockets:
a blocking read with the collective's timeout (no spinning on cores that
compute), a peer that dies closes its sockets and fails the read at once,
and the system calls order the memory accesses around them.

All-reduces run on one thread per transport, in the order they were
started (the engine contract: same collectives, same order, every rank).
The segment and the socket files are unlinked as soon as every rank has
opened them, so nothing is left behind in ``/dev/shm`` if a process dies.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dp_plugin.engines.handle import Handle
from dp_plugin.engines.types import ReduceOp
from dp_plugin.errors import DPPluginError

log = logging.getLogger("dp_plugin")

SHM_DIR = "/dev/shm"
CHUNK_BYTES = 8 << 20
"""Largest chunk one round moves; the segment is 2 x (ranks + 1) chunks.
Smaller where ``/dev/shm`` has less room (a container's 64 MiB), down to
``MIN_CHUNK_BYTES``; the ranks take the smallest any of them can afford."""
MIN_CHUNK_BYTES = 64 << 10
DTYPES = frozenset({"float16", "bfloat16", "float32", "float64",
                    "int8", "uint8", "int16", "int32", "int64"})
"""What the transport reduces (torch CPU kernels exist for each); other
dtypes take the engine's own path."""
SCALED_DTYPES = frozenset({"float32", "float64"})
"""Where a post-scale folded into the reduction rounds exactly as the
scheduler's own multiply afterwards (``arrays.TorchOps`` and ``NumpyOps``
agree on these; numpy rounds the factor to a 16-bit dtype first, torch not)."""


class ShmTransport:
    """The shared segment, the sockets to every peer and the worker thread
    of one single-host group. Made by ``connect`` (collective)."""

    def __init__(self, rank: int, size: int, segment: mmap.mmap, socks: dict[int, socket.socket],
                 chunk_bytes: int, timeout_s: float) -> None:
        import torch

        self.rank, self.size, self.chunk_bytes = rank, size, chunk_bytes
        self.timeout_s = timeout_s
        self._segment = segment
        self._bytes: Any = torch.frombuffer(segment, dtype=torch.uint8)
        self._socks = socks
        self._error: BaseException | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="dp_plugin-shm", daemon=True)
        self._thread.start()

    def takes(self, t: Any) -> bool:
        """Whether ``t`` (a contiguous torch tensor) goes through this transport."""
        return t.device.type == "cpu" and str(t.dtype).removeprefix("torch.") in DTYPES

    def allreduce_async(self, t: Any, op: ReduceOp, description: str,
                        on_timeout: Callable[[str], None], board: Any,
                        postscale: float = 1.0, standing: bool = False) -> Handle:
        """Queue an in-place all-reduce of ``t`` (``takes(t)`` is true).
        ``postscale`` (a sum of a ``SCALED_DTYPES`` tensor only) multiplies
        the result while it is copied out: no pass of its own. ``standing``:
        no deadline of its own (``Engine.standing_allreduce_async``)."""
        handle = ShmHandle(description, self.rank, self.timeout_s, on_timeout, board)
        deadline = None if standing else handle.started_at + self.timeout_s
        self._jobs.put(_Job(t, op, handle, postscale, deadline))
        return handle

    def close(self) -> None:
        """Stop the thread (bounded), then release the sockets and segment.
        A read blocked on a peer is woken by shutting the sockets down."""
        for sock in self._socks.values():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._jobs.put(None)
        self._thread.join(self.timeout_s)
        for sock in self._socks.values():
            sock.close()
        self._bytes = None
        with contextlib.suppress(BufferError):  # a view still lives: the mapping goes with it
            self._segment.close()

    # -- the worker thread -------------------------------------------------------
    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._error is None:
                try:
                    self._allreduce(job)
                except BaseException as exc:
                    self._error = exc
            job.handle.finish(self._error)

    def _allreduce(self, job: _Job) -> None:
        """The module docstring's steps, pipelined over two sets of slots
        and results: the barrier after round k is also the one before
        round k + 1, so a buffer of m chunks takes m + 1 barriers."""
        deadline = job.deadline
        data, dtype = job.tensor.view(-1), job.tensor.dtype
        chunk = self.chunk_bytes // job.tensor.element_size()  # elements per round
        sets = self._bytes.view(dtype).view(2, self.size + 1, chunk)
        pieces = [data[start:start + chunk] for start in range(0, data.numel(), chunk)]
        sets[0, self.rank, :pieces[0].numel()].copy_(pieces[0])
        self._barrier(deadline, job)
        for k, piece in enumerate(pieces):
            # Every rank has copied chunk k in and reduced chunk k - 1.
            if k:
                self._copy_out(job, sets[(k - 1) % 2, self.size], pieces[k - 1])
            slots, n = sets[k % 2], piece.numel()
            lo, hi = self.rank * n // self.size, (self.rank + 1) * n // self.size
            if hi > lo:
                _reduce([slots[j, lo:hi] for j in range(self.size)], slots[self.size, lo:hi],
                        job.op)
            if k + 1 < len(pieces):
                nxt = pieces[k + 1]
                sets[(k + 1) % 2, self.rank, :nxt.numel()].copy_(nxt)
            self._barrier(deadline, job)
        self._copy_out(job, sets[(len(pieces) - 1) % 2, self.size], pieces[-1])

    @staticmethod
    def _copy_out(job: _Job, result: Any, piece: Any) -> None:
        import torch

        n = piece.numel()
        if job.postscale != 1.0:  # as cheap as the copy: both read and write n once
            torch.mul(result[:n], job.postscale, out=piece)
        else:
            piece.copy_(result[:n])

    def _barrier(self, deadline: float | None, job: _Job) -> None:
        for peer, sock in self._socks.items():
            try:
                sock.sendall(b"\x01")
            except OSError as exc:
                raise _peer_gone(job, peer, exc) from exc
        for peer, sock in self._socks.items():
            remaining = None if deadline is None else deadline - time.perf_counter()
            if remaining is not None and remaining <= 0:
                raise job.handle.timeout_error()
            sock.settimeout(remaining)
            try:
                got = sock.recv(1)
            except TimeoutError:
                raise job.handle.timeout_error() from None
            except OSError as exc:
                raise _peer_gone(job, peer, exc) from exc
            if not got:
                raise _peer_gone(job, peer, None)


class _Job:
    __slots__ = ("deadline", "handle", "op", "postscale", "tensor")

    def __init__(self, tensor: Any, op: ReduceOp, handle: ShmHandle, postscale: float,
                 deadline: float | None) -> None:
        self.tensor, self.op, self.handle, self.postscale = tensor, op, handle, postscale
        self.deadline = deadline


class ShmHandle(Handle):
    """An all-reduce queued on a ``ShmTransport``: done when its thread says so."""

    def __init__(self, description: str, rank: int, timeout_s: float,
                 on_timeout: Callable[[str], None], board: Any) -> None:
        super().__init__(description, rank, timeout_s, on_timeout, board)
        self._event = threading.Event()
        self._failure: BaseException | None = None

    def finish(self, failure: BaseException | None) -> None:
        """Called by the transport's thread, once."""
        self._failure = failure
        self._event.set()

    def _test(self) -> bool:
        if not self._event.is_set():
            return False
        if self._failure is not None:
            raise self._failure
        return True

    def _block(self, timeout_s: float) -> bool:
        return self._event.wait(timeout_s) and self._test()


def _reduce(parts: list[Any], out: Any, op: ReduceOp) -> None:
    """``out = parts[0] op parts[1] op ...``, left to right."""
    import torch

    fn: Any = {ReduceOp.SUM: torch.add, ReduceOp.MIN: torch.minimum,
          ReduceOp.MAX: torch.maximum, ReduceOp.PRODUCT: torch.mul}[op]
    fn(parts[0], parts[1], out=out)
    for part in parts[2:]:
        fn(out, part, out=out)


def _peer_gone(job: _Job, peer: int, exc: BaseException | None) -> DPPluginError:
    why = "closed its connection" if exc is None else f"cannot be reached ({exc})"
    return DPPluginError(
        f"rank {job.handle.rank}: {job.handle.description} failed: rank {peer} of this "
        f"shared-memory group {why}; it has probably died or shut down early: check its "
        f"log.{job.handle.report()}"
    )


# -- setup (collective) ----------------------------------------------------------------
def connect(exchange: Callable[[np.ndarray, str], np.ndarray], rank: int, size: int,
            eligible: bool, timeout_s: float,
            chunk_bytes: int | None = None) -> ShmTransport | None:
    """Set up the transport among the ranks of one group, or None on every
    rank if any cannot (not eligible, no ``/dev/shm``, too little room).

    Collective over the group: ``exchange`` all-gathers one int64 row per
    rank (the engine's ``_exchange``). Three exchanges: the chunk each rank
    can afford (0: not eligible) and rank 0's token naming the files;
    whether rank 0 made the segment and every rank listens; whether every
    rank attached and connected. ``chunk_bytes``: default ``CHUNK_BYTES``.
    """
    wanted = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if wanted <= 0 or wanted % 8:
        raise ValueError(f"chunk_bytes must be a positive multiple of 8, got {wanted}")
    token = secrets.randbits(62) if rank == 0 else 0
    affordable = _affordable_chunk(size, wanted) if eligible and size > 1 else 0
    table = exchange(np.array([affordable, token], dtype=np.int64), "shm setup")
    if not table[:, 0].all():
        return None
    chunk_bytes = int(table[:, 0].min())
    nbytes = _segment_bytes(size, chunk_bytes)
    prefix = os.path.join(SHM_DIR, f"dp_plugin-{int(table[0, 1]):x}")
    segment: mmap.mmap | None = None
    listener: socket.socket | None = None
    socks: dict[int, socket.socket] = {}
    try:
        ok = True
        try:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # closed by _cleanup
            listener.bind(f"{prefix}-{rank}.sock")
            listener.listen(size)
            if rank == 0:
                segment = _segment(f"{prefix}.seg", nbytes, create=True)
        except OSError as exc:
            log.debug("dp_plugin: shared-memory setup failed on rank %d: %s", rank, exc)
            ok = False
        if not exchange(np.array([int(ok)], dtype=np.int64), "shm listen")[:, 0].all():
            return None
        try:
            if rank != 0:
                segment = _segment(f"{prefix}.seg", nbytes, create=False)
            assert listener is not None
            _mesh(listener, prefix, rank, size, timeout_s, socks)
        except OSError as exc:
            log.debug("dp_plugin: shared-memory connect failed on rank %d: %s", rank, exc)
            ok = False
        if not exchange(np.array([int(ok)], dtype=np.int64), "shm connect")[:, 0].all():
            return None
        assert segment is not None
        transport = ShmTransport(rank, size, segment, dict(sorted(socks.items())), chunk_bytes,
                                 timeout_s)
        segment, socks = None, {}
        return transport
    finally:
        _cleanup(prefix, rank, listener, segment, socks)


def describe(ranks: int) -> str:
    """What ``make check`` says of the transport for ``ranks`` ranks on this host."""
    chunk = _affordable_chunk(ranks, CHUNK_BYTES)
    if not chunk:
        return f"all-reduce through Gloo's TCP on one host ({SHM_DIR} missing or too small)"
    return (f"all-reduce through shared memory when every rank is on one host "
            f"({_segment_bytes(ranks, chunk) >> 20} MiB in {SHM_DIR} for {ranks} ranks)")


def _segment_bytes(size: int, chunk_bytes: int) -> int:
    """The segment of ``size`` ranks: two sets of a slot per rank and a result area."""
    return 2 * (size + 1) * chunk_bytes


def _affordable_chunk(size: int, wanted: int) -> int:
    """The largest chunk up to ``wanted`` (halving) whose segment takes at
    most half of the room left in ``/dev/shm``; 0 if not even the smallest."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    room = stat.f_bavail * stat.f_frsize
    chunk = wanted
    while 2 * _segment_bytes(size, chunk) > room:
        if chunk <= MIN_CHUNK_BYTES:
            return 0
        chunk = max(MIN_CHUNK_BYTES, chunk // 2 - chunk // 2 % 8)
    return chunk


def _segment(path: str, nbytes: int, create: bool) -> mmap.mmap:
    """Create (rank 0) or open the segment and map it. Creating reserves
    every page now (``posix_fallocate``): a sparse file would get its pages
    at first touch, and a ``/dev/shm`` filled meanwhile by someone else
    would then kill the process with SIGBUS mid-all-reduce; a full one
    fails here instead (OSError: every rank keeps Gloo's TCP)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, nbytes)
        elif os.fstat(fd).st_size != nbytes:
            raise OSError(f"segment {path} has {os.fstat(fd).st_size} bytes, expected {nbytes}")
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _mesh(listener: socket.socket, prefix: str, rank: int, size: int, timeout_s: float,
          socks: dict[int, socket.socket]) -> None:
    """Connect to every peer, into ``socks`` (``_cleanup`` closes them if
    setup fails): rank r dials every lower rank and accepts every higher
    one, which announces its rank first."""
    for peer in range(rank):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        socks[peer] = sock
        sock.settimeout(timeout_s)
        sock.connect(f"{prefix}-{peer}.sock")
        sock.sendall(rank.to_bytes(4, "little"))
    listener.settimeout(timeout_s)
    for _ in range(rank + 1, size):
        sock, _addr = listener.accept()
        sock.settimeout(timeout_s)
        got = b""
        while len(got) < 4 and (more := sock.recv(4 - len(got))):
            got += more
        peer = int.from_bytes(got, "little") if len(got) == 4 else -1
        if not rank < peer < size or peer in socks:
            sock.close()
            raise OSError(f"an unexpected connection to {prefix}-{rank}.sock")
        socks[peer] = sock


def _cleanup(prefix: str, rank: int, listener: socket.socket | None,
             segment: mmap.mmap | None, socks: dict[int, socket.socket]) -> None:
    """Close what a failed setup left open, and unlink this rank's files
    (every rank has opened them, or setup failed: nobody needs the names)."""
    if listener is not None:
        listener.close()
    for sock in socks.values():
        sock.close()
    if segment is not None:
        segment.close()
    for path in (f"{prefix}-{rank}.sock", f"{prefix}.seg" if rank == 0 else ""):
        if path:
            with contextlib.suppress(OSError):
                os.unlink(path)
