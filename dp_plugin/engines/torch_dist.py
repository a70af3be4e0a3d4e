"""torch.distributed engines: ``gloo`` (CPU) and ``nccl`` (CUDA).

Both run under every launcher: the rendezvous (``rendezvous.py``) uses
torchrun's MASTER_ADDR/PORT, Horovod's rendezvous server under horovodrun,
or an MPI broadcast under mpirun, so no extra port is asked of the user.

If the user already initialized torch.distributed's default group with the
same world, the engine joins it instead of making another, and leaves it
alone at shutdown (a group the engine creates, it destroys).

``allgather`` pads every rank's rows (agreed, maybe uneven) to the longest
and runs one ``all_gather``; ``alltoall`` is ``all_to_all_single`` on the
rows' bytes. A broken engine's ``shutdown`` still destroys the group, so
teardown does not abort on the pending work. ``reducescatter`` is the base
class's all-reduce-then-slice: Gloo's ``reduce_scatter`` work has no future
and never reported completion when polled here (torch 2.13). ``subgroup``
is ``dist.new_group``, collective over every process of the job, so only
the job-wide engine can make subgroups.
"""

from __future__ import annotations

import atexit
from abc import abstractmethod
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar

import numpy as np

from dp_plugin.config import Config
from dp_plugin.engines import rendezvous as rdv
from dp_plugin.engines.base import Availability, Engine, Handle, ReduceOp, Started
from dp_plugin.engines.deadline import bounded_on, is_standing
from dp_plugin.engines.generic import torch_byte_rows
from dp_plugin.engines.waits import WaitBoard
from dp_plugin.errors import CollectiveTimeoutError, DPPluginError, EngineUnavailableError
from dp_plugin.launch import netif
from dp_plugin.launch.topology import Topology
from dp_plugin.reduce.arrays import as_numpy, as_torch, is_torch

STANDING_TIMEOUT = timedelta(days=7)
"""The library's own timeout of a standing all-reduce (``deadline.standing``):
long enough never to fire before its caller's deadline does."""


