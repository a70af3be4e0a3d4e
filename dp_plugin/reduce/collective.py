"""One-shot fused collectives: a list of tensors, every one given at once.

``fused_collective`` is the one path of grouped all-reduces and broadcasts
(``objects.broadcast_bytes``); a stream of gradients, which become ready one
by one, is the ``Reducer``'s (``dp_plugin.reduce.reducer``).

Nothing waits for readiness, so the plan is simple: every tensor of
``DIRECT_BYTES`` or more travels alone, reduced where it lies; the others
go in buckets of at most ``PIPELINE_CHUNK`` bytes, each with a buffer of
its own, and every bucket is put in flight at once, so that packing chunk
k+1 and unpacking chunk k-1 run while chunk k is on the wire (the engine's
transport runs in its own threads) instead of pack, transfer and unpack one
after another (measured: docs/benchmarks-history.md, "The rehearsal cluster").

The caller checks its request first (``dp_plugin.agree.check``): the buckets
themselves run no agreement.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from dp_plugin.engines.base import Handle
from dp_plugin.reduce.arrays import ops_for, spec_of
from dp_plugin.reduce.bucket import Bucket
from dp_plugin.reduce.compression import Compressor, get_compressor
from dp_plugin.reduce.fusion import TensorSpec, plan_buckets
from dp_plugin.reduce.hooks import NO_SCALING, CommHook, HookState, ReducePolicy, hook_for

DIRECT_BYTES = 1024 * 1024
"""A tensor this large travels alone, reduced where it lies: no pack or
unpack copy (CPU the transport needs on a loaded host) for the bulk of a
model's bytes (measured: docs/benchmarks-history.md, "The rehearsal cluster")."""

PIPELINE_CHUNK = 8 * 1024 * 1024
"""Bytes per bucket. Measured on the rehearsal cluster
(benchmarks/cluster_bench.py, docs/benchmarks-history.md, "The rehearsal
cluster"): small enough that the first pack and the last unpack, the only
copies left exposed, are short; large enough that a collective's fixed cost
per bucket stays small next to its transfer."""


class Fused(NamedTuple):
    """A fused collective in flight: the handles of its buckets that move
    bytes, and ``finish()``, which waits for them and writes the results back
    into the tensors it was started with (a synchronization point)."""

    handles: list[Handle]
    finish: Callable[[], None]


def fused_collective(tensors: Sequence[Any], *, engine: Any, name: str,
                     policy: ReducePolicy = NO_SCALING, hook: CommHook | None = None,
                     compression: str | Compressor = "none", root: int = 0,
                     names: Sequence[str] | None = None, device: str | None = None,
                     sources: Sequence[Any] | None = None) -> Fused:
    """Start one collective over ``tensors`` (numpy arrays or torch tensors,
    written in place), in buckets (module docstring); returns it in flight.

    ``hook`` moves each packed bucket (default: all-reduce with ``policy``'s
    op, compressed per ``compression``; ``hooks.broadcast_hook`` from
    ``root``, a rank of ``engine``); ``policy`` scales it (none by default).
    ``name`` names the collectives (``name.bucket<i>``) and ``names`` the
    tensors in messages (default ``name.<i>``). Buffers live on ``device``
    (default: each tensor's own); a tensor elsewhere is copied there and
    back. Collective over ``engine``'s ranks, which must agree on the
    request (checked by the caller).

    ``sources`` (one per tensor): out of place. The values are read from
    ``sources``, never written, and ``tensors`` are fresh outputs (they may
    be uninitialized). Each bucket copies its sources in as it starts
    (``Bucket.start``), so the copies overlap the wire as the unpacks do."""
    if names is None:
        names = [f"{name}.{i}" for i in range(len(tensors))]
    specs = []
    for n, t in zip(names, tensors, strict=True):
        shape, dtype, own = spec_of(t)
        specs.append(TensorSpec(n, shape, dtype, own if device is None else device))
    compressor = get_compressor(compression)
    hook = hook_for(compressor) if hook is None else hook
    state = HookState(engine, policy.engine_op, root)
    ops: Any = ops_for(tensors[0]) if tensors else None  # no tensors: no buckets
    started: list[Bucket] = []
    handles: list[Handle] = []
    for e in plan_buckets(specs, PIPELINE_CHUNK, order=range(len(specs)), alone_from=DIRECT_BYTES):
        bucket = Bucket(e, specs, f"{name}.bucket{e.index}",
                        wire_dtype=compressor.wire_dtype(e.dtype))
        if bucket.numel:  # an empty one moves nothing; every rank skips it alike (same plan)
            read = None if sources is None else [sources[i] for i in e.members]
            handles.append(bucket.start(ops, [tensors[i] for i in e.members], policy=policy,
                                        hook=hook, state=state, sources=read))
            started.append(bucket)

    def finish() -> None:
        for bucket in started:
            bucket.unpack()

    return Fused(handles, finish)

