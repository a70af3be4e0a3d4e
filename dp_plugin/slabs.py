"""``SlabPool``: bounded memory for the fusion buffers of copy-mode buckets.

A bucket whose members are copied in and out (no adapter keeps a member's
storage in the buffer, and it has no control slot) needs its flat buffer
only from pack to unpack. Such buckets take turns on two *slabs* per dtype
and device, each the size of the plan's largest bucket of that kind, so
their fusion memory is at most twice the threshold however many buckets
the model has (Horovod keeps one fusion buffer per device; PyTorch DDP
without ``gradient_as_bucket_view`` one per bucket, the size of the
gradients).

Before a bucket packs into a slab, the bucket that used the slab before it
must have been unpacked: ``FusedCollective`` waits for it and unpacks it
then. That is back-pressure: at most two copy-mode buckets of a kind are in
flight, and a third waits for the first (``would_block`` tells a caller
that must not wait).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dp_plugin.arrays import ArrayOps
from dp_plugin.dtypes import itemsize
from dp_plugin.fusion import Bucket

SLABS_PER_KIND = 2


@dataclass(eq=False)
class Slab:
    """One reusable flat buffer, and what the bucket using it keeps there."""

    numel: int
    dtype: str
    device: str
    storage: Any = None
    owner: int | None = None
    """Index of the bucket packed into it last (None: never used)."""
    shared: dict[str, Any] = field(default_factory=dict)
    """The hooks' in-flight storage (wire buffers), shared by the buckets that
    use the slab (``GradBucket.shared``)."""

    def allocate(self, ops: ArrayOps) -> Any:
        if self.storage is None:
            self.storage = ops.empty(self.numel, self.dtype, self.device)
        return self.storage


class SlabPool:
    """Two slabs per (dtype, device) of ``buckets``; consecutive buckets of a
    kind (in plan order) take them in turn, the same slab every step."""

    def __init__(self, buckets: Iterable[Bucket]) -> None:
        kinds: dict[tuple[str, str], list[Bucket]] = {}
        for b in buckets:
            kinds.setdefault((b.dtype, b.device), []).append(b)
        self._slabs: dict[tuple[str, str], list[Slab]] = {}
        self._slab_of: dict[int, Slab] = {}
        for key, members in kinds.items():
            largest = max(b.numel for b in members)
            slabs = [Slab(largest, *key) for _ in range(min(SLABS_PER_KIND, len(members)))]
            self._slabs[key] = slabs
            for n, b in enumerate(sorted(members, key=lambda b: b.index)):
                self._slab_of[b.index] = slabs[n % len(slabs)]

    def slab_of(self, bucket: Bucket) -> Slab:
        """The slab bucket ``bucket`` packs into (``take`` claims it)."""
        return self._slab_of[bucket.index]

    def take(self, bucket: Bucket) -> Slab:
        """Claim ``bucket``'s slab (the caller has made sure the slab's
        previous owner is unpacked)."""
        slab = self._slab_of[bucket.index]
        slab.owner = bucket.index
        return slab

    def slabs(self) -> list[Slab]:
        return [s for slabs in self._slabs.values() for s in slabs]

    def allocated_bytes(self) -> int:
        """Bytes of the slabs allocated so far (for memory reports)."""
        return sum(s.numel * itemsize(s.dtype) for s in self.slabs() if s.storage is not None)