class TorchDistEngine(Engine):
    """Collectives through a torch.distributed process group."""

    backend: ClassVar[str]
    """torch.distributed backend name."""
    def __init__(self, topology: Topology, config: Config, *,
                 parent: TorchDistEngine | None = None, group: Any = None) -> None:
        """The job-wide engine (joins or creates the default group), or with
        ``parent`` and ``group``: the subgroup engine of that group."""
        if parent is None:
            avail = self.availability(topology)
            if not avail.ok:
                raise EngineUnavailableError(
                    f"engine {self.name!r} cannot run here: {avail.reason}")
        super().__init__(topology, config, parent=parent)
        import torch
        import torch.distributed as dist

        self._torch: Any = torch
        self._dist: Any = dist
        self._device: Any = self._select_device() if parent is None else parent._device
        self._group: Any = group  # None: the default group
        self._board: WaitBoard | None = None
        self._owns_default = False
        self._owns_group = parent is not None
        self._description = (self._join_or_create_group() if parent is None else
                             f"a new {self.backend} group")
        if self._owns_default or self._owns_group:
            # A Gloo group destroyed during interpreter teardown while a
            # collective is still pending (after a timeout, say) aborts the
            # process ("terminate called ... IoException"); destroy it first.
            # A subgroup registers after its parent: atexit runs LIFO.
            atexit.register(self.shutdown)

    @property
    def rendezvous_description(self) -> str:
        """How the group was formed (shown by the tests and ``make check``)."""
        if self._parent is None:
            return self._description
        return f"{self._description} of job ranks {list(self.global_ranks)}"

    @property
    def buffer_device(self) -> str:
        # The engine's device, which a subgroup inherits: the group's own
        # local rank need not be this process's GPU.
        return str(self._device)

    @classmethod
    def availability(cls, topology: Topology) -> Availability:
        try:
            import torch
            import torch.distributed as dist
        except ImportError as exc:
            return Availability(False, f"torch is not installed ({exc}); `pip install torch`")
        if not dist.is_available():
            return Availability(False, "this torch build has no torch.distributed support")
        problem = cls._backend_problem(topology)
        if problem is None:
            problem = rdv.problem(topology)
        if problem is not None:
            return Availability(False, problem)
        return Availability(True, f"torch {torch.__version__} {cls.backend} backend")

    @classmethod
    @abstractmethod
    def _backend_problem(cls, topology: Topology) -> str | None:
        """Why this backend cannot run here (None if it can)."""

    @abstractmethod
    def _select_device(self) -> Any:
        """The torch device of the engine's own small tensors."""

    def _join_or_create_group(self) -> str:
        dist = self._dist
        if dist.is_initialized():
            world = (dist.get_rank(), dist.get_world_size())
            if world != (self.rank, self.size):
                raise EngineUnavailableError(
                    f"torch.distributed is already initialized as rank {world[0]} of "
                    f"{world[1]}, but the launcher says rank {self.rank} of {self.size}; "
                    "initialize it over the whole job, or let dp_plugin do it"
                )
            if self.backend in str(dist.get_backend()):
                return "the already-initialized default group"
            # The user's group speaks another backend: add one of ours over
            # the same ranks (collective on the default group).
            self._group = self._new_group(f"a {self.backend} group beside the user's")
            self._owns_group = True
            return f"a new {self.backend} group beside the user's {dist.get_backend()} group"
        if self.backend == "gloo":  # multi-host: advertise the interface that reaches the peers
            topo = self.topology  # one host: listen on loopback only
            netif.gloo_interface(single_host=topo.local_size == topo.size,
                                 address=topo.rendezvous_addr)
        store, how = rdv.rendezvous(self.topology, self.config)
        device = self._device if self.backend == "nccl" else None  # NCCL binds this GPU
        try:
            dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.size,
                                    timeout=timedelta(seconds=self.config.timeout_s),
                                    device_id=device)
        except (dist.DistStoreError, dist.DistNetworkError) as exc:
            # torch's own text names a store key, not what happened (fault matrix).
            raise _formation_error(
                exc, f"rank {self.rank}: the {self.backend} process group of {self.size} ranks "
                f"did not form within {self.config.timeout_s:g} s (DP_PLUGIN_TIMEOUT; ranks met "
                f"through {how}): another rank has probably died or not started; check the "
                "other ranks' logs") from None
        self._owns_default = True
        return how

    def _new_group(self, what: str, **kwargs: Any) -> Any:
        """``dist.new_group(**kwargs)`` (collective: every rank of the job
        makes every group, in the same order). Past ``DP_PLUGIN_TIMEOUT`` it
        raises dp_plugin's error naming the call, as ``init()`` does, not
        torch's raw ``DistStoreError`` naming a store key."""
        dist = self._dist
        try:
            return dist.new_group(timeout=timedelta(seconds=self.config.timeout_s),
                                  backend=self.backend, **kwargs)
        except (dist.DistStoreError, dist.DistNetworkError) as exc:
            raise _formation_error(
                exc, f"rank {self.job_rank}: torch.distributed.new_group ({what}) did not finish "
                f"within {self.config.timeout_s:g} s (DP_PLUGIN_TIMEOUT): another rank has not "
                "reached the same call; it has probably died or stalls, or the ranks create "
                "groups (channels, process sets, optimizers) in different orders; check the "
                "other ranks' logs") from None

    def _close(self) -> None:
        """Destroy the group this engine created (not a user's), broken or not.

        A subgroup engine destroys only its own group; if the job-wide engine
        already destroyed the default group (which takes every group with
        it), there is nothing left to do."""
        atexit.unregister(self.shutdown)
        dist = self._dist
        # destroy_process_group may wait for the other ranks' pending work
        # (NCCL) and takes no timeout: bound it like a collective.
        if (self._owns_group or self._owns_default) and dist.is_initialized():
            bounded_on(self, lambda: dist.destroy_process_group(self._group),  # None: the default
                       "torch.distributed.destroy_process_group"
                       + (" (subgroup)" if self._owns_group else ""))

    def _channel(self, name: str) -> Engine:
        """``dist.new_group`` over this engine's ranks. A process set's engine
        makes it with its members alone (``use_local_synchronization``); the
        job-wide engine without: torch's hashed-name groups over every rank
        never connect once a group that some ranks are not in exists (seen
        with torch 2.13 / gloo: a hang)."""
        group = self._new_group(f"channel {name!r}", ranks=list(self.global_ranks),
                                use_local_synchronization=self._parent is not None)
        return type(self)(self.topology, self.config, parent=self, group=group)

    def _subgroup(self, members: tuple[int, ...], topology: Topology | None,
                  name: str) -> Engine | None:
        """``dist.new_group`` over the members' job-wide ranks: collective
        over every process of the job, members or not (a subgroup has only its own)."""
        self._job_wide_only(members, name, "torch.distributed creates groups collectively "
                            "over the whole job")
        ranks = [self.global_ranks[m] for m in members]
        group = self._new_group(f"subgroup {name!r} of job ranks {ranks}", ranks=ranks)
        if topology is None:
            return None
        return type(self)(topology, self.config, parent=self, group=group)

    def _allreduce_async(self, buf: Any, op: ReduceOp, name: str) -> Handle:
        """A standing all-reduce gets ``STANDING_TIMEOUT``, any other the group's."""
        t, back = self._staged(self._tensor(buf, f"allreduce {name!r}"))
        desc = self.describe("allreduce", name, t.nbytes)
        if t.numel() == 0:  # every rank has the same size: all skip alike
            return self._done(desc)
        # Neither Gloo nor NCCL reduces int16 (_wire): reduce it as int32, exactly,
        # since the wrap-around of the cast back matches int16 arithmetic.
        staged = t.to(self._torch.int32) if t.dtype == self._torch.int16 else t
        library_op = getattr(self._dist.ReduceOp, op.name)  # never AVERAGE: the base class sums
        if is_standing():
            opts = self._dist.AllreduceOptions()
            opts.reduceOp, opts.timeout = library_op, STANDING_TIMEOUT
            group = self._dist.group.WORLD if self._group is None else self._group
            work = group.allreduce([staged], opts)
        else:
            work = self._dist.all_reduce(staged, library_op, group=self._group, async_op=True)
        if staged is t:
            return PollHandle(work, self, desc).then(back)
        return PollHandle(work, self, desc).then(lambda: (t.copy_(staged), back()))

    def _broadcast_async(self, buf: Any, root: int, name: str) -> Handle:
        t, back = self._staged(self._tensor(buf, f"broadcast {name!r}"))
        desc = self.describe("broadcast", name, t.nbytes)
        if t.numel() == 0:
            return self._done(desc)
        # root is a rank of this group (None: the default one, where it is the job rank)
        work = self._dist.broadcast(self._wire(t), group=self._group, group_src=root, async_op=True)
        return PollHandle(work, self, desc).then(back)

    def _allgather_start(self, buf: Any, rows: list[int], name: str) -> Started:
        given = self._tensor(buf, f"allgather {name!r}", flat=False)
        t, _ = self._staged(given)
        torch = self._torch
        trailing = tuple(t.shape[1:])
        longest = max(rows)
        if longest == 0:  # rows are agreed: every rank skips alike
            empty = t.new_empty((0, *trailing))
            return (self._done(self.describe("allgather", name, 0)),
                    lambda: empty if is_torch(buf) else as_numpy(empty))
        send = t.contiguous()
        if send.shape[0] != longest:  # pad to the longest: all_gather needs equal sizes
            send = t.new_zeros((longest, *trailing))
            send[: t.shape[0]] = t
        parts = [torch.empty_like(send) for _ in range(self.size)]
        work = self._dist.all_gather([self._wire(p) for p in parts], self._wire(send),
                                     group=self._group, async_op=True)
        handle = PollHandle(work, self, self.describe("allgather", name, send.nbytes))

        def result() -> Any:
            out = torch.cat([p[:n] for p, n in zip(parts, rows, strict=True)]).to(given.device)
            return out if is_torch(buf) else as_numpy(out)

        return handle, result

    def _barrier(self) -> None:
        token = self._torch.zeros(1, dtype=self._torch.int32, device=self._device)
        work = self._dist.all_reduce(token, group=self._group, async_op=True)
        PollHandle(work, self, f"{self.name} barrier").wait()

    def _alltoall(self, buf: Any, counts: np.ndarray, name: str) -> Any:
        given = self._tensor(buf, f"alltoall {name!r}", flat=False)
        send = torch_byte_rows(self._staged(given)[0])  # also when this rank sends no rows
        received = [int(c) for c in counts[:, self.rank]]
        out = send.new_empty((sum(received), send.shape[1]))
        if send.shape[1] and counts.any():  # agreed: every rank skips alike
            work = self._dist.all_to_all_single(
                out, send, output_split_sizes=received,
                input_split_sizes=[int(c) for c in counts[self.rank]],
                group=self._group, async_op=True,
            )
            PollHandle(work, self, self.describe("alltoall", name, send.numel())).wait()
        out = out.to(given.device)
        return out if is_torch(buf) else as_numpy(out)

    def wait_board(self) -> WaitBoard | None:
        """Notes of long waits in the default group's store (``waits.py``)."""
        if self._board is None:
            try:
                store = self._dist.distributed_c10d._get_default_store()
            except Exception:  # no default group (torch internals moved): no notes
                return None
            self._board = WaitBoard(store, self.global_ranks[self.rank], self.global_ranks,
                                    self.config.stall_warning_s)
        return self._board

    def _tensor(self, buf: Any, what: str, flat: bool = True) -> Any:
        t = as_torch(buf)
        self._check_device(t, what)
        if flat and not t.is_contiguous():
            # In-place collectives need one dense block; a copy would not
            # reach the caller's memory.
            raise ValueError(
                f"{what}: the buffer is not contiguous (strides {tuple(t.stride())}); pass a "
                "contiguous buffer (np.ascontiguousarray / tensor.contiguous())"
            )
        return t

    def _check_device(self, t: Any, what: str) -> None:
        """Raise if the backend cannot take tensors on ``t``'s device."""

    def _staged(self, t: Any) -> tuple[Any, Callable[[], Any]]:
        """``t`` where the backend takes buffers, and what copies a result
        back into ``t``: itself and nothing for gloo (which stages CUDA
        tensors itself); a device copy for a CPU tensor under nccl."""
        if t.device == self._device or self._device.type == "cpu":
            return t, lambda: None
        staged = t.to(self._device)
        return staged, lambda: t.copy_(staged)

    def _wire(self, t: Any) -> Any:
        """``t`` as the backend can move it: int16 travels as bytes (a view)."""
        return t.view(self._torch.uint8) if t.dtype == self._torch.int16 else t


