"""Alpha-beta model of ring all-reduce with bucketed overlap (``dp-plugin plan``).

A link has a per-message latency ``alpha`` (s) and a bandwidth ``beta``
(bytes/s). A ring all-reduce of ``S`` bytes on ``n`` workers takes
``2 (n - 1)`` steps, each sending ``S / n`` bytes::

    T(S, n) = 2 (n - 1) alpha + 2 (n - 1) / n * S / beta

A training step is modelled as forward, then backward, during which the
gradients become ready in reverse definition order, evenly spaced in time
(one tensor per equal slice of backward; ``ready_by="bytes"`` spaces them
by size instead). Gradients are packed into buckets of at most ``threshold``
bytes in ready order (a larger tensor forms a bucket of its own; the first
bucket at most ``first_threshold``), by dp_plugin's own planner
(``dp_plugin.reduce.fusion.plan_buckets``); a bucket
starts when its last gradient is ready and the previous bucket is done (one
all-reduce at a time, as in Horovod and dp_plugin). The step ends when both
compute and the last all-reduce are done. Scaling efficiency is the
single-worker step (compute only) over the step at ``n`` workers
(weak scaling, fixed per-worker batch).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from dp_plugin.cli.bandwidth import bus_factor
from dp_plugin.reduce.fusion import TensorSpec, plan_buckets
from dp_plugin.reduce.powersgd import PowerSGDSettings, touched_bytes, wire_numel
from dp_plugin.reduce.powersgd import flops as powersgd_flops

MiB = 2**20


@dataclass(frozen=True)
class Link:
    alpha: float
    """Latency per ring step, seconds."""
    beta: float
    """Bandwidth, bytes/s."""

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta <= 0:
            raise ValueError(f"a link needs alpha >= 0 s and beta > 0 bytes/s, got "
                             f"alpha={self.alpha!r}, beta={self.beta!r}")


def ring_allreduce_time(nbytes: float, n: int, link: Link) -> float:
    """``2 (n - 1) alpha + 2 (n - 1) / n * S / beta``; 0 for one worker."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.alpha + bus_factor(n) * nbytes / link.beta


PIECE_BYTES = 4 * MiB
"""The pipelined hierarchical all-reduce's piece (``engines/hierarchical.py``)."""


