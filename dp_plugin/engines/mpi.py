"""The ``mpi`` engine: mpi4py non-blocking collectives, launched by mpirun.

MPI matches collectives by order only: names are used solely in error
messages. All traffic runs on a private duplicate of ``MPI.COMM_WORLD``, so
a user's own MPI calls on ``COMM_WORLD`` can never match ours. Waits poll
``Request.Test`` (MPI makes progress only inside MPI calls).

``allgather`` is ``Iallgatherv`` with the agreed row counts, ``alltoall``
``Ialltoallv`` on the rows' bytes, ``reducescatter`` ``Ireduce_scatter``
with Horovod's row split, and ``subgroup`` ``Comm.Split``. A subgroup
engine may be split further; it shares the job-wide engine's datatypes
and ops, which that one frees, so a timeout in a subgroup breaks the
engine it came from too. ``shutdown`` of a broken engine leaks the
communicator and reduction ops on purpose (freeing an op that a pending
request may still call is unsafe); the process still exits normally
(MPICH 5.0.2 finalizes with pending requests without blocking).

dtypes: MPICH 5.0.2 reduces ``MPI_FLOAT16_T`` natively; ``MPI_BFLOAT16_T``
is ``MPI_DATATYPE_NULL`` there. A half type the library lacks is sent as an
opaque 2-byte datatype and reduced by a user-defined commutative op that
computes in float32 and rounds back after every pairwise step.
"""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar

import numpy as np

from dp_plugin.config import Config
from dp_plugin.engines.base import OP_FUNCTIONS, Availability, Engine, Handle, ReduceOp, Started
from dp_plugin.engines.deadline import bounded_on
from dp_plugin.engines.exit_bounds import finalize_mpi_at_exit
from dp_plugin.engines.mpi_notes import MPINotes
from dp_plugin.engines.waits import WaitBoard
from dp_plugin.errors import EngineUnavailableError
from dp_plugin.launch.topology import Topology
from dp_plugin.reduce.arrays import as_numpy, as_torch, is_torch, numpy_dtype
from dp_plugin.reduce.dtypes import canonical_dtype

# Canonical dtype -> name of the predefined MPI datatype (mpi4py attribute).
_MPI_TYPE_NAMES = {
    "float16": "FLOAT16_T",
    "bfloat16": "BFLOAT16_T",
    "float32": "FLOAT",
    "float64": "DOUBLE",
    "int8": "INT8_T",
    "uint8": "UINT8_T",
    "int16": "INT16_T",
    "int32": "INT32_T",
    "int64": "INT64_T",
}
_HALF_DTYPES = ("float16", "bfloat16")


class _MPIHandle(Handle):
    """Requests of one collective; done when all of them are."""

    def __init__(self, engine: MPIEngine, description: str, requests: list[Any],
                 keepalive: tuple[Any, ...]) -> None:
        super().__init__(description, engine.rank, engine.config.timeout_s, engine.mark_broken,
                         engine.wait_board())
        self._engine = engine
        self._requests = requests
        # MPI writes into these until the requests complete: keep them alive.
        self._keepalive: tuple[Any, ...] | None = keepalive

    def _test(self) -> bool:
        if not self._engine._MPI.Request.Testall(self._requests):
            return False
        self._keepalive = None
        return True


