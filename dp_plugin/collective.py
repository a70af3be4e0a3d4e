"""``FusedCollective``: the one path every fused collective of dp_plugin takes.

    plan (tensors -> buckets)                         dp_plugin.fusion
      -> pack into a FusionBuffer                     dp_plugin.buffer
         (its own, or a slab it borrows)              dp_plugin.slabs
      -> agree once across ranks                      dp_plugin.request
      -> hook(state, bucket) -> handle                dp_plugin.hooks
      -> engine transport                             dp_plugin.engines
      -> unpack

The gradient scheduler drives it bucket by bucket as gradients become
ready; ``run`` drives it all at once for grouped all-reduces, parameter and
optimizer-state broadcasts, metric averaging and SyncBatchNorm statistics.

Distributed contract: every rank builds it with the same specs (in the same
order) and settings, and starts buckets in the same order. The first
``start`` runs the agreement check (a collective) on every rank; a
difference raises ``LayoutMismatchError`` on every rank. After any failed
collective the object refuses further work (the ranks are out of step).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dp_plugin import fusion
from dp_plugin.arrays import ArrayOps, NumpyOps, ops_for, spec_of
from dp_plugin.buffer import FusionBuffer
from dp_plugin.compression import get_compressor
from dp_plugin.dtypes import itemsize
from dp_plugin.engines.base import Handle, ReduceOp
from dp_plugin.errors import DPPluginError
from dp_plugin.fusion import TensorSpec, plan_buckets
from dp_plugin.hooks import (
    NO_SCALING,
    CommHook,
    HookState,
    ReducePolicy,
    hook_for,
)
from dp_plugin.request import Request, check
from dp_plugin.slabs import Slab, SlabPool
from dp_plugin.timeline import NullTimeline

UNBOUNDED = 1 << 62
"""The threshold of a *grouped* collective (a grouped all-reduce, metric
averaging): the caller puts the whole list in flight at once. Its tensors of
``DIRECT_BYTES`` or more travel alone, in place; the others in buckets of at
most ``PIPELINE_CHUNK`` bytes, each with a buffer of its own,
so that packing chunk k+1 and unpacking chunk k-1 run while chunk k is on
the wire (the engine's transport runs in its own threads) instead of pack,
transfer and unpack one after another (issue 25: one 110 MB bucket reached
78-83% of a 1 Gbit/s link where one flat buffer reaches 95%)."""

DIRECT_BYTES = 1024 * 1024
"""A tensor of a grouped collective this large travels alone, reduced where it
lies: no pack or unpack copy for the bulk of a model's bytes (a copy costs
CPU the transport needs on a loaded host: 0.26 s of CPU against 0.13 s for
one flat Gloo buffer of ResNet-50's 97 MiB when every tensor was copied)."""

PIPELINE_CHUNK = 8 * 1024 * 1024
"""Bytes per bucket of a grouped collective. Measured on the rehearsal
cluster (benchmarks/cluster_bench.py, BENCHMARKS.md "Rehearsal cluster"):
small enough that the first pack and the last unpack, the only copies left
exposed, are short; large enough that a collective's fixed cost per bucket
stays small next to its transfer."""


@dataclass(eq=False)
class Bucket:
    """One bucket of the plan: its plan entry, its fusion buffer, and what it
    has in flight between ``start`` and ``finish`` (DDP's ``Bucket``)."""

    entry: fusion.Bucket
    buffer: FusionBuffer
    handle: Handle | None = None
    """The collective in flight (None: not started, or finished)."""
    tensors: list[Any] | None = None
    """The tensors it was started with: the results are written back there."""
    direct: Any = None
    """The one member reduced where it lies (``FusionBuffer.direct_alias``), if so."""
    aliased: list[bool] = field(default_factory=list)
    """Per member: it already was its slice of the buffer (``FusionBuffer.pack``)."""
    folded: bool = False
    """Did its hook fold the post-scale into the reduction?"""
    packed: tuple[float, float] = (0.0, 0.0)
    unpacked: tuple[float, float] | None = None
    """When it was unpacked (None: not yet, this time in flight)."""

    @property
    def index(self) -> int:
        return self.entry.index

    @property
    def pending(self) -> bool:
        """Started and not unpacked yet."""
        return self.handle is not None and self.unpacked is None


class FusedCollective:
    """Fused collectives over a fixed list of tensors (see the module docstring).

    ``policy`` scales (``ReducePolicy``; none by default); ``hook`` moves a
    packed bucket (default: all-reduce, compressed per ``compression``);
    ``threshold`` caps a bucket's bytes (``first_threshold`` the first
    bucket's, see ``plan_buckets``); ``order`` is the expected ready
    order (default: reverse registration); ``groups`` are gradient groups,
    each a bucket of its own (``plan_buckets``); ``control_numel`` adds a control
    slot to the last bucket (see ``FusionBuffer``); ``settings`` are
    compared across ranks with ``layout`` (what the ranks compare; default
    ``specs``); ``root`` is the broadcast root
    as a rank of ``engine``; ``agreed=True`` skips the agreement step when
    the caller has already checked the ranks' requests.
    """

    def __init__(
        self,
        specs: Sequence[TensorSpec],
        *,
        engine: Any,
        name: str,
        threshold: int,
        first_threshold: int | None = None,
        policy: ReducePolicy = NO_SCALING,
        compression: Any = "none",
        hook: CommHook | None = None,
        order: Iterable[int] | None = None,
        groups: Sequence[Sequence[int]] = (),
        control_numel: int = 0,
        settings: Mapping[str, Any] | None = None,
        layout: Sequence[TensorSpec] | None = None,
        root: int = 0,
        timeline: Any = None,
        array_ops: ArrayOps | None = None,
        what: str | None = None,
        agreed: bool = False,
    ) -> None:
        self.engine = engine
        self.name = name
        self.specs = tuple(specs)
        self.layout = self.specs if layout is None else tuple(layout)
        self.threshold = threshold
        self.first_threshold = first_threshold
        self.policy = policy
        self.compressor = get_compressor(compression)
        self.hook: CommHook = hook_for(self.compressor) if hook is None else hook
        self.state = HookState(engine, policy.engine_op, root)
        self.control_numel = control_numel
        self.what = what or f"tensors of {name!r}"
        self.settings = {
            "fusion threshold": threshold, "first bucket threshold": first_threshold,
            "compression": self.compressor.name,
            "op": policy.op.value,
            # The user's factors, by their names; without them (a policy built by hand)
            # the derived ones.
            **(dict(policy.settings) or {"prescale": policy.prescale,
                                         "postscale": policy.postscale}),
            "root": root, **(settings or {}),
        }
        self.timeline = NullTimeline() if timeline is None else timeline
        self.groups = tuple(tuple(g) for g in groups)
        if self.groups:
            self.settings["groups"] = self.groups
        self.ops = array_ops
        self.agreed = agreed
        """True once the ranks agreed (or the caller already made them agree)."""
        self.broken: BaseException | None = None
        self.plan_version = -1
        self.grouped = threshold >= UNBOUNDED
        """A grouped collective: buckets of ``PIPELINE_CHUNK``, each with its own
        buffer (see ``UNBOUNDED``)."""
        self.install(self._plan(order))

    def _plan(self, order: Iterable[int] | None) -> list[Any]:
        """Buckets of ``threshold`` bytes; of ``PIPELINE_CHUNK`` when grouped, with
        every tensor of ``DIRECT_BYTES`` or more alone."""
        if self.grouped:
            return plan_buckets(self.specs, PIPELINE_CHUNK, order=order,
                                first_threshold=self.first_threshold, alone_from=DIRECT_BYTES)
        return plan_buckets(self.specs, self.threshold, order=order,
                            first_threshold=self.first_threshold, groups=self.groups)

    # -- plan ---------------------------------------------------------------------
    def install(self, plan: list[Any]) -> None:
        """Adopt ``plan``: new fusion buffers (allocated on first use)."""
        self.plan = plan
        self.plan_version += 1
        last = len(plan) - 1
        self.buckets = [
            Bucket(b, FusionBuffer(
                b, self.specs, f"{self.name}.bucket{b.index}",
                self.control_numel if b.index == last else 0,
                # One tensor over the threshold; or a grouped collective's
                # chunk, which must not wait for a slab (all start at once).
                pinned=self.grouped or b.nbytes > self.threshold,
                wire_dtype=self.compressor.wire_dtype(b.dtype)))
            for b in plan
        ]
        self.bucket_of = [0] * len(self.specs)
        for b in plan:
            for i in b.members:
                self.bucket_of[i] = b.index
        self.pool = SlabPool(r.entry for r in self.buckets if not r.buffer.pinned)
        """Where unpinned buffers lie while they are in flight (``dp_plugin.slabs``)."""

    @property
    def buffers(self) -> list[FusionBuffer]:
        return [r.buffer for r in self.buckets]

    def replan(self, order: Sequence[int]) -> bool:
        """Re-plan for the ready order ``order``; True if the buckets changed."""
        plan = self._plan(order)
        if [b.members for b in plan] == [b.members for b in self.plan]:
            return False
        control = self.buckets[-1].buffer.control if self.buckets else None
        self.install(plan)
        if control is not None:  # the control slot's values move with it
            self.backend().pack(self.control(), control)
        return True

    def retune(self, threshold: int, order: Sequence[int]) -> bool:
        """Use ``threshold`` from now on and re-plan for ``order`` (autotune);
        every rank at the same point, between steps. True if the buckets changed."""
        self.threshold = threshold
        self.grouped = threshold >= UNBOUNDED
        self.settings["fusion threshold"] = threshold
        return self.replan(order)

    def backend(self, like: Any = None) -> ArrayOps:
        if self.ops is None:
            if like is not None:
                self.ops = ops_for(like)
            elif all(s.device == "cpu" for s in self.specs):
                self.ops = NumpyOps()
            else:
                from dp_plugin.arrays import TorchOps

                self.ops = TorchOps()
        return self.ops

    def view(self, index: int, like: Any = None) -> Any:
        """Spec ``index``'s slice of its fusion buffer, shaped like the spec;
        the buffer is pinned from now on (the caller may keep the slice as
        storage, see ``FusionBuffer``)."""
        record = self.buckets[self.bucket_of[index]]
        buf = record.buffer
        if not buf.pinned and record.handle is not None:
            raise DPPluginError(
                f"{self.name!r}: a view of tensor {self.specs[index].name!r} was asked for while "
                "its bucket is in flight; take views before the bucket starts (a programming "
                "error in the caller)")
        member = buf.bucket.members.index(index)
        return buf.view(self.backend(like), member).reshape(self.specs[index].shape)

    def packs(self, index: int) -> bool:
        """True if spec ``index`` is copied into a fusion buffer (False when
        its bucket is one member reduced where it lies, see ``FusionBuffer``)."""
        return not self.buckets[self.bucket_of[index]].buffer.in_place

    def control(self, like: Any = None) -> Any:
        """The control slot (in the last bucket's buffer)."""
        buf = self.buckets[-1].buffer
        buf.allocate(self.backend(like))
        return buf.control

    # -- data path -------------------------------------------------------------------
    def agree(self) -> None:
        """Run the agreement check now, if it has not run (collective; ``start``
        runs it before the first bucket otherwise). Callers whose buckets
        start at rank-dependent times (inside backward hooks) call it at a
        point every rank reaches in the same order: it blocks."""
        if not self.agreed:
            self.agreed = True
            self.guard(lambda: check(self.engine, Request.fused(self.layout, self.what,
                                                                self.settings)))

    def start(self, index: int, tensors: Sequence[Any]) -> Handle | None:
        """Pack bucket ``index`` from ``tensors`` (indexed by spec) and start its
        collective. Returns the handle (None for an empty bucket)."""
        self.check_usable()
        record = self.buckets[index]
        buf = record.buffer
        if buf.numel == 0:
            return None  # nothing to move; every rank skips it alike (same plan)
        self.agree()
        t0 = time.perf_counter()
        ops, members = self._members(index, tensors)
        direct = buf.direct_alias(ops, members)
        slab = None if direct is not None or buf.pinned else self._free_slab(index)
        record.aliased = buf.pack(ops, members, self.policy.prescale, direct, slab)
        record.direct = direct
        grad_bucket = buf.grad_bucket(ops, direct)
        if self._can_fold(buf):
            grad_bucket.postscale = self.policy.postscale
        t1 = time.perf_counter()
        handle: Handle = self.guard(lambda: self.hook(self.state, grad_bucket), buf)
        record.folded = grad_bucket.folded
        handle.context = buf.describe  # the engine's timeout message names the bucket
        record.handle, record.tensors, record.packed = handle, members, (t0, t1)
        return handle

    def _can_fold(self, buf: FusionBuffer) -> bool:
        """Can the engine multiply the sum by the post-scale while reducing
        (exactly as ``unpack`` would)? Shared memory, op sum, and no control
        slot (its counts are not scaled). The bucket then offers the factor
        to the hook (``GradBucket.postscale``); ``allreduce_hook`` takes it,
        also when a user's hook wraps it, and says so (``folded``)."""
        scales = getattr(self.engine, "scales_in_reduction", None)
        return (self.policy.postscale != 1.0
                and self.policy.engine_op is ReduceOp.SUM and scales is not None
                and not buf.control_numel and bool(scales(buf.bucket.dtype)))

    def would_block(self, index: int, tensors: Sequence[Any]) -> bool:
        """Would ``start(index, tensors)`` wait for an earlier bucket to finish
        (its slab is still in flight)? For callers that must not block."""
        buf = self.buckets[index].buffer
        if buf.numel == 0 or buf.pinned:
            return False
        if buf.direct_alias(*self._members(index, tensors)) is not None:
            return False
        owner = self.pool.slab_of(buf.bucket).owner
        return owner is not None and self.buckets[owner].pending and not self.done(owner)

    def _members(self, index: int, tensors: Sequence[Any]) -> tuple[ArrayOps, list[Any]]:
        """The array backend and bucket ``index``'s members among ``tensors``."""
        members = [tensors[i] for i in self.buckets[index].entry.members]
        return self.backend(members[0] if members else None), members

    def _free_slab(self, index: int) -> Slab:
        """Bucket ``index``'s slab, once the bucket that used it before is
        unpacked (waiting for that one here if it is still in flight)."""
        entry = self.buckets[index].entry
        owner = self.pool.slab_of(entry).owner
        if owner is not None and self.buckets[owner].pending:
            self._unpack(self.buckets[owner])
        return self.pool.take(entry)

    def _unpack(self, record: Bucket) -> None:
        """Wait for ``record`` and write its result into the tensors it was
        started with."""
        self.wait(record.index)
        assert record.tensors is not None  # started
        t0 = time.perf_counter()
        record.buffer.unpack(self.backend(), record.tensors,
                             1.0 if record.folded else self.policy.postscale,
                             record.direct, record.aliased)
        record.direct = None
        record.unpacked = (t0, time.perf_counter())

    def wire_bytes(self, index: int) -> int:
        b = self.buckets[index].buffer
        return b.numel * itemsize(b.wire_dtype)

    def done(self, index: int) -> bool:
        record = self.buckets[index]
        return record.handle is None or bool(self.guard(record.handle.done, record.buffer))

    def wait(self, index: int) -> None:
        record = self.buckets[index]
        if record.handle is not None:
            self.guard(record.handle.wait, record.buffer)

    def finish(self, index: int) -> Handle | None:
        """Wait for bucket ``index`` and unpack it into the tensors it was
        started with (unless a later bucket needed its slab and did that
        already); returns its (completed) handle, or None if the bucket was
        not started."""
        record = self.buckets[index]
        handle = record.handle
        if handle is None:
            return None
        if record.unpacked is None:
            self._unpack(record)
        assert record.unpacked is not None  # unpacked just now, or when its slab was needed
        t0, t1 = record.unpacked
        record.handle = record.tensors = record.unpacked = None
        b = record.entry
        args = {"bucket": b.index, "tensors": len(b.members), "bytes": b.nbytes}
        tl = self.timeline
        tl.span(f"pack {b.index}", "pack", *record.packed, tid="pack", args=args)
        tl.span(f"allreduce {b.index}", "allreduce", handle.started_at,
                handle.completed_at or t0, tid="allreduce", args=args)
        tl.span(f"unpack {b.index}", "unpack", t0, t1, tid="unpack", args=args)
        return handle

    def run(self, tensors: Sequence[Any]) -> None:
        """Every bucket, in order: start all, then finish all (a synchronization point)."""
        for b in self.plan:
            self.start(b.index, tensors)
        for b in self.plan:
            self.finish(b.index)

    # -- errors -------------------------------------------------------------------------
    def guard(self, fn: Any, buf: FusionBuffer | None = None) -> Any:
        """Run a step of the protocol; on failure the object is unusable: the
        ranks no longer agree on what comes next, so later calls re-raise
        instead of starting collectives that could only mismatch or hang."""
        try:
            return fn()
        except BaseException as exc:
            self.broken = exc
            if buf is not None:
                exc.add_note(f"while reducing {buf.describe()}")
            raise

    def check_usable(self, subject: str | None = None) -> None:
        """Raise if an earlier collective failed; ``subject`` names the caller
        in the message (default: this collective's name)."""
        if self.broken is not None:
            who = f"{self.name!r}" if subject is None else subject
            raise DPPluginError(
                f"{who} failed earlier ({type(self.broken).__name__}: {self.broken}); "
                "the ranks' collectives are out of step, so it cannot continue. Fix the cause "
                "and restart the job"
            ) from self.broken


def start_allreduce(engine: Any, outs: Sequence[Any], name: str | None, op: ReduceOp,
                    pre: float, post: float) -> tuple[FusedCollective, list[Handle]]:
    """Start the agreed all-reduce of ``outs`` (torch tensors or numpy arrays)
    in place, grouped (``UNBOUNDED``): ``allreduce`` and its grouped forms,
    and a joined rank's identity contribution to them (``join.replay``)."""
    label = name or "allreduce"
    specs = [TensorSpec(f"{label}.{i}", *spec_of(t)) for i, t in enumerate(outs)]
    fused = FusedCollective(
        specs, engine=engine, name=label, threshold=UNBOUNDED, order=range(len(specs)),
        policy=ReducePolicy.for_collective(op, engine.size, prescale=pre, postscale=post),
        array_ops=ops_for(outs[0]), agreed=True,
    )
    return fused, [h for b in fused.plan if (h := fused.start(b.index, outs)) is not None]

