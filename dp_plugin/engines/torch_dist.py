"""torch.distributed engines: ``gloo`` (CPU) and ``nccl`` (CUDA).

Both run under every launcher: the rendezvous (``rendezvous.py``) uses
torchrun's MASTER_ADDR/PORT, Horovod's rendezvous server under horovodrun,
or an MPI broadcast under mpirun, so no extra port is asked of the user.

If the user already initialized torch.distributed's default group with the
same world, the engine joins it instead of making another, and leaves it
alone at shutdown (a group the engine creates, it destroys).

Distributed contract (on top of ``Engine``'s): every rank issues the same
collectives in the same order on buffers of the same size and dtype;
``allgather`` is a synchronization point and exchanges each rank's first
dimension first, so uneven inputs are fine and a dtype or trailing-shape
mismatch raises the same ``ValueError`` on every rank.

``alltoall`` is ``all_to_all_single`` on the rows' bytes. ``reducescatter``
is the base class's all-reduce-then-slice: Gloo's ``reduce_scatter`` work
has no future and never reported completion when polled here (torch 2.13).
``subgroup`` is ``dist.new_group``, collective over every process of the
job, so only the job-wide engine can make subgroups (a subgroup of a
subgroup raises ``NotImplementedError`` naming the job-wide ranks to use).
"""

from __future__ import annotations

import atexit
from abc import abstractmethod
from datetime import timedelta
from typing import Any, ClassVar

import numpy as np

from dp_plugin import netif
from dp_plugin.arrays import as_numpy, as_torch, is_torch
from dp_plugin.config import Config
from dp_plugin.dtypes import SUPPORTED_DTYPES
from dp_plugin.engines import rendezvous as rdv
from dp_plugin.engines.base import (
    Availability,
    DoneHandle,
    Engine,
    Handle,
    ReduceOp,
    check_gatherable,
)
from dp_plugin.errors import DPPluginError, EngineUnavailableError
from dp_plugin.launch import Topology

_DTYPE_CODES = {name: i for i, name in enumerate(SUPPORTED_DTYPES)}
_DTYPE_NAMES = {i: name for name, i in _DTYPE_CODES.items()}
_MAX_DIMS = 8
"""All-gather inputs with more dimensions are compared by size only."""


class _WorkHandle(Handle):
    """An in-flight torch.distributed ``Work``."""

    def __init__(self, work: Any, description: str, rank: int, timeout_s: float) -> None:
        super().__init__(description, rank, timeout_s)
        self._work = work


class _PollHandle(_WorkHandle):
    """Poll ``Work.is_completed`` (with the base class's backoff, at most 1 ms
    late), then ``wait`` to surface errors and, for NCCL, order the current
    stream after the collective.

    Not ``future.then(callback)``: that callback runs Python on Gloo's thread,
    and a script that exits right after its last collective aborted ("terminate
    called without an active exception") in about 1 run in 5 at 3 ranks.
    """

    def _test(self) -> bool:
        if not self._work.is_completed():
            return False
        try:
            self._work.wait()
        except Exception as exc:
            raise _library_error(self, exc) from exc
        return True


def _library_error(handle: Handle, exc: Exception) -> DPPluginError:
    text = str(exc)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return handle.timeout_error()
    return DPPluginError(
        f"rank {handle.rank}: {handle.description} failed: {text}. Another rank has probably "
        "died or closed its connection; check the other ranks' logs"
    )


