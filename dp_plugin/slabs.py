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
    scratch: dict[str, Any] = field(default_factory=dict)
    """The hooks' storage (wire buffers), shared by the buckets that use the slab."""

    def allocate(self, ops: ArrayOps) -> Any:
        if self.storage is None:
            self.storage = ops.empty(self.numel, self.dtype, self.device)
        return self.storage


class SlabPool:
    """Two slabs per (dtype, device) of ``buckets``, handed out in turn."""

    def __init__(self, buckets: Iterable[Bucket]) -> None:
        largest: dict[tuple[str, str], int] = {}
        for b in buckets:
            key = (b.dtype, b.device)
            largest[key] = max(largest.get(key, 0), b.numel)
        self._slabs = {key: [Slab(n, *key) for _ in range(SLABS_PER_KIND)]
                       for key, n in largest.items()}
        self._turn = dict.fromkeys(largest, 0)

    def next_for(self, bucket: Bucket) -> Slab:
        """The slab ``bucket`` would get now (``take`` gives it)."""
        key = (bucket.dtype, bucket.device)
        return self._slabs[key][self._turn[key] % SLABS_PER_KIND]

    def take(self, bucket: Bucket) -> Slab:
        """Hand ``bucket`` the next slab of its kind (the caller has made sure
        the slab's previous owner is unpacked)."""
        slab = self.next_for(bucket)
        self._turn[(bucket.dtype, bucket.device)] += 1
        slab.owner = bucket.index
        return slab

    def slabs(self) -> list[Slab]:
        return [s for slabs in self._slabs.values() for s in slabs]

    def allocated_bytes(self) -> int:
        """Bytes of the slabs allocated so far (for memory reports)."""
        return sum(s.numel * itemsize(s.dtype) for s in self.slabs() if s.storage is not None)
