"""``Bucket``: one bucket of a plan, from pack to unpack.

A bucket is built from its plan entry (``fusion.PlanEntry``: which tensors,
where in the flat buffer) and owns the rest: the flat buffer, pack and
unpack, and what it has in flight between ``start`` and ``finish``. Hooks
see it as DDP's ``GradBucket`` (``dp_plugin.reduce.hooks``). Its storage
(its own, or a slab it borrows, see below) is allocated on first use and
reused every step (nothing is allocated per step once warm). Three ways a
member's data gets in and out, chosen per step:

- *copy*: the member is copied into its slice (scaled on the way, so the
  policy's pre-scale costs no extra pass) and copied back out after the
  collective (post-scaled on the way);
- *aliased*: the member already *is* its slice (an adapter used
  ``view(i)`` as the gradient's storage, DDP's ``gradient_as_bucket_view``):
  only scaled in place;
- *direct*: a bucket of one contiguous member whose wire dtype is its own
  dtype is reduced where it lies, with no fusion buffer at all.

An out-of-place collective (``start``'s ``sources``) reads its inputs and
writes new outputs: a *direct* member is copied into its output as the
bucket starts, then reduced there; the others are packed from the inputs
and unpacked into the outputs, as in place.

An optional *control slot* of ``control_numel`` elements follows the
members in the last bucket: its owner writes values there (join flags),
they travel with the bucket unscaled, and the owner reads the reduced
values after the bucket finished.

Where the flat buffer lives: a buffer that is the storage of something
outside it (an adapter took a ``view``, or it holds the control slot) is
*pinned*: allocated once, its own for as long as the plan lasts; so is one
over the threshold (a single tensor that could not be split: two slabs of
its size would cost more than it). Any other buffer only copies, so it
borrows a ``Slab`` for each step; that keeps copy-mode fusion memory within
twice the threshold. Such buckets take turns on two slabs per dtype and
device, each the size of the plan's largest bucket of that kind. Before a
bucket packs into a slab, the bucket that used it before must have
been unpacked: ``start`` waits for it and unpacks it then. That is
back-pressure: at most two copy-mode buckets of a kind are in flight, and a
third waits for the first.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dp_plugin.engines.base import Handle
from dp_plugin.reduce.arrays import ArrayOps, device_of
from dp_plugin.reduce.fusion import PlanEntry, TensorSpec
from dp_plugin.reduce.hooks import CommHook, GradBucket, HookState, ReducePolicy

SLABS_PER_KIND = 2


@dataclass(eq=False)
class Slab:
    """One reusable flat buffer that copy-mode buckets take turns on."""

    numel: int
    dtype: str
    device: str
    storage: Any = None
    owner: Bucket | None = None
    """The bucket packed into it last (None: never used)."""
    shared: dict[str, Any] = field(default_factory=dict)
    """The hooks' in-flight storage (wire buffers), shared by the buckets that
    use the slab (``GradBucket.shared``)."""

    def allocate(self, ops: ArrayOps) -> Any:
        if self.storage is None:
            self.storage = ops.empty(self.numel, self.dtype, self.device)
        return self.storage


class Bucket:
    """The plan entry ``entry`` (spec indices into ``specs``), its buffer and
    its collective in flight; ``slab`` is the slab it borrows while it is
    not pinned (None: the buffer is its own, pinned from the start; see the
    module docstring)."""

    def __init__(self, entry: PlanEntry, specs: Sequence[TensorSpec], label: str, *,
                 wire_dtype: str, control_numel: int = 0, slab: Slab | None = None) -> None:
        self.entry = entry
        self.label = label
        """The collective's name on the engine (same on every rank)."""
        self.names = tuple(specs[i].name for i in entry.members)
        self.shapes = tuple(tuple(specs[i].shape) for i in entry.members)
        self.control_numel = control_numel
        self.numel = entry.numel + control_numel
        self.wire_dtype = wire_dtype
        """The dtype the bucket travels in (the compressor's ``wire_dtype``)."""
        self.in_place = len(self.names) == 1 and not control_numel and wire_dtype == entry.dtype
        """Reduced where its one member lies, when that is a flat array on the
        bucket's device (*direct*, see the module docstring)."""
        self.flat: Any = None
        self.views: list[Any] = []
        self.control: Any = None
        """The control slot (a 1-D slice of ``flat``), if the bucket has one."""
        self.scratch: dict[str, Any] = {}
        """The hooks' per-bucket storage (``GradBucket.scratch``)."""
        self.pinned = bool(control_numel) or slab is None
        """True once the buffer is the storage of something outside it (see
        the module docstring); it then never borrows a slab again."""
        self.slab = slab
        # In flight, from start() to finish(): the collective (None: not
        # started, or finished); the tensors the results go back to; the one
        # member reduced where it lies (*direct*), else per member whether it
        # already was its slice (*aliased*); what unpack multiplies by (1 if
        # the engine did it while reducing); when it packed and unpacked
        # (None: not unpacked yet).
        self.handle: Handle | None = None
        self._ops: Any = None
        self._tensors: Sequence[Any] = ()
        self._direct: Any = None
        self._aliased: list[bool] = []
        self._postscale = 1.0
        self._packed = (0.0, 0.0)
        self._unpacked: tuple[float, float] | None = None

    # -- the buffer -------------------------------------------------------------
    def allocate(self, ops: ArrayOps) -> None:
        """Make the buffer's own flat buffer and the members' views (once)."""
        if self.flat is None:
            self._lie_in(ops, ops.empty(self.numel, self.entry.dtype, self.entry.device))

    def _lie_in(self, ops: ArrayOps, flat: Any) -> None:
        """Make ``flat`` the buffer, with the members' views and the control
        slot sliced from it."""
        self.flat = flat
        if self.control_numel:
            self.control = ops.slice(flat, self.entry.numel, self.numel)
        starts = self.entry.offsets
        self.views = [ops.slice(flat, a, b)
                      for a, b in zip(starts, (*starts[1:], self.entry.numel), strict=True)]

    def view(self, ops: ArrayOps, member: int) -> Any:
        """The 1-D slice where member ``member`` (position in the bucket) lives;
        pins the buffer (an adapter may keep the slice as storage)."""
        if not self.pinned:
            self.pinned = True
            self.flat = None  # it lay in the slab, if anywhere: make its own
        self.allocate(ops)
        return self.views[member]

    def _direct_alias(self, ops: ArrayOps, tensors: Sequence[Any]) -> Any:
        """The one member as a flat array, when the bucket is reduced where it
        lies (see the module docstring); None otherwise."""
        on_device = self.in_place and device_of(tensors[0]) == self.entry.device
        return ops.flat_alias(tensors[0]) if on_device else None

    # -- one collective: start (pack, hook) ... finish (wait, unpack) ---------------
    @property
    def pending(self) -> bool:
        """Started and not unpacked yet."""
        return self.handle is not None and self._unpacked is None

    def would_wait(self, ops: ArrayOps, tensors: Sequence[Any]) -> bool:
        """Would ``start`` wait for the bucket that used its slab before (still
        in flight)? For callers that must not block."""
        if self.numel == 0 or self.pinned or self._direct_alias(ops, tensors) is not None:
            return False
        owner = self.slab.owner  # type: ignore[union-attr]  # unpinned: it has a slab
        return owner is not None and owner.pending and not owner.done()

    def start(self, ops: ArrayOps, tensors: Sequence[Any], policy: ReducePolicy, hook: CommHook,
              state: HookState, sources: Sequence[Any] | None = None) -> Handle:
        """Pack this step's ``tensors`` (one per member; out of place: read
        from ``sources`` instead, ``tensors`` being only where the results
        go) and start the collective ``hook`` runs on the packed buffer;
        returns its handle. The slab and out-of-place rules: the module docstring."""
        t0 = time.perf_counter()
        direct = self._direct_alias(ops, tensors)
        if direct is None and not self.pinned:
            slab = self.slab
            assert slab is not None  # an unpinned bucket borrows one
            if slab.owner is not None and slab.owner.pending:
                slab.owner.unpack()
            slab.owner = self
            if self.flat is None:
                self._lie_in(ops, ops.slice(slab.allocate(ops), 0, self.numel))
        self._aliased = self._pack(ops, tensors, policy.prescale, direct, sources)
        self._ops, self._tensors, self._direct, self._unpacked = ops, tensors, direct, None
        bucket = self._grad_bucket(ops, direct)
        bucket.postscale = policy.postscale
        self._packed = (t0, time.perf_counter())
        try:
            handle = hook(state, bucket)
        except BaseException as exc:
            self._note(exc)
            raise
        self._postscale = bucket.postscale  # 1.0 if the hook folded it into the reduction
        handle.context = self.describe  # the engine's timeout message names the bucket
        self.handle = handle
        return handle

    def _pack(self, ops: ArrayOps, tensors: Sequence[Any], prescale: float, direct: Any,
              sources: Sequence[Any] | None) -> list[bool]:
        """Bring the values into ``direct`` or the buffer; per member, whether
        it already was its slice (*aliased*; empty for ``direct``)."""
        if direct is not None:
            source = None if sources is None else sources[0]
            if source is not None and not ops.shares_memory(direct, ops.flat_alias(source)):
                ops.pack(direct, source, prescale)
            elif prescale != 1.0:
                ops.scale_(direct, prescale)
            return []
        self.allocate(ops)
        if sources is not None:
            for view, source in zip(self.views, sources, strict=True):
                ops.pack(view, source, prescale)
            return [False] * len(self.views)
        aliased = []
        for view, tensor in zip(self.views, tensors, strict=True):
            aliased.append(ops.shares_memory(view, tensor))
            if not aliased[-1]:
                ops.pack(view, tensor, prescale)
            elif prescale != 1.0:
                ops.scale_(view, prescale)
        return aliased

    def _grad_bucket(self, ops: ArrayOps, direct: Any) -> GradBucket:
        """What the hook reduces: ``direct`` (the member itself) or the flat buffer."""
        e, slab = self.entry, None if self.pinned or direct is not None else self.slab
        return GradBucket(e.index, e.dtype, e.device, self.names, ops,
                          self.flat if direct is None else direct, self.label, self.scratch,
                          None if slab is None else slab.shared, 0 if slab is None else slab.numel,
                          self.control_numel if direct is None else 0, self.shapes, e.offsets)

    def done(self) -> bool:
        """Non-blocking: has the collective in flight finished (or none is)?"""
        try:
            return self.handle is None or bool(self.handle.done())
        except BaseException as exc:
            self._note(exc)
            raise

    def wait(self) -> None:
        try:
            if self.handle is not None:
                self.handle.wait()
        except BaseException as exc:
            self._note(exc)
            raise

    def unpack(self) -> None:
        """Wait for the collective and write the results into the tensors it
        was started with (post-scaled)."""
        self.wait()
        t0 = time.perf_counter()
        ops, postscale = self._ops, self._postscale
        if self._direct is not None:
            if postscale != 1.0:
                ops.scale_(self._direct, postscale)
        else:
            for view, tensor, alias in zip(self.views, self._tensors, self._aliased, strict=True):
                if not alias:
                    ops.unpack(tensor, view, postscale)
                elif postscale != 1.0:
                    ops.scale_(view, postscale)
        self._direct, self._tensors = None, ()
        self._unpacked = (t0, time.perf_counter())

    def finish(self, timeline: Any = None) -> Handle | None:
        """Wait and unpack (unless a later bucket needed the slab and did that
        already), record the spans on ``timeline``; consumes what was in
        flight and returns its (completed) handle, or None if the bucket was
        not started."""
        handle = self.handle
        if handle is None:
            return None
        if self._unpacked is None:
            self.unpack()
        assert self._unpacked is not None  # unpacked just now, or when its slab was needed
        t0, t1 = self._unpacked
        self.handle = self._unpacked = None
        if timeline is not None:
            e = self.entry
            args = {"bucket": e.index, "tensors": len(e.members), "bytes": e.nbytes}
            timeline.span(f"pack {e.index}", "pack", *self._packed, tid="pack", args=args)
            timeline.span(f"allreduce {e.index}", "allreduce", handle.started_at,
                          handle.completed_at or t0, tid="allreduce", args=args)
            timeline.span(f"unpack {e.index}", "unpack", t0, t1, tid="unpack", args=args)
        return handle

    def _note(self, exc: BaseException) -> None:
        """Add "while reducing <bucket>" to an error on its way out."""
        exc.add_note(f"while reducing {self.describe()}")

    def describe(self) -> str:
        e = self.entry
        names = ", ".join(repr(n) for n in self.names[:3])
        more = ", ..." if len(self.names) > 3 else ""
        return (f"bucket {e.index} of {self.label.rsplit('.', 1)[0]!r}: {len(self.names)} "
                f"tensor(s), {e.nbytes} bytes {e.dtype} on {e.device}, first {names}{more}")

