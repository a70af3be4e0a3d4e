"""Sharded optimizer state (ZeRO stage 1) on the gradient stream's own buckets.

Every rank keeps the whole model, but the optimizer state of only 1/size of
it. The cut follows the fusion plan: each bucket's data (its members, packed
at their offsets, without the control slot) is split into one contiguous
range per rank with the engine's reduce-scatter rule
(``engines.base.reducescatter_counts``), so the split of a bucket costs
nothing beyond the reduction it already has. A step is then:

1. ``reducescatter_hook``: each bucket is reduce-scattered as soon as it is
   ready, in bucket order, on the same fused, overlapped path as the
   all-reduce it replaces; afterwards only the rank's own range of the
   bucket holds the reduced (and, once unpacked, averaged) gradients.
2. The rank steps its ``Piece`` s only: the slices of its tensors that fall
   in its ranges, with the wrapped optimizer's own update.
3. The updated pieces are all-gathered bucket by bucket (``gather_rows``:
   the rows every rank contributes), so every rank ends with the whole model.

For an element-wise optimizer (SGD, Adam, AdamW, ...) each element's update
reads only that element's gradient and state, so the result is bitwise the
unsharded one whenever the reduced gradients are (the engine's reduce-scatter
sums in the order its all-reduce does; see ``reducescatter_hook``).

This module is the framework-free part: which pieces a rank owns and the
hook. The torch adapter's ``sharded.py`` steps the pieces and gathers them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dp_plugin.engines.base import Handle, reducescatter_counts
from dp_plugin.reduce.fusion import PlanEntry
from dp_plugin.reduce.hooks import GradBucket, HookState


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[start, stop)`` of tensor ``index`` (flattened), which this
    rank owns; they sit at ``offset`` in bucket ``bucket``'s buffer."""

    index: int
    bucket: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def shard_bounds(numel: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s range ``[lo, hi)`` of a bucket of ``numel`` elements
    (the engine's reduce-scatter split; empty when ``numel < size`` leaves
    the rank nothing)."""
    counts = reducescatter_counts(numel, size)
    lo = sum(counts[:rank])
    return lo, lo + counts[rank]


def gather_rows(bucket: PlanEntry, size: int) -> list[int]:
    """How many elements each rank contributes to bucket ``bucket``'s
    all-gather of updated values (its range's length)."""
    return reducescatter_counts(bucket.numel, size)


def shard_pieces(plan: Sequence[PlanEntry], sizes: Sequence[int], rank: int,
                 size: int) -> list[Piece]:
    """The pieces rank ``rank`` of ``size`` owns under ``plan``, in bucket and
    offset order; ``sizes[i]`` is tensor ``i``'s element count. Every rank
    computes every rank's pieces alike from the agreed plan."""
    pieces = []
    for b in plan:
        lo, hi = shard_bounds(b.numel, rank, size)
        for index, offset in zip(b.members, b.offsets, strict=True):
            first, last = max(lo, offset), min(hi, offset + sizes[index])
            if first < last:
                pieces.append(Piece(index, b.index, first - offset, last - offset, first))
    return pieces


def reducescatter_hook(state: HookState, bucket: GradBucket) -> Handle:
    """Reduce the bucket so that at least this rank's range (``shard_bounds``)
    holds the reduced values; the rest of the buffer is left undefined.

    On an engine with a reduce-scatter of its own (``Engine.native_reducescatter``:
    MPI's ``Ireduce_scatter``, Horovod's) each rank receives only its range, and
    the control slot, which every rank reads, is all-reduced beside it. The
    others (gloo, nccl, shared memory) would reduce-scatter by an all-reduce of
    a copy and a slice, so the bucket is all-reduced in place instead: the same
    bytes, no copy, and the same sums as the unsharded path by construction.
    """
    engine = state.engine
    flat = bucket.buffer()
    if not engine.native_reducescatter:
        return engine.allreduce_async(flat, state.engine_op, name=bucket.label)
    ops = bucket.ops
    numel = int(flat.shape[0]) - bucket.control_numel
    data = ops.slice(flat, 0, numel)
    lo, hi = shard_bounds(numel, engine.rank, engine.size)
    handle, result = engine.reducescatter_async(data, state.engine_op, name=bucket.label)
    handle.then(lambda: ops.cast_into(ops.slice(flat, lo, hi), result()) if hi > lo else None)
    if bucket.control_numel:
        control = engine.allreduce_async(ops.slice(flat, numel, int(flat.shape[0])),
                                         state.engine_op, name=f"{bucket.label}.control")
        handle.then(control.wait)
    return handle