class MPIEngine(Engine):
    """Collectives through mpi4py on a private duplicate of ``COMM_WORLD``.

    Buffers: 1-D, C-contiguous, writable numpy arrays or CPU torch tensors,
    viewed without copies. Creating the engine is collective over
    ``COMM_WORLD`` and honours the timeout; ``shutdown`` is local."""

    name = "mpi"
    _timeout_breaks_parent = True  # subgroups share its datatypes and ops (module docstring)
    _use_native_halves: ClassVar[bool] = True
    """Use the library's float16/bfloat16 types when it has them. Tests set
    False to exercise the emulated path that an MPI without them needs."""

    @classmethod
    def availability(cls, topology: Topology) -> Availability:
        # find_spec does not load the extension: initializing MPI here would
        # make a throwaway singleton MPI job under other launchers.
        if importlib.util.find_spec("mpi4py") is None:
            return Availability(False, "mpi4py is not installed (pip install mpi4py mpich)")
        if not topology.is_mpi and topology.size != 1:
            return Availability(
                False,
                f"the job was started by {topology.launcher}, not by an MPI launcher; "
                "launch with mpirun/mpiexec to use the mpi engine",
            )
        return Availability(True, "mpi4py is installed and the job was started by "
                            + (f"{topology.launcher}'s mpiexec" if topology.is_mpi
                               else "no launcher (one process)"))

    def __init__(self, topology: Topology, config: Config, *,
                 parent: MPIEngine | None = None, comm: Any = None) -> None:
        """The job-wide engine (duplicates ``COMM_WORLD``), or with ``parent``
        and ``comm``: the subgroup engine on ``comm`` (module docstring)."""
        super().__init__(topology, config, parent=parent)
        self._comm: Any = comm
        self._board: WaitBoard | None = None
        if parent is not None:
            self._notes: MPINotes | None = parent._notes
            self._MPI: Any = parent._MPI
            self._types: dict[str, Any] = parent._types
            self._half_types: dict[str, Any] = parent._half_types
            self._half_ops: dict[tuple[str, ReduceOp], Any] = parent._half_ops
            return
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise EngineUnavailableError(
                f"the mpi engine needs mpi4py, which failed to import ({exc}); install "
                "mpi4py and an MPI (pip install mpi4py mpich) or choose another engine "
                "with DP_PLUGIN_ENGINE"
            ) from exc
        self._MPI = MPI
        finalize_mpi_at_exit(topology.rank, config.timeout_s)  # see _close
        world = MPI.COMM_WORLD
        if (world.Get_rank(), world.Get_size()) != (topology.rank, topology.size):
            library = " ".join(MPI.Get_library_version().splitlines()[0].split())
            raise EngineUnavailableError(
                f"MPI says this process is rank {world.Get_rank()} of {world.Get_size()}, but "
                f"the {topology.launcher} launcher variables say rank {topology.rank} of "
                f"{topology.size}. The job was probably started by the mpirun of a different "
                f"MPI than the one mpi4py uses ({library}); launch with that MPI's mpiexec "
                "(for the mpich wheel: the mpiexec next to your python)"
            )
        # Idup instead of Dup: if a rank never creates the engine, the others
        # raise after the timeout instead of hanging in the constructor.
        self._notes = None
        comm, request = world.Idup()
        _MPIHandle(self, "mpi communicator duplication (engine start)", [request], ()).wait()
        self._comm = comm
        if MPI.Query_thread() == MPI.THREAD_MULTIPLE:  # see mpi_notes.py
            notes, request = world.Idup()
            _MPIHandle(self, "mpi communicator duplication (wait notes)", [request], ()).wait()
            self._notes = MPINotes(notes, MPI)
        # Datatypes and ops this engine created, freed by shutdown.
        self._half_types = {}
        self._half_ops = {}
        self._types = {}
        for dtype, attr in _MPI_TYPE_NAMES.items():
            native = getattr(MPI, attr, MPI.DATATYPE_NULL)
            emulate = dtype in _HALF_DTYPES and (
                native == MPI.DATATYPE_NULL or not self._use_native_halves
            )
            if emulate:
                # An opaque 2-byte element; only our user ops interpret it.
                native = MPI.BYTE.Create_contiguous(2).Commit()
                self._half_types[dtype] = native
            self._types[dtype] = native

    def _allreduce_async(self, buf: Any, op: ReduceOp, name: str) -> Handle:
        arr = _writable_view(buf, f"allreduce {name!r}")
        request = self._comm.Iallreduce(self._MPI.IN_PLACE, self._spec(arr),
                                        self._op(canonical_dtype(arr.dtype), op))
        return _MPIHandle(self, self.describe("allreduce", name, arr.nbytes), [request], (buf, arr))

    def _broadcast_async(self, buf: Any, root: int, name: str) -> Handle:
        arr = _writable_view(buf, f"broadcast {name!r}")
        request = self._comm.Ibcast(self._spec(arr), root=root)
        return _MPIHandle(self, self.describe("broadcast", name, arr.nbytes), [request], (buf, arr))

    def _allgather_start(self, buf: Any, rows: list[int], name: str) -> Started:
        arr = np.ascontiguousarray(as_numpy(buf))  # only read: a copy is fine
        trailing = arr.shape[1:]
        row_elems = int(np.prod(trailing, dtype=np.int64))
        counts = [r * row_elems for r in rows]
        out = np.empty((sum(rows), *trailing), dtype=arr.dtype)
        mpi_type = self._types[canonical_dtype(arr.dtype)]
        handle = _MPIHandle(
            self, self.describe("allgather", name, out.nbytes),
            [self._comm.Iallgatherv(self._spec(arr),
                                    [_wire(out), (counts, _displacements(counts)), mpi_type])],
            (arr, out),
        )
        return handle, lambda: as_torch(out) if is_torch(buf) else out

    def _barrier(self) -> None:
        _MPIHandle(self, "mpi barrier", [self._comm.Ibarrier()], ()).wait()

    def _close(self) -> None:
        """Free the communicator, and the job-wide engine's datatypes and ops
        too (local; a broken engine frees nothing: module docstring).

        ``MPI_Finalize`` is left to interpreter exit, so the user may keep
        using MPI, or start the engine again, after this; there it is
        bounded by ``DP_PLUGIN_TIMEOUT`` (``exit_bounds.finalize_mpi_at_exit``)."""
        if self._broken is not None:
            self._comm = None
            return
        if self._parent is None:
            if self._notes is not None:
                self._notes.close()
                self._notes = None
            for made in (self._half_ops, self._half_types):
                for obj in made.values():
                    obj.Free()
                made.clear()
        if self._comm is not None:
            self._comm.Free()
            self._comm = None

    def _alltoall(self, buf: Any, counts: np.ndarray, name: str) -> Any:
        arr = np.ascontiguousarray(as_numpy(buf))  # only read: a copy is fine
        row_bytes = arr.shape[1]
        received = counts[:, self.rank]
        out = np.empty((int(received.sum()), row_bytes), dtype=np.uint8)
        if row_bytes and counts.any():  # agreed: every rank skips alike
            send = [int(c) * row_bytes for c in counts[self.rank]]
            recv = [int(c) * row_bytes for c in received]
            byte = self._MPI.BYTE
            request = self._comm.Ialltoallv([arr, (send, _displacements(send)), byte],
                                            [out, (recv, _displacements(recv)), byte])
            _MPIHandle(self, self.describe("alltoall", name, out.nbytes), [request],
                       (arr, out)).wait()
        return as_torch(out) if is_torch(buf) else out

    def _reducescatter_start(self, buf: Any, op: ReduceOp, counts: list[int],
                             name: str) -> Started:
        arr = np.ascontiguousarray(as_numpy(buf))
        dtype = canonical_dtype(arr.dtype)
        trailing = arr.shape[1:]
        row = int(np.prod(trailing, dtype=np.int64))
        out = np.empty((counts[self.rank], *trailing), dtype=arr.dtype)
        description = self.describe("reducescatter", name, arr.nbytes)
        handle: Handle
        if arr.size:  # same shape everywhere: every rank skips alike
            request = self._comm.Ireduce_scatter(self._spec(arr), self._spec(out),
                                                 [c * row for c in counts], self._op(dtype, op))
            handle = _MPIHandle(self, description, [request], (arr, out))
        else:
            handle = self._done(description)
        return handle, lambda: as_torch(out) if is_torch(buf) else out

    def _subgroup(self, members: tuple[int, ...], topology: Topology | None,
                  name: str) -> Engine | None:
        """``Comm.Split`` of this engine's communicator. Every rank has just
        passed the agreement (which honours the timeout), but one may
        still stall or die before Split, which blocks and has no timeout of
        its own: it runs under ``bounded_on``."""
        color = 0 if topology is not None else self._MPI.UNDEFINED
        comm = bounded_on(self, lambda: self._comm.Split(color, self.rank),
                          f"mpi Comm.Split ({name!r})")
        if topology is None:
            return None
        return type(self)(topology, self.config, parent=self, comm=comm)

    def wait_board(self) -> WaitBoard | None:
        """Notes of long waits, sent over MPI itself (``mpi_notes.py``); None
        while the engine starts, or when MPI is not thread-multiple."""
        if self._board is None and getattr(self, "_notes", None) is not None:
            self._board = WaitBoard(self._notes, self.global_ranks[self.rank],
                                    self.global_ranks, self.config.stall_warning_s)
        return self._board

    def _spec(self, arr: np.ndarray) -> list[Any]:
        """``arr`` as MPI takes a buffer: its wire form, element count, datatype."""
        return [_wire(arr.reshape(-1)), arr.size, self._types[canonical_dtype(arr.dtype)]]

    def _op(self, dtype: str, op: ReduceOp) -> Any:
        if dtype not in self._half_types:
            return getattr(self._MPI, "PROD" if op is ReduceOp.PRODUCT else op.name)  # MPI.SUM ...
        key = (dtype, op)
        if key not in self._half_ops:
            npdtype, combine = numpy_dtype(dtype), getattr(np, OP_FUNCTIONS[op])

            def reduce(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
                """``inout = round(combine(float32(in), float32(inout)))``."""
                incoming = np.frombuffer(inbuf, dtype=npdtype)
                inout = np.frombuffer(inoutbuf, dtype=npdtype)
                result = combine(incoming.astype(np.float32), inout.astype(np.float32))
                inout[...] = result.astype(npdtype)

            self._half_ops[key] = self._MPI.Op.Create(reduce, commute=True)
        return self._half_ops[key]


def _writable_view(buf: Any, what: str) -> np.ndarray:
    """Zero-copy numpy view of a 1-D buffer that MPI may write into."""
    arr = as_numpy(buf)
    if not arr.flags.c_contiguous:
        raise ValueError(
            f"{what}: the buffer is not contiguous (strides {arr.strides}); the mpi engine "
            "reduces in place and needs contiguous memory; pass buf.contiguous() / "
            "np.ascontiguousarray(buf) and copy the result back"
        )
    if not arr.flags.writeable:
        raise ValueError(
            f"{what}: the buffer is read-only; the mpi engine reduces in place; pass a "
            "writable copy (buf.copy())"
        )
    return arr


def _displacements(counts: list[int]) -> list[int]:
    return [sum(counts[:i]) for i in range(len(counts))]


def _wire(arr: np.ndarray) -> np.ndarray:
    """``arr`` in a form the buffer protocol exports: ml_dtypes' bfloat16
    cannot be exported, so half types travel as their 16-bit patterns (the
    MPI datatype passed alongside says how to reduce them)."""
    return arr.view(np.uint16) if canonical_dtype(arr.dtype) in _HALF_DTYPES else arr
