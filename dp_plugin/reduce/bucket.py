"""``FusionBuffer``: the flat buffer of one bucket, with pack and unpack.

One buffer per bucket of the plan; its storage (its own, or a slab it
borrows, see below) is allocated on first use and reused every step
(nothing is allocated per step once warm). Three ways a member's data gets
in and out, chosen per step:

- *copy*: the member is copied into its slice (scaled on the way, so the
  policy's pre-scale costs no extra pass) and copied back out after the
  collective (post-scaled on the way);
- *aliased*: the member already *is* its slice (an adapter used
  ``view(i)`` as the gradient's storage, DDP's ``gradient_as_bucket_view``):
  only scaled in place;
- *direct*: a bucket of one contiguous member whose wire dtype is its own
  dtype is reduced where it lies, with no fusion buffer at all.

An out-of-place collective (``pack``'s ``sources``) reads its inputs and
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
device, each the size of the plan's largest bucket of that kind (Horovod
keeps one fusion buffer per device; PyTorch DDP without
``gradient_as_bucket_view`` one per bucket, the size of the gradients).
Before a bucket packs into a slab, the bucket that used it before must have
been unpacked: the ``Reducer`` (``dp_plugin.reduce.reducer``) waits for it and
unpacks it then. That is back-pressure: at most two copy-mode buckets of a
kind are in flight, and a third waits for the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dp_plugin.reduce.arrays import ArrayOps, device_of
from dp_plugin.reduce.fusion import Bucket, TensorSpec
from dp_plugin.reduce.hooks import GradBucket

SLABS_PER_KIND = 2


@dataclass(eq=False)
class Slab:
    """One reusable flat buffer that copy-mode buffers take turns on."""

    numel: int
    dtype: str
    device: str
    storage: Any = None
    owner: Any = None
    """The ``Bucket`` (``dp_plugin.reduce.reducer``) packed into it last (None: never used)."""
    shared: dict[str, Any] = field(default_factory=dict)
    """The hooks' in-flight storage (wire buffers), shared by the buckets that
    use the slab (``GradBucket.shared``)."""

    def allocate(self, ops: ArrayOps) -> Any:
        if self.storage is None:
            self.storage = ops.empty(self.numel, self.dtype, self.device)
        return self.storage


class FusionBuffer:
    """Pack and unpack the members of ``bucket`` (spec indices into ``specs``)."""

    def __init__(self, bucket: Bucket, specs: Sequence[TensorSpec], label: str,
                 control_numel: int = 0, pinned: bool = False, *, wire_dtype: str) -> None:
        self.bucket = bucket
        self.label = label
        self.names = tuple(specs[i].name for i in bucket.members)
        self.numels = tuple(specs[i].numel for i in bucket.members)
        self.shapes = tuple(tuple(specs[i].shape) for i in bucket.members)
        self.control_numel = control_numel
        self.wire_dtype = wire_dtype
        """The dtype the bucket travels in (the compressor's ``wire_dtype``)."""
        self.in_place = len(self.names) == 1 and not control_numel and wire_dtype == bucket.dtype
        """Reduced where its one member lies, when that is a flat array on the
        bucket's device (*direct*, see the module docstring)."""
        self.flat: Any = None
        self.views: list[Any] = []
        self.control: Any = None
        """The control slot (a 1-D slice of ``flat``), if the bucket has one."""
        self.scratch: dict[str, Any] = {}
        """The hooks' per-bucket storage (``GradBucket.scratch``)."""
        self.pinned = pinned or bool(control_numel)
        """True once the buffer is the storage of something outside it (see
        the module docstring); it then never borrows a slab again."""
        self._slab: Slab | None = None
        """The slab ``flat`` lies in (None: ``flat`` is the buffer's own)."""

    @property
    def numel(self) -> int:
        return self.bucket.numel + self.control_numel

    def allocate(self, ops: ArrayOps) -> None:
        """Make the buffer's own flat buffer and the members' views (once)."""
        if self.flat is None or self._slab is not None:
            self._lie_in(ops, ops.empty(self.numel, self.bucket.dtype, self.bucket.device), None)

    def _lie_in(self, ops: ArrayOps, flat: Any, slab: Slab | None) -> None:
        """Make ``flat`` (in ``slab``, or the buffer's own) the buffer, with the
        members' views and the control slot sliced from it."""
        b = self.bucket
        self.flat = flat
        self._slab = slab
        if self.control_numel:
            self.control = ops.slice(flat, b.numel, self.numel)
        self.views = [ops.slice(flat, off, off + n) for off, n in zip(b.offsets, self.numels,
                                                                      strict=True)]

    def view(self, ops: ArrayOps, member: int) -> Any:
        """The 1-D slice where member ``member`` (position in the bucket) lives;
        pins the buffer (an adapter may keep the slice as storage)."""
        self.pinned = True
        self.allocate(ops)
        return self.views[member]

    def direct_alias(self, ops: ArrayOps, tensors: Sequence[Any]) -> Any:
        """The one member as a flat array, when the bucket is reduced where it
        lies (see the module docstring); None otherwise."""
        if self.in_place and device_of(tensors[0]) == self.bucket.device:
            return ops.flat_alias(tensors[0])
        return None

    def pack(self, ops: ArrayOps, tensors: Sequence[Any], prescale: float, direct: Any = None,
             slab: Slab | None = None, sources: Sequence[Any] | None = None) -> list[bool]:
        """Bring this step's ``tensors`` (one per member) into the buffer: into
        ``direct`` (from ``direct_alias``) if given, else into ``slab`` if
        given (an unpinned buffer), else into the buffer's own storage.
        Returns, per member, whether it already was its slice (*aliased*:
        scaled in place, nothing copied); empty for ``direct``. The caller
        keeps both for ``unpack``: they are the bucket's state in flight.

        ``sources`` (one per member): read the values from there instead,
        when ``tensors`` are only where the results go (an out-of-place
        collective: ``tensors`` are fresh outputs). Sources are only read:
        each is copied (scaled) into ``direct`` or its slice, the one copy an
        out-of-place member costs beyond an in-place one; none is aliased."""
        if direct is not None:
            source = None if sources is None else sources[0]
            if source is not None and not ops.shares_memory(direct, ops.flat_alias(source)):
                ops.pack(direct, source, prescale)
            elif prescale != 1.0:
                ops.scale_(direct, prescale)
            return []
        if slab is not None:  # the caller made sure its previous owner is unpacked
            if self._slab is not slab:
                self._lie_in(ops, ops.slice(slab.allocate(ops), 0, self.numel), slab)
        else:
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

    def unpack(self, ops: ArrayOps, tensors: Sequence[Any], postscale: float, direct: Any,
               aliased: Sequence[bool]) -> None:
        """Write the reduced values back into ``tensors`` (post-scaled);
        ``direct`` and ``aliased`` are what ``pack`` was given and returned."""
        if direct is not None:
            if postscale != 1.0:
                ops.scale_(direct, postscale)
            return
        for view, tensor, alias in zip(self.views, tensors, aliased, strict=True):
            if not alias:
                ops.unpack(tensor, view, postscale)
            elif postscale != 1.0:
                ops.scale_(view, postscale)

    def grad_bucket(self, ops: ArrayOps, direct: Any = None) -> GradBucket:
        """What the hook reduces: ``direct`` (the member itself) or the flat buffer."""
        b = self.bucket
        slab = self._slab
        return GradBucket(b.index, b.dtype, b.device, self.names, ops,
                          self.flat if direct is None else direct, self.label, self.scratch,
                          None if slab is None else slab.shared,
                          0 if slab is None else slab.numel,
                          self.control_numel if direct is None else 0,
                          self.shapes, tuple(b.offsets))

    def describe(self) -> str:
        b = self.bucket
        names = ", ".join(repr(n) for n in self.names[:3])
        more = ", ..." if len(self.names) > 3 else ""
        return (f"bucket {b.index} of {self.label.rsplit('.', 1)[0]!r}: {len(self.names)} "
                f"tensor(s), {b.nbytes} bytes {b.dtype} on {b.device}, first {names}{more}")
