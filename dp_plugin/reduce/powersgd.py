"""PowerSGD (Vogels et al., 2019): its settings, which gradients it compresses, what it moves.

PowerSGD replaces the all-reduce of a gradient matrix ``M`` (``n x m``) by
two all-reduces of thin matrices: ``P = M Q`` (``n x r``) and, once ``P`` is
summed and orthogonalized, ``Q = M^T P`` (``m x r``); every rank then holds
``P Q^T``, a rank-``r`` approximation of the summed gradient. What the
approximation leaves out is kept by each rank (error feedback) and added to
its next gradient, so nothing is lost, only delayed. ``Q`` starts from the
same seeded random matrix on every rank and is reused, step to step, as the
start of the next power iteration (warm start).

This module is the framework-free part, shared by the torch hook
(``dp_plugin.torch.powersgd``) and ``dp-plugin plan``:

- ``PowerSGDSettings``: the user's choices, validated once;
- ``matrix_of``: which tensors are compressed, and as which matrix. A
  tensor of shape ``(d0, d1, ...)`` is the matrix ``d0 x (d1 * ...)``
  (torch's rule: a convolution's output channels are the rows). It is
  compressed when it has two dimensions or more and its ``(n + m) * r``
  elements are fewer than ``1 / min_compression_rate`` of its ``n * m``; the
  others (biases, norms, small matrices) travel whole, batched with ``P``;
- ``wire_numel``: the elements one step moves, the formula the plan and the
  benchmark check the link against.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from dp_plugin.validate import check_int, check_positive_float, is_int

Shape = Sequence[int]

DEFAULT_RANK = 8
"""Rank 8: the smallest rank whose BERT example loss after 300 steps stayed
within 2% of the uncompressed run's (rank 4: 2.7% above; BENCHMARKS.md,
"PowerSGD"). Vogels et al. reach full-precision accuracy at rank 2-4 on
their image and language models."""

DEFAULT_START_ITER = 10
"""Plain all-reduces for the first 10 steps: the first gradients are large
and change fast, where a low-rank approximation (and the error it carries
over) hurts most; torch's hook leaves it to the user (its default, 1000, is
tuned for long runs)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PowerSGDSettings:
    """How PowerSGD compresses (every rank must use the same)."""

    rank: int = DEFAULT_RANK
    """Columns of ``P`` and ``Q``: the approximation's rank (at most the
    matrix's smaller side). Higher: closer to the exact average, more bytes."""
    start_iter: int = DEFAULT_START_ITER
    """Steps reduced exactly (plain all-reduce) before compression starts."""
    min_compression_rate: float = 2.0
    """A matrix is compressed only when its wire form is this many times
    smaller than itself (torch's rule and default)."""
    seed: int = 0
    """Seed of the first ``Q`` (the same on every rank)."""
    epsilon: float = 1e-8
    """Added to each column's norm when orthogonalizing, so an all-zero
    gradient (a frozen layer, a joined rank's step) gives zeros, not NaN."""

    def __post_init__(self) -> None:
        where = "PowerSGD"
        check_int("rank", self.rank, minimum=1, where=where,
                  fix=f"the default is {DEFAULT_RANK}; 1 compresses the most")
        check_int("start_iter", self.start_iter, minimum=0, where=where,
                  fix="the number of steps reduced exactly before compression starts "
                      f"(default {DEFAULT_START_ITER})")
        rate = check_positive_float("min_compression_rate", self.min_compression_rate,
                                    where=where, fix="e.g. 2.0 (torch's default)")
        if rate < 1.0:
            raise ValueError(f"{where}: min_compression_rate must be >= 1.0, got {rate!r}; a "
                             "matrix is compressed only when that makes it smaller")
        if not is_int(self.seed):
            raise ValueError(f"{where}: seed must be an int, got {self.seed!r}")
        check_positive_float("epsilon", self.epsilon, where=where, fix="e.g. 1e-8")

    def describe(self) -> str:
        """The settings every rank must share (compared across ranks)."""
        return (f"PowerSGD(rank={self.rank}, start_iter={self.start_iter}, "
                f"min_compression_rate={self.min_compression_rate:g}, seed={self.seed})")


def matrix_of(shape: Shape, settings: PowerSGDSettings) -> tuple[int, int, int] | None:
    """``(n, m, r)`` when a tensor of ``shape`` is compressed as an ``n x m``
    matrix at rank ``r``; None when it travels whole."""
    if len(shape) < 2:
        return None
    n = int(shape[0])
    m = math.prod(int(d) for d in shape[1:])
    r = min(n, m, settings.rank)
    if r == 0 or (n + m) * r * settings.min_compression_rate >= n * m:
        return None
    return n, m, r


def _matrices(shapes: Iterable[Shape], settings: PowerSGDSettings
              ) -> Iterator[tuple[int, tuple[int, int, int] | None]]:
    """Each tensor's element count and ``matrix_of``."""
    for shape in shapes:
        yield math.prod(int(d) for d in shape), matrix_of(shape, settings)


@dataclass(frozen=True, slots=True)
class WireNumel:
    """Elements one compressed step moves, per all-reduce."""

    p: int
    """``P``'s elements, summed over the compressed matrices (``n * r``)."""
    q: int
    """``Q``'s elements (``m * r``)."""
    whole: int
    """Elements of the tensors that travel uncompressed."""
    dense: int
    """Elements of every tensor: what a plain all-reduce moves."""

    @property
    def total(self) -> int:
        """``sum((n + m) * r) + whole``: the formula."""
        return self.p + self.q + self.whole

    @property
    def ratio(self) -> float:
        """How many times fewer elements than a plain all-reduce."""
        return self.dense / self.total if self.total else 1.0


def wire_numel(shapes: Iterable[Shape], settings: PowerSGDSettings) -> WireNumel:
    """What PowerSGD moves per step for tensors of ``shapes`` (one all-reduce
    of ``p + whole`` elements, then one of ``q``, per bucket)."""
    p = q = whole = dense = 0
    for numel, found in _matrices(shapes, settings):
        dense += numel
        if found is None:
            whole += numel
        else:
            n, m, r = found
            p += n * r
            q += m * r
    return WireNumel(p, q, whole, dense)


def flops(shapes: Iterable[Shape], settings: PowerSGDSettings) -> int:
    """Floating-point operations of one compressed step's matrix products
    (``P = M Q``, ``Q = M^T P``, ``P Q^T``: ``2 n m r`` each)."""
    found = (matrix_of(shape, settings) for shape in shapes)
    return sum(6 * n * m * r for n, m, r in filter(None, found))


PASSES = 11
"""Passes over each compressed matrix per step, counted in elements read or
written: adding the error (3), keeping ``M`` as the next error (2), ``M Q``
(1), ``P^T M`` (1), writing ``P Q^T`` (1), subtracting it from the error
(3). At small ranks these passes, not the multiply-adds, take the time: 11
passes of 4 bytes against ``6 r`` flops per element."""

WHOLE_PASSES = 4
"""Passes over each uncompressed element per step: copied into the wire
buffer beside ``P`` (read, write) and back once that all-reduce is done."""


def touched_bytes(shapes: Iterable[Shape], settings: PowerSGDSettings, itemsize: int = 4) -> int:
    """Bytes one compressed step reads and writes: ``PASSES`` times each
    compressed matrix's ``n * m`` elements and ``WHOLE_PASSES`` times each
    uncompressed tensor's."""
    return itemsize * sum(WHOLE_PASSES * numel if found is None else PASSES * numel
                          for numel, found in _matrices(shapes, settings))
