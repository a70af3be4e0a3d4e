"""The wait notes' store under MPI: point-to-point messages on a private communicator.

gloo and nccl keep the ``WaitBoard`` notes (``waits.py``) in torch's
key-value store; an MPI job has no such store, so ``MPINotes`` offers the
same three calls (``set``, ``check``, ``get``) over MPI itself:

- ``set(key, value)`` sends ``key\\nvalue`` to every other rank with a
  non-blocking send (a note is a few dozen bytes: MPI delivers it eagerly,
  the receiver need not be in any call that matches it);
- ``check``/``get`` first receive every note that has arrived (``Iprobe``),
  keeping the newest per key, then answer from what they hold.

The communicator is a duplicate of ``COMM_WORLD`` used for nothing else, so
notes never match a collective. Ranks are ``COMM_WORLD`` ranks (the job-wide
ranks the board uses). MPI makes progress only inside MPI calls: a rank
waiting in a collective polls ``Request.Testall`` (``mpi.py``), which also
takes in the notes sent to it. Calls come from ``WaitBoard``'s bounded
helper thread, so the library must provide ``MPI_THREAD_MULTIPLE``; the
engine uses no notes otherwise.
"""

from __future__ import annotations

from typing import Any

TAG = 0x5A17
"""The tag of every note (the communicator carries nothing else)."""


class MPINotes:
    """Notes of every rank of ``comm`` (a private duplicate of ``COMM_WORLD``)."""

    def __init__(self, comm: Any, mpi: Any) -> None:
        self._comm = comm
        self._MPI = mpi
        self._held: dict[str, bytes] = {}
        self._sending: list[tuple[Any, bytearray]] = []
        """Send requests not known to be complete, with the buffers they read."""

    def set(self, key: str, value: str) -> None:
        self._sending = [(r, d) for r, d in self._sending if not r.Test()]
        data = bytearray(f"{key}\n{value}".encode())
        me = self._comm.Get_rank()
        for rank in range(self._comm.Get_size()):
            if rank != me:
                request = self._comm.Isend([data, self._MPI.BYTE], dest=rank, tag=TAG)
                self._sending.append((request, data))

    def check(self, keys: list[str]) -> bool:
        self._receive()
        return all(key in self._held for key in keys)

    def get(self, key: str) -> bytes:
        self._receive()
        return self._held[key]

    def close(self) -> None:
        """Cancel the sends nobody received (a rank that ended early) and free
        the communicator. Local."""
        for request, _ in self._sending:
            if not request.Test():
                request.Cancel()
                request.Free()
        self._sending.clear()
        self._comm.Free()

    def _receive(self) -> None:
        status = self._MPI.Status()
        while self._comm.Iprobe(source=self._MPI.ANY_SOURCE, tag=TAG, status=status):
            data = bytearray(status.Get_count(self._MPI.BYTE))
            self._comm.Recv([data, self._MPI.BYTE], source=status.Get_source(), tag=TAG)
            key, _, value = bytes(data).partition(b"\n")
            self._held[key.decode(errors="replace")] = value