class PollHandle(Handle):
    """An in-flight torch.distributed ``Work``. Poll ``Work.is_completed``
    (with the base class's backoff, at most 1 ms late), then ``wait`` to
    surface errors and, for NCCL, order the current stream after the
    collective.

    Not ``future.then(callback)``: that callback runs Python on Gloo's thread,
    and a script that exits right after its last collective aborted ("terminate
    called without an active exception") in about 1 run in 5 at 3 ranks.
    """

    def __init__(self, work: Any, engine: TorchDistEngine, description: str) -> None:
        super().__init__(description, engine.job_rank, engine.config.timeout_s, engine.mark_broken,
                         engine.wait_board())
        self._work = work

    def _test(self) -> bool:
        if not self._work.is_completed():
            return False
        try:
            self._work.wait()
        except Exception as exc:  # the timeout error where torch says it timed out
            text = str(exc)
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise self.timeout_error() from exc
            raise DPPluginError(
                f"rank {self.rank}: {self.description} failed: {text.strip().rstrip('.')}."
                f"{self.report()} Another rank has probably died or closed its connection; "
                "check the other ranks' logs"
            ) from exc
        return True


def _formation_error(exc: Exception, message: str) -> DPPluginError:
    """A group that did not form: a ``CollectiveTimeoutError`` where torch's
    store wait timed out (``DistStoreError``), else a ``DPPluginError``;
    ``message`` first, torch's own text after it."""
    import torch.distributed as dist

    kind = CollectiveTimeoutError if isinstance(exc, dist.DistStoreError) else DPPluginError
    return kind(f"{message} ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})")
