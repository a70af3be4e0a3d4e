"""The ``horovod`` engine: collectives run inside Horovod's own engine.

Uses ``horovod.torch`` (Horovod 0.28.1 built with Gloo; docs/horovod-build.md
for the C++17 rebuild), imported when the engine is created.

- Horovod matches collectives across ranks by *name*, not by order. Every
  rank must pass the same names in the same order. The engine appends a slot
  number so that a name may be reused once its previous use has been waited
  for (the same name every step keeps Horovod's response cache warm) while
  two in-flight uses of one name stay distinct. The slot depends only on the
  program order of calls and ``wait``s, so it agrees across ranks;
- waits poll ``hvd.poll`` (``hvd.synchronize`` alone could block forever);
- errors Horovod detects across ranks (a rank that shut down, say) are
  raised on every rank as ``DPPluginError``.

dtypes (Horovod 0.28.1's torch extension, CPU): all-reduce kernels exist
for float16, float32, float64, int32 and int64 only. int8, uint8 and int16
are all-reduced as int32 and bfloat16 as float32, through a temporary copy:
exact for the small integer types (two's complement wraps identically), and
for bfloat16 one rounding at the end instead of one per step. The cost is
twice (four times for 8-bit) the bytes on the wire: bf16 compression saves
no bandwidth on this engine (use fp16 compression, or the gloo engine).
Broadcast and all-gather move bfloat16 as its int16 bit pattern (exact).

``alltoall`` is ``hvd.alltoall_async`` on the rows' bytes;
``reducescatter`` is ``hvd.reducescatter_async`` for sums in the dtypes
above with kernels (others go through the all-reduce). ``subgroup`` is a
Horovod process set (``hvd.add_process_set``, collective over all Horovod
ranks; collectives then pass ``process_set=``); only the job-wide engine
adds them. An engine that starts Horovod sets Horovod's variables for it
(``horovod_env.library_settings``): dynamic process sets where the program
asked for them (``Config.process_sets``), as Horovod's own ``init`` does
(Horovod then looks for new sets every cycle, 4-9% of a step:
docs/benchmarks-history.md), and a fusion threshold that keeps Horovod from
fusing dp_plugin's buckets again.
Average is the base class's, not ``hvd.Average``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from dp_plugin.config import Config
from dp_plugin.engines.base import Availability, Engine, Handle, ReduceOp, Started
from dp_plugin.engines.deadline import bounded_on
from dp_plugin.engines.exit_bounds import bound_at_exit
from dp_plugin.engines.generic import torch_byte_rows
from dp_plugin.engines.horovod_env import library_settings
from dp_plugin.errors import CollectiveTimeoutError, DPPluginError, EngineUnavailableError
from dp_plugin.launch.topology import Topology
from dp_plugin.reduce.arrays import as_numpy, as_torch, is_torch
from dp_plugin.reduce.dtypes import canonical_dtype

# Canonical dtype -> dtype the all-reduce runs in, where Horovod has no kernel.
ALLREDUCE_WIRE_DTYPES = {"int8": "int32", "uint8": "int32", "int16": "int32",
                         "bfloat16": "float32"}


class _HorovodHandle(Handle):
    """One Horovod operation; ``wait`` finalizes it with ``hvd.synchronize``."""

    def __init__(self, engine: HorovodEngine, description: str, hvd_handle: int,
                 slot: tuple[str, int]) -> None:
        super().__init__(description, engine.rank, engine.config.timeout_s, engine.mark_broken)
        self._engine = engine
        self._hvd_handle = hvd_handle
        self.result: Any = None
        # First finisher: collect Horovod's outcome before any copy-back.
        self.then(lambda: self._finish(slot))

    def _test(self) -> bool:
        return bool(self._engine._hvd.poll(self._hvd_handle))

    def _finish(self, slot: tuple[str, int]) -> None:
        try:
            self.result = self._engine._hvd.synchronize(self._hvd_handle)
        except RuntimeError as exc:  # HorovodInternalError is a RuntimeError
            raise DPPluginError(
                f"rank {self.rank}: {self.description} failed in Horovod: "
                f"{str(exc).strip().rstrip('.')}. Horovod reports this on every rank; a "
                "shutdown means another rank stopped (raised, timed out or exited) while "
                "this collective was pending: check that rank's log"
            ) from exc
        finally:
            self._engine._release(slot)


class HorovodEngine(Engine):
    """Collectives through ``horovod.torch``, under ``horovodrun``.

    Buffers: numpy arrays or torch tensors, viewed as torch tensors without
    copies; all-reduce and broadcast need contiguous buffers (they work in
    place). Creating the engine calls ``hvd.init()`` unless Horovod is
    already initialized; ``shutdown`` calls ``hvd.shutdown()`` only if the
    engine initialized Horovod, so a user's own Horovod use is left alone.
    """

    name = "horovod"

    @classmethod
    def availability(cls, topology: Topology) -> Availability:
        if importlib.util.find_spec("horovod") is None:
            return Availability(False, "Horovod is not installed (`make install` builds it)")
        if topology.launcher != "horovodrun" and topology.size != 1:
            return Availability(
                False,
                f"the job was started by {topology.launcher}, not horovodrun; Horovod's "
                "engine needs `horovodrun --gloo` (or use the gloo engine)",
            )
        try:
            import horovod.torch as hvd
        except Exception as exc:  # ImportError, or an ABI error from the extension
            return Availability(
                False,
                f"horovod.torch failed to import ({type(exc).__name__}: {exc}); rebuild "
                "Horovod against this torch (`make install`)",
            )
        if not hvd.gloo_built():
            return Availability(
                False, "Horovod was built without Gloo; rebuild with HOROVOD_WITH_GLOO=1"
            )
        return Availability(True, "horovod.torch is built with Gloo and the job was started by "
                            + ("horovodrun" if topology.launcher == "horovodrun"
                               else "no launcher (one process)"))

    def __init__(self, topology: Topology, config: Config, *,
                 parent: HorovodEngine | None = None, process_set: Any = None) -> None:
        """The job-wide engine (``hvd.init()`` unless Horovod runs already),
        or with ``parent`` and ``process_set``: the engine of that set."""
        super().__init__(topology, config, parent=parent)
        self._in_flight: dict[str, set[int]] = {}
        self._added_sets: dict[tuple[int, ...], Any] = {}
        self._owns_init = False
        self._shutdown_stuck = False
        """An ``hvd.shutdown()`` timed out: Horovod's thread may still run."""
        if parent is not None:
            self._hvd: Any = parent._hvd
            self._torch: Any = parent._torch
            self._process_set: Any = process_set
            return
        try:
            import horovod.torch as hvd
            import torch
        except Exception as exc:
            raise EngineUnavailableError(
                f"the horovod engine needs horovod.torch, which failed to import "
                f"({type(exc).__name__}: {exc}); rebuild Horovod (`make install`) or choose "
                "another engine with DP_PLUGIN_ENGINE"
            ) from exc
        self._hvd = hvd
        self._torch = torch
        self._process_set = hvd.global_process_set
        self._added_sets[tuple(range(topology.size))] = hvd.global_process_set
        self._owns_init = not hvd.is_initialized()
        if self._owns_init:
            with library_settings(config):  # Horovod reads them inside hvd.init()
                bounded_on(self, hvd.init, "hvd.init() (Horovod's rendezvous of every rank)")
            # Horovod's own atexit hook is an unbounded hvd.shutdown(): ours bounds it.
            atexit.unregister(hvd.shutdown)
            bound_at_exit("horovod", self._shutdown_at_exit, f"rank {topology.rank}: "
                          "hvd.shutdown() at exit")
        if (hvd.rank(), hvd.size()) != (topology.rank, topology.size):
            raise EngineUnavailableError(
                f"Horovod says this process is rank {hvd.rank()} of {hvd.size()}, but the "
                f"{topology.launcher} launcher variables say rank {topology.rank} of "
                f"{topology.size}; start the job with `horovodrun --gloo -np N` and do not "
                "override HOROVOD_RANK/HOROVOD_SIZE"
            )

    def _allreduce_async(self, buf: Any, op: ReduceOp, name: str) -> Handle:
        tensor = self._inplace_tensor(buf, f"allreduce {name!r}")
        wire_dtype = ALLREDUCE_WIRE_DTYPES.get(canonical_dtype(tensor.dtype))
        wire = tensor if wire_dtype is None else tensor.to(getattr(self._torch, wire_dtype))
        description = self.describe("allreduce", name, tensor.nbytes)
        handle = self._start("allreduce", name, description, self._hvd.allreduce_async_, wire,
                             op=getattr(self._hvd, op.name.title()))  # hvd.Sum, hvd.Min ...
        if wire is not tensor:
            handle.then(lambda: tensor.copy_(wire))
        return handle

    def _broadcast_async(self, buf: Any, root: int, name: str) -> Handle:
        tensor = self._bits(self._inplace_tensor(buf, f"broadcast {name!r}"))
        description = self.describe("broadcast", name, tensor.nbytes)
        # Horovod takes the job-wide rank of the root, even in a process set.
        return self._start("broadcast", name, description, self._hvd.broadcast_async_, tensor,
                           root_rank=self.global_ranks[root])

    def _allgather(self, buf: Any, rows: list[int], name: str) -> Any:
        # Horovod agrees on the row counts itself: ``rows`` is not needed.
        if not is_torch(buf) and not _torch_viewable(np.asarray(buf)):
            buf = np.asarray(buf).copy(order="C")  # only read: a copy is fine
        tensor = as_torch(buf).detach().contiguous()
        wire = self._bits(tensor)
        handle = self._start("allgather", name, self.describe("allgather", name),
                             self._hvd.allgather_async, wire)
        handle.wait()
        out = handle.result.view(tensor.dtype)  # bfloat16 travelled as its bits
        return out if is_torch(buf) else as_numpy(out)

    def _barrier(self) -> None:
        # hvd.barrier() blocks in synchronize() without a timeout; a one-element
        # all-reduce is a barrier that honours it.
        token = self._torch.zeros(1, dtype=self._torch.int32)
        self._start("barrier", "barrier", "horovod barrier", self._hvd.allreduce_async_, token,
                    op=self._hvd.Sum).wait()

    def _close(self) -> None:
        """Shut Horovod down if this engine started it.

        Safe after a timeout: Horovod fails the pending operations. A
        subgroup engine only stops accepting collectives: removing a Horovod
        process set is collective over *all* ranks, which a members-only
        shutdown cannot be; the set stays registered (reused if the same
        ranks are asked for again) until Horovod shuts down."""
        if self._owns_init and self._hvd.is_initialized() and not self._shutdown_stuck:
            # Bounded (exit_bounds.py says why). On expiry Horovod's thread
            # still runs, and exiting would join it again: ``_shutdown_at_exit``
            # ends the process instead.
            self._shutdown_stuck = True
            bounded_on(self, self._hvd.shutdown,
                       "hvd.shutdown() (Horovod agrees on the shutdown with every rank)")
            self._shutdown_stuck = False

    def _shutdown_at_exit(self) -> bool:
        """At interpreter exit: shut Horovod down within the timeout (False:
        it did not finish, or an earlier ``shutdown`` did not)."""
        with contextlib.suppress(CollectiveTimeoutError):
            self._close()
        return not self._shutdown_stuck

    def _alltoall(self, buf: Any, counts: np.ndarray, name: str) -> Any:
        """``hvd.alltoall_async`` of the rows' bytes (Horovod has no kernel
        for some dtypes)."""
        torch = self._torch
        wire = torch_byte_rows(as_torch(buf))  # also when this rank sends no rows
        rows = int(counts[:, self.rank].sum())
        out = wire.new_empty((rows, wire.shape[1]))  # an empty result's strides: torch_byte_rows
        if wire.shape[1] and counts.any():  # agreed: every rank skips alike
            splits = torch.tensor([int(c) for c in counts[self.rank]], dtype=torch.int32)
            handle = self._start("alltoall", name, self.describe("alltoall", name, wire.numel()),
                                 self._hvd.alltoall_async, wire, splits=splits)
            handle.wait()
            out = handle.result[0] if rows else out
        return out if is_torch(buf) else as_numpy(out)

    def _reducescatter_start(self, buf: Any, op: ReduceOp, counts: list[int],
                             name: str) -> Started:
        """Horovod's own where it reduces (module docstring): its split of the
        rows is the one ``Engine.reducescatter`` promises."""
        tensor = as_torch(buf).detach()
        dtype = canonical_dtype(tensor.dtype)
        if op is not ReduceOp.SUM or dtype in ALLREDUCE_WIRE_DTYPES or tensor.numel() == 0:
            return super()._reducescatter_start(buf, op, counts, name)
        src = tensor.contiguous()
        handle = self._start("reducescatter", name,
                             self.describe("reducescatter", name, src.nbytes),
                             self._hvd.reducescatter_async, src, op=self._hvd.Sum)
        return handle, lambda: handle.result if is_torch(buf) else as_numpy(handle.result)

    def _channel(self, name: str) -> Engine:
        """Horovod matches collectives by name, not by order: no new group."""
        return self

    def _subgroup(self, members: tuple[int, ...], topology: Topology | None,
                  name: str) -> Engine | None:
        """A Horovod process set of the members: the global set, one this
        engine added before, a new one (``hvd.add_process_set``, collective
        over every Horovod rank, bounded by the timeout), or the one the user
        registered with the same ranks (Horovod refuses duplicates)."""
        self._job_wide_only(members, name, "Horovod adds process sets collectively over all "
                            "its ranks")
        if members not in self._added_sets:
            try:
                added = bounded_on(self, lambda: self._hvd.add_process_set(list(members)),
                                   f"hvd.add_process_set({list(members)})")
            except ValueError as exc:
                if "duplicate" not in str(exc):
                    # Every rank gets the same refusal (e.g. dynamic process sets off).
                    raise DPPluginError(
                        f"subgroup {name!r}: Horovod refused to add a process set of ranks "
                        f"{list(members)}: {str(exc).rstrip('.')}. Under the horovod engine, "
                        "process sets must be asked for when Horovod starts, as in Horovod: "
                        "call hvd.init(process_sets='dynamic') (or pass the sets, "
                        "hvd.init(process_sets=[hvd.ProcessSet([...])])) on every rank, or set "
                        "HOROVOD_DYNAMIC_PROCESS_SETS=1 before hvd.init() (it is "
                        f"{os.environ.get('HOROVOD_DYNAMIC_PROCESS_SETS')!r}); dp_plugin does "
                        "not enable them unasked because Horovod then checks for new sets in "
                        "every cycle"
                    ) from exc
                added = _registered_set(members)
            self._added_sets[members] = added
        if topology is None:
            return None
        return type(self)(topology, self.config, parent=self, process_set=self._added_sets[members])

    def _start(self, kind: str, name: str, description: str, start: Callable[..., int],
               tensor: Any, **options: Any) -> _HorovodHandle:
        """Reserve a name slot, start Horovod's operation (``start(tensor,
        name=, process_set=, **options)``) and wrap its handle."""
        scope = "" if self._parent is None else f"ps{self._process_set.process_set_id}."
        base = f"dp.{scope}{kind}.{name}"
        used = self._in_flight.setdefault(base, set())
        index = next(i for i in range(len(used) + 1) if i not in used)
        used.add(index)
        try:
            hvd_handle = start(tensor, name=f"{base}.{index}", process_set=self._process_set,
                               **options)
        except (RuntimeError, ValueError) as exc:
            used.discard(index)
            raise DPPluginError(
                f"rank {self.rank}: Horovod refused to start {description}: {exc}"
            ) from exc
        return _HorovodHandle(self, description, hvd_handle, (base, index))

    def _release(self, slot: tuple[str, int]) -> None:
        base, index = slot
        used = self._in_flight[base]  # holds index: reserved by _start, released once
        used.discard(index)
        if not used:
            del self._in_flight[base]

    def _inplace_tensor(self, buf: Any, what: str) -> Any:
        # Test numpy first: torch cannot even view negative strides.
        contiguous = buf.is_contiguous() if is_torch(buf) else _torch_viewable(np.asarray(buf))
        if not contiguous:
            strides = tuple(buf.stride()) if is_torch(buf) else np.asarray(buf).strides
            raise ValueError(
                f"{what}: the buffer is not contiguous (strides {strides}); "
                "the horovod engine works in place and needs contiguous memory; pass "
                "buf.contiguous() and copy the result back"
            )
        if not is_torch(buf) and not np.asarray(buf).flags.writeable:
            raise ValueError(
                f"{what}: the buffer is read-only; the horovod engine works in place; pass "
                "a writable copy (buf.copy())"
            )
        return as_torch(buf).detach()  # detach: Horovod writes behind autograd's back

    def _bits(self, tensor: Any) -> Any:
        """bfloat16 as its int16 bit pattern (Horovod has no bf16 kernels);
        other dtypes unchanged. A view: writes reach ``tensor``."""
        return tensor.view(self._torch.int16) if tensor.dtype == self._torch.bfloat16 else tensor


def built_with_nccl() -> bool:
    """Whether ``horovod.torch`` imports and was built with NCCL (Horovod's GPU
    path). Importing the extension starts nothing: no ``hvd.init()``."""
    try:
        import horovod.torch as hvd
    except Exception:  # ImportError, or an ABI error from the extension
        return False
    return bool(hvd.nccl_built())


def _registered_set(members: tuple[int, ...]) -> Any:
    """The set the user registered with these ranks (hvd.init(process_sets=...)
    or hvd.add_process_set)."""
    from horovod.common.process_sets import ProcessSet
    from horovod.torch.mpi_ops import _basics

    for set_id, ranks in _basics._get_process_set_ids_and_ranks().items():
        if tuple(ranks) == members:
            found = ProcessSet(list(members))
            found.process_set_id = set_id
            return found
    raise DPPluginError(f"Horovod reported a process set of ranks {list(members)} that "
                        "it does not list; this is a Horovod bug")


def _torch_viewable(arr: np.ndarray) -> bool:
    """Contiguous, and no negative stride (which ``torch.from_numpy`` rejects
    even on a one-element array)."""
    return bool(arr.flags.c_contiguous) and all(stride >= 0 for stride in arr.strides)