def hierarchical_allreduce_time(nbytes: float, hosts: int, per_host: int, link: Link,
                                 local: Link, piece: float | None = PIECE_BYTES) -> float:
    """Reduce inside each host over ``local`` (shared memory: a reduce-scatter
    and an all-gather among the ``per_host`` ranks, priced as a ring
    all-reduce over ``local``: the memory traffic of both steps), and across
    hosts over ``link``: every local rank all-reduces its ``1/per_host`` shard
    with its peers, the ``per_host`` rings sharing the host's link, so the
    link carries ``2 (hosts - 1) / hosts x S`` instead of the flat ring's
    ``2 (n - 1) / n x S``.

    Pipelined in pieces of ``piece`` bytes (the engine's way), the two run
    at once: the slower sets the pace and the faster shows only for one
    piece, the first reduce-scatter or the last all-gather (fill and
    drain): ``max(inside, cross) + min(inside, cross) / pieces``.
    ``piece=None``: one after the other, ``inside + cross``."""
    inside = ring_allreduce_time(nbytes, per_host, local)
    cross = ring_allreduce_time(nbytes, hosts, link)
    if piece is None:
        return inside + cross
    pieces = max(1, -(-int(nbytes) // int(piece)))
    return max(inside, cross) + min(inside, cross) / pieces


def allreduce_time(nbytes: float, n: int, link: Link, per_host: int = 1,
                   local: Link | None = None) -> float:
    """One all-reduce at ``n`` workers, ``per_host`` on each host: the flat ring
    (its ``per_host`` ranks of a host add no link traffic: the ring crosses
    each host's link once per step each way), or hierarchical when ``local``
    (the hosts' shared-memory link) is given and ``per_host > 1``."""
    if local is None or per_host <= 1:
        return ring_allreduce_time(nbytes, n, link)
    return hierarchical_allreduce_time(nbytes, max(1, n // per_host), per_host, link, local)


def fit_link(points: Sequence[tuple[float, float]], n: int) -> Link:
    """A link from a sweep at ``n`` workers: ``[(bytes, seconds), ...]``.

    beta is the best bus bandwidth of the sweep (reached by the large sizes),
    alpha what remains of the smallest size's time once its bytes are paid,
    split over the ring's ``2 (n - 1)`` steps.
    """
    if n < 2 or not points:
        raise ValueError(f"fitting a link needs a sweep at 2 or more workers, got n={n} "
                         f"and {len(points)} point(s)")
    beta = max(bus_factor(n) * s / t for s, t in points)
    small_s, small_t = min(points)
    alpha = max(0.0, small_t - bus_factor(n) * small_s / beta) / (2 * (n - 1))
    return Link(alpha=alpha, beta=beta)


def buckets(sizes: Sequence[int], threshold: int,
            first_threshold: int | None = None) -> list[tuple[int, int]]:
    """dp_plugin's buckets over ``sizes`` (gradient bytes, in ready
    order): ``[(last index, bytes), ...]``."""
    specs = [TensorSpec(str(i), (size,), "uint8") for i, size in enumerate(sizes)]
    plan = plan_buckets(specs, threshold, order=range(len(specs)),
                        first_threshold=first_threshold)
    return [(b.members[-1], b.nbytes) for b in plan]


@dataclass(frozen=True)
class Prediction:
    workers: int
    threshold: int
    buckets: int
    compute_s: float
    comm_s: float
    """Sum of all-reduce times."""
    step_s: float

    @property
    def exposed_s(self) -> float:
        return self.step_s - self.compute_s

    @property
    def efficiency(self) -> float:
        return self.compute_s / self.step_s


def ready_times(sizes: Sequence[int], backward_s: float, ready_by: str) -> list[float]:
    """Ready time of each gradient (ready order) from the start of backward."""
    if ready_by == "tensors":
        return [backward_s * (i + 1) / len(sizes) for i in range(len(sizes))]
    if ready_by == "bytes":
        total = sum(sizes)
        return [backward_s * seen / total for seen in itertools.accumulate(sizes)]
    raise ValueError(f"ready_by must be 'tensors' or 'bytes', got {ready_by!r}")


def predict(sizes: Sequence[int], compute_s: float, n: int, link: Link, threshold: int,
            backward_fraction: float = 2 / 3, ready_by: str = "tensors",
            per_host: int = 1, local: Link | None = None,
            first_threshold: int | None = None) -> Prediction:
    """Step time at ``n`` workers; ``sizes`` are gradient bytes in definition order;
    ``per_host`` and ``local`` as in ``allreduce_time``; ``first_threshold``
    caps the first bucket (None: ``threshold`` as every other)."""
    if not sizes or compute_s <= 0 or not 0 < backward_fraction <= 1 or threshold < 1:
        raise ValueError(f"need gradients, compute > 0 s, 0 < backward fraction <= 1 and "
                         f"threshold >= 1 byte; got {len(sizes)} gradients, compute "
                         f"{compute_s!r} s, fraction {backward_fraction!r}, threshold "
                         f"{threshold!r}")
    order = list(reversed(sizes))
    backward = compute_s * backward_fraction
    start_backward = compute_s - backward
    ready = ready_times(order, backward, ready_by)
    plan = buckets(order, threshold, first_threshold)
    end = comm = 0.0
    for last, nbytes in plan:
        t = allreduce_time(nbytes, n, link, per_host, local)
        end = max(end, start_backward + ready[last]) + t
        comm += t
    return Prediction(workers=n, threshold=threshold, buckets=len(plan), compute_s=compute_s,
                      comm_s=comm, step_s=max(compute_s, end))


CANDIDATE_THRESHOLDS = tuple(2**k * MiB // 4 for k in range(12))
"""256 KiB to 512 MiB, doubling."""


def best_threshold(sizes: Sequence[int], compute_s: float, n: int, link: Link,
                   backward_fraction: float = 2 / 3, ready_by: str = "tensors",
                   per_host: int = 1, local: Link | None = None) -> Prediction:
    """The candidate threshold with the shortest step; on a tie (within 0.5%), the
    largest: fewer buckets cost less in practice than the model counts."""
    preds = [predict(sizes, compute_s, n, link, t, backward_fraction, ready_by, per_host, local)
             for t in CANDIDATE_THRESHOLDS]
    fastest = min(p.step_s for p in preds)
    return max((p for p in preds if p.step_s <= fastest * 1.005), key=lambda p: p.threshold)


UNPACK_PASSES = 2
"""Passes over every element of a bucket that a comm hook reduced: the
unpack multiplies the sum by ``1 / size`` (read, write; ``Bucket.unpack``),
which the engine folds into its reduction only for the default hook."""


def predict_powersgd(shapes: Sequence[Sequence[int]], compute_s: float, n: int, link: Link,
                     threshold: int, settings: PowerSGDSettings, flops_per_s: float,
                     bytes_per_s: float, backward_fraction: float = 2 / 3,
                     ready_by: str = "tensors", first_threshold: int | None = None,
                     per_host: int = 1, local: Link | None = None) -> Prediction:
    """``predict`` for float32 gradients of ``shapes`` (definition order)
    reduced by PowerSGD (``dp_plugin.reduce.powersgd``) on the same buckets
    (``per_host`` and ``local`` as in ``allreduce_time``).

    Each bucket costs one all-reduce of its ``P`` s and uncompressed
    members, then, once that is back, one of its ``Q`` s, and its work on
    the rank: the matrix products at ``flops_per_s`` or the passes over its
    elements at ``bytes_per_s`` (``touched_bytes``, and the unpack's
    ``UNPACK_PASSES``), whichever is longer. A bucket with nothing to
    compress: one plain all-reduce and the unpack.

    The work runs on the rank's own device, where backward runs (a CPU
    rank: backward's thread; a GPU: the stream backward's kernels are on),
    so it does not overlap backward as the wire does: each bucket's work
    also delays every gradient after it, and the step is at least compute
    plus all the work."""
    if flops_per_s <= 0 or bytes_per_s <= 0:
        raise ValueError(f"flops_per_s and bytes_per_s must be > 0, got {flops_per_s!r} and "
                         f"{bytes_per_s!r}")
    order = list(reversed([tuple(s) for s in shapes]))
    sizes = [4 * math.prod(s) for s in order]
    backward = compute_s * backward_fraction
    start_backward = compute_s - backward
    ready = ready_times(sizes, backward, ready_by)
    plan = buckets(sizes, threshold, first_threshold)
    end = comm = shift = 0.0
    first = 0
    for last, nbytes in plan:
        members = order[first:last + 1]
        first = last + 1
        wire = wire_numel(members, settings)
        touched = UNPACK_PASSES * nbytes
        if wire.p == 0:
            t = allreduce_time(4 * wire.whole, n, link, per_host, local)
        else:
            t = (allreduce_time(4 * (wire.whole + wire.p), n, link, per_host, local)
                 + allreduce_time(4 * wire.q, n, link, per_host, local))
            touched += touched_bytes(members, settings)
        work = max(powersgd_flops(members, settings) / flops_per_s, touched / bytes_per_s)
        end = max(end, start_backward + ready[last] + shift) + t + work
        shift += work
        comm += t + work
    return Prediction(workers=n, threshold=threshold, buckets=len(plan), compute_s=compute_s,
                      comm_s=comm, step_s=max(compute_s + shift, end))