class TorchDistEngine(Engine):
    """Collectives through a torch.distributed process group."""

    backend: ClassVar[str]
    """torch.distributed backend name."""
    handle_class: ClassVar[type[_WorkHandle]]
    # Neither Gloo nor NCCL moves int16: reduce it as int32 (exact, and the
    # wrap-around of the cast back matches int16 arithmetic); broadcast and
    # gather it as bytes.
    _WIDENED: ClassVar[dict[str, str]] = {"int16": "int32"}

    def __init__(self, topology: Topology, config: Config) -> None:
        avail = self.availability(topology)
        if not avail.ok:
            raise EngineUnavailableError(f"engine {self.name!r} cannot run here: {avail.reason}")
        super().__init__(topology, config)
        import torch
        import torch.distributed as dist

        self._torch: Any = torch
        self._dist: Any = dist
        self._device: Any = self._select_device()
        self._group: Any = None  # None: the default group
        self._owns_default = False
        self._owns_group = False
        self._closed = False
        self._parent: TorchDistEngine | None = None  # set on subgroup engines
        self.rendezvous_description = self._join_or_create_group()
        if self._owns_default or self._owns_group:
            # A Gloo group destroyed during interpreter teardown while a
            # collective is still pending (after a timeout, say) aborts the
            # process ("terminate called ... IoException"); destroy it first.
            atexit.register(self.shutdown)
        self._reduce_ops = {
            ReduceOp.SUM: dist.ReduceOp.SUM,
            ReduceOp.MIN: dist.ReduceOp.MIN,
            ReduceOp.MAX: dist.ReduceOp.MAX,
            ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
            ReduceOp.AVERAGE: getattr(dist.ReduceOp, "AVG", None),
        }

    @classmethod
    def availability(cls, topology: Topology) -> Availability:
        try:
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
        return Availability(True, f"torch {_torch_version()} {cls.backend} backend")

    @classmethod
    @abstractmethod
    def _backend_problem(cls, topology: Topology) -> str | None:
        """Why this backend cannot run here (None if it can)."""

    @abstractmethod
    def _select_device(self) -> Any:
        """The torch device of the engine's own small tensors."""

    # -- group lifetime ----------------------------------------------------------
    def _join_or_create_group(self) -> str:
        dist = self._dist
        timeout = timedelta(seconds=self.config.timeout_s)
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
            self._group = dist.new_group(backend=self.backend, timeout=timeout)
            self._owns_group = True
            return f"a new {self.backend} group beside the user's {dist.get_backend()} group"
        if self.backend == "gloo":  # multi-host: advertise the interface that reaches the peers
            netif.gloo_interface()
        meeting = rdv.rendezvous(self.topology, self.config)
        kwargs: dict[str, Any] = {}
        if meeting.store is not None:
            kwargs["store"] = meeting.store
        else:
            kwargs["init_method"] = meeting.init_method
        if self.backend == "nccl":
            kwargs["device_id"] = self._device
        dist.init_process_group(
            self.backend, rank=self.rank, world_size=self.size, timeout=timeout, **kwargs
        )
        self._owns_default = True
        return meeting.description

    def shutdown(self) -> None:
        """Destroy the group this engine created (not a user's). Idempotent.

        A subgroup engine destroys only its own group; if the job-wide engine
        already destroyed the default group (which takes every group with
        it), there is nothing left to do."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        dist = self._dist
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group(self._group)
        elif self._owns_default and dist.is_initialized():
            dist.destroy_process_group()

    def _subgroup(self, members: tuple[int, ...], topology: Topology | None,
                  name: str) -> Engine | None:
        """``dist.new_group`` over the members' job-wide ranks: collective
        over every process of the job, members or not."""
        what = f"subgroup {name!r}"
        self._check_open(what)
        if self._parent is not None:
            # new_group needs every process of the job, but only this
            # subgroup's members are here.
            raise NotImplementedError(
                f"{what}: a {self.name} subgroup cannot be split further (torch.distributed "
                "creates groups collectively over the whole job); create it from the "
                f"job-wide engine with the job-wide ranks "
                f"{[self.global_ranks[m] for m in members]}"
            )
        group = self._dist.new_group(
            ranks=[self.global_ranks[m] for m in members],
            timeout=timedelta(seconds=self.config.timeout_s),
            backend=self.backend,
        )
        if topology is None:
            return None
        child = type(self).__new__(type(self))
        Engine.__init__(child, topology, self.config)
        child._torch, child._dist, child._device = self._torch, self._dist, self._device
        child._group = group
        child._owns_default, child._owns_group, child._closed = False, True, False
        child._parent = self
        child._reduce_ops = self._reduce_ops
        child.rendezvous_description = f"a new {self.backend} group of ranks {list(members)}"
        atexit.register(child.shutdown)  # before the parent's (atexit runs LIFO)
        return child

    # -- collectives ---------------------------------------------------------------
    def _allreduce_async(self, buf: Any, op: ReduceOp, name: str) -> Handle:
        t = self._tensor(buf, f"allreduce {name!r}")
        desc = self.describe("allreduce", name, t.numel() * t.element_size())
        if t.numel() == 0:  # every rank has the same size: all skip alike
            return DoneHandle(desc, self.rank, self.config.timeout_s)
        reduce_op = self._reduce_ops[op]
        wide = self._WIDENED.get(str(t.dtype).removeprefix("torch."))
        if wide is None:
            work = self._dist.all_reduce(t, reduce_op, group=self._group, async_op=True)
            return self._handle(work, desc)
        staged = t.to(getattr(self._torch, wide))
        work = self._dist.all_reduce(staged, reduce_op, group=self._group, async_op=True)
        return self._handle(work, desc).then(lambda: t.copy_(staged))

    def _broadcast_async(self, buf: Any, root: int, name: str) -> Handle:
        t = self._tensor(buf, f"broadcast {name!r}")
        desc = self.describe("broadcast", name, t.numel() * t.element_size())
        if t.numel() == 0:
            return DoneHandle(desc, self.rank, self.config.timeout_s)
        if self._group is None:
            work = self._dist.broadcast(self._wire(t), root, async_op=True)
        else:  # root is a rank of this group, not of the job
            work = self._dist.broadcast(self._wire(t), group=self._group, group_src=root,
                                        async_op=True)
        return self._handle(work, desc)

    def _allgather(self, buf: Any, name: str) -> Any:
        what = f"allgather {name!r}"
        dtype = check_gatherable(buf, what)
        t = self._tensor(buf, what, flat=False)
        torch = self._torch
        specs = self._gather_specs(t, dtype, name)
        rows = [int(r) for r in specs[:, 0]]
        trailing = tuple(t.shape[1:])
        longest = max(rows)
        if longest == 0:
            result = t.new_empty((0, *trailing))
        else:
            send = t.contiguous()
            if send.shape[0] != longest:  # pad to the longest: all_gather needs equal sizes
                send = t.new_zeros((longest, *trailing))
                send[: t.shape[0]] = t
            parts = [torch.empty_like(send) for _ in range(self.size)]
            self._handle(
                self._dist.all_gather([self._wire(p) for p in parts], self._wire(send),
                                      group=self._group, async_op=True),
                self.describe("allgather", name, send.numel() * send.element_size()),
            ).wait()
            result = torch.cat([p[:n] for p, n in zip(parts, rows, strict=True)])
        return result if is_torch(buf) else as_numpy(result)

    def _barrier(self) -> None:
        token = self._torch.zeros(1, dtype=self._torch.int32, device=self._device)
        work = self._dist.all_reduce(token, group=self._group, async_op=True)
        self._handle(work, f"{self.name} barrier").wait()

    def _exchange(self, row: np.ndarray, what: str) -> np.ndarray:
        # One fixed-size all_gather instead of allgather's two steps.
        self._check_open(what)
        torch = self._torch
        mine = torch.from_numpy(row).to(self._device)
        table = [torch.empty_like(mine) for _ in range(self.size)]
        self._handle(
            self._dist.all_gather(table, mine, group=self._group, async_op=True),
            self.describe("allgather", f"{what} (headers)"),
        ).wait()
        return np.asarray(torch.stack(table).cpu().numpy())

    def _alltoall(self, buf: Any, counts: np.ndarray, name: str) -> Any:
        """``all_to_all_single`` of each row as raw bytes: exact for every
        dtype, and no backend dtype support needed."""
        t = self._tensor(buf, f"alltoall {name!r}", flat=False)
        torch = self._torch
        trailing = tuple(t.shape[1:])
        row_elems = int(np.prod(trailing, dtype=np.int64))
        received = [int(c) for c in counts[:, self.rank]]
        out = t.new_empty((sum(received), *trailing))
        # counts and row sizes are agreed: every rank skips alike.
        if row_elems and counts.any():
            send = t.detach().contiguous().reshape(t.shape[0], row_elems).view(torch.uint8)
            recv = out.view(out.shape[0], row_elems).view(torch.uint8)
            work = self._dist.all_to_all_single(
                recv, send, output_split_sizes=received,
                input_split_sizes=[int(c) for c in counts[self.rank]],
                group=self._group, async_op=True,
            )
            self._handle(work, self.describe("alltoall", name, send.numel())).wait()
        return out if is_torch(buf) else as_numpy(out)

    # -- helpers -------------------------------------------------------------------
    def _handle(self, work: Any, description: str) -> Handle:
        return self.handle_class(work, description, self.rank, self.config.timeout_s)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise DPPluginError(
                f"{what}: the {self.name} engine was shut down; call dp_plugin.init() again"
            )
        if self._parent is not None and self._parent._closed:
            raise DPPluginError(
                f"{what}: the {self.name} engine this subgroup came from was shut down, "
                "which ended the subgroup too; call dp_plugin.init() and create it again"
            )

    def _tensor(self, buf: Any, what: str, flat: bool = True) -> Any:
        self._check_open(what)
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

    def _wire(self, t: Any) -> Any:
        """``t`` as the backend can move it: int16 travels as bytes (a view)."""
        if t.dtype == self._torch.int16:
            return t.view(self._torch.uint8)
        return t

    def _gather_specs(self, t: Any, dtype: str, name: str) -> Any:
        """Every rank's (rows, ndim, dtype, trailing dims) as a (size, 3 + 7) table,
        after checking that all ranks agree on everything but the rows."""
        torch = self._torch
        spec = [int(t.shape[0]), t.dim(), _DTYPE_CODES[dtype]]
        dims = [int(d) for d in t.shape[1:_MAX_DIMS]]
        spec += dims + [-1] * (_MAX_DIMS - 1 - len(dims))
        mine = torch.tensor(spec, dtype=torch.int64, device=self._device)
        table = [torch.empty_like(mine) for _ in range(self.size)]
        self._handle(
            self._dist.all_gather(table, mine, group=self._group, async_op=True),
            self.describe("allgather", f"{name} (first dimensions)"),
        ).wait()
        specs = torch.stack(table).cpu()
        for r in range(1, self.size):
            if not torch.equal(specs[r, 1:], specs[0, 1:]):
                raise ValueError(
                    f"allgather {name!r}: rank 0 passed {_describe_spec(specs[0])} but rank {r} "
                    f"passed {_describe_spec(specs[r])}; every rank must pass the same dtype and "
                    "the same dimensions after the first (only the first may differ)"
                )
        return specs


class GlooEngine(TorchDistEngine):
    """torch.distributed with Gloo: CPU buffers (CUDA ones are staged by torch)."""

    name = "gloo"
    backend = "gloo"
    handle_class = _PollHandle

    @classmethod
    def _backend_problem(cls, topology: Topology) -> str | None:
        import torch.distributed as dist

        if not dist.is_gloo_available():
            return "this torch build has no Gloo backend"
        return None

    def _select_device(self) -> Any:
        return self._torch.device("cpu")


class NcclEngine(TorchDistEngine):
    """torch.distributed with NCCL: CUDA buffers, one GPU per rank
    (``cuda:local_rank``). Average uses NCCL's native AVG."""

    name = "nccl"
    backend = "nccl"
    handle_class = _PollHandle
    native_ops = frozenset(ReduceOp)

    @classmethod
    def _backend_problem(cls, topology: Topology) -> str | None:
        import torch
        import torch.distributed as dist

        if not torch.cuda.is_available():
            return "no CUDA device is visible (NCCL needs one GPU per rank); use gloo on CPUs"
        if not dist.is_nccl_available():
            return "this torch build has no NCCL backend; install a CUDA build of torch"
        count = torch.cuda.device_count()
        if topology.local_size > count:
            return (
                f"{topology.local_size} ranks on this host but {count} CUDA device(s); NCCL "
                "needs one GPU per rank: start at most that many processes per host"
            )
        return None

    def _select_device(self) -> Any:
        return self._torch.device("cuda", self.topology.local_rank)

    def _check_device(self, t: Any, what: str) -> None:
        if t.device.type != "cuda":
            raise TypeError(
                f"{what}: the nccl engine needs CUDA buffers, got one on {t.device}; move it "
                "to the GPU or use the gloo engine (DP_PLUGIN_ENGINE=gloo) for CPU buffers"
            )


def _describe_spec(spec: Any) -> str:
    rows, ndim, code = (int(v) for v in spec[:3])
    dims = [int(d) for d in spec[3 : 3 + max(0, ndim - 1)]]
    shape = ", ".join(str(d) for d in [rows, *dims])
    more = ", ..." if ndim > _MAX_DIMS else ""
    return f"a {_DTYPE_NAMES.get(code, '?')} buffer of shape ({shape}{more})"


def _torch_version() -> str:
    import torch

    return str(torch.__version__)
