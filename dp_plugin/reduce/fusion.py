"""Bucket planning: which tensors share a fusion buffer.

Pure functions of the registered tensors, no engine and no framework. Every
rank that registers the same tensors in the same order gets the same plan,
which is what lets the scheduler launch buckets in the same order everywhere.

Rules:
- walk the tensors in their expected ready order (default: reverse
  registration order, the order backward produces gradients);
- keep one open bucket per (dtype, device): a bucket never mixes them;
- close the open bucket before a tensor would push it past the threshold; a
  tensor larger than the threshold therefore gets a bucket of its own (plus
  any empty tensors that follow it);
- the first bucket of each (dtype, device) may have a smaller cap of its own
  (``first_threshold``, PyTorch DDP's 1 MiB first bucket): the gradients
  backward produces first then start travelling early instead of waiting
  for a whole large bucket;
- a gradient group (``groups``, Horovod's ``DistributedOptimizer(groups=...)``)
  is one bucket per (dtype, device) of its own, whatever its size, holding
  only the group's tensors; it takes its place in the bucket order where the
  walk meets the group's last tensor, the point the whole group is ready,
  and closes the open buckets there (a later tensor never holds it back);
- number buckets in the order they were opened.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import Any

from dp_plugin.reduce.arrays import spec_of
from dp_plugin.reduce.dtypes import SUPPORTED_DTYPES, canonical_dtype


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What the core knows of one registered tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tensor name must be a non-empty string, got {self.name!r}")
        try:
            shape = tuple(self.shape)
        except TypeError:
            raise ValueError(
                f"tensor {self.name!r}: shape must be a tuple of ints, got {self.shape!r}"
            ) from None
        for dim in shape:
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
                raise ValueError(
                    f"tensor {self.name!r}: shape {self.shape!r} must hold non-negative ints; "
                    f"bad dimension {dim!r}"
                )
        # Normalise a list shape or a torch dtype into the canonical forms, so
        # that equal tensors give equal specs (and equal layout fingerprints).
        object.__setattr__(self, "shape", shape)
        try:
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        except TypeError as exc:
            raise TypeError(f"tensor {self.name!r}: {exc}") from None
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(
                f"tensor {self.name!r}: device must be a non-empty string such as 'cpu' or "
                f"'cuda:0', got {self.device!r}"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * SUPPORTED_DTYPES[self.dtype]

    @classmethod
    def of(cls, name: str, tensor: Any) -> TensorSpec:
        """The spec of a numpy array or torch tensor."""
        return cls(name, *spec_of(tensor))

    def describe(self) -> str:
        return f"{self.name!r} shape {self.shape} {self.dtype} on {self.device}"


@dataclass(frozen=True, slots=True)
class PlanEntry:
    """One bucket of a plan: which tensors (by spec index) live where in its
    flat buffer (the ``Bucket`` of ``dp_plugin.reduce.bucket`` is built from it)."""

    index: int
    dtype: str
    device: str
    members: tuple[int, ...]
    """Spec indices, in the order they sit in the buffer."""
    offsets: tuple[int, ...]
    """Element offset of each member in the flat buffer."""
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * SUPPORTED_DTYPES[self.dtype]


def default_order(count: int) -> list[int]:
    """Reverse registration order: backward produces the last layer's gradients first."""
    return list(range(count - 1, -1, -1))


def plan_buckets(
    specs: Sequence[TensorSpec], threshold: int, order: Iterable[int] | None = None,
    first_threshold: int | None = None, alone_from: int | None = None,
    groups: Sequence[Sequence[int]] = (),
) -> list[PlanEntry]:
    """Group ``specs`` into buckets of at most ``threshold`` bytes.

    ``order`` is the expected ready order (spec indices, a permutation of
    ``range(len(specs))``); it defaults to reverse registration order.
    ``first_threshold`` caps the first bucket of each (dtype, device)
    instead (the smaller of the two applies; None: no separate cap).
    ``alone_from``: a tensor of at least this many bytes gets a bucket of its
    own (where it can be reduced in place, with no copy) without closing the
    open bucket, so the smaller tensors around it still fuse (a grouped
    collective, where every bucket starts at once; None: no such rule).
    ``groups``: lists of spec indices, each reduced as one all-reduce (a
    bucket per dtype and device, see the rules above); a tensor belongs to
    one group at most, and those in none are bucketed by size as usual.
    Deterministic: identical inputs give identical plans on every rank.
    """
    _check_threshold("fusion threshold", threshold)
    for what, cap in (("alone-from size", alone_from), ("first bucket threshold", first_threshold)):
        if cap is not None:
            _check_threshold(what, cap)
    first = threshold if first_threshold is None else min(first_threshold, threshold)
    _check_unique_names(specs)
    walk = default_order(len(specs)) if order is None else _check_permutation(order, len(specs))
    group_of = _check_groups(groups, len(specs))
    # Each group's members by kind, in walk order, and the member the walk meets last.
    grouped: dict[int, dict[tuple[str, str], list[int]]] = {}
    for i in walk:
        if i in group_of:
            key = (specs[i].dtype, specs[i].device)
            grouped.setdefault(group_of[i], {}).setdefault(key, []).append(i)
    last_of = {group_of[i]: i for i in walk if i in group_of}

    # Per (dtype, device): the open bucket's members and size in bytes.
    open_: dict[tuple[str, str], tuple[list[int] | None, int]] = {}
    opened: list[tuple[tuple[str, str], list[int]]] = []  # each bucket's kind and members
    count: Counter[tuple[str, str]] = Counter()  # buckets opened per kind so far
    for i in walk:
        spec = specs[i]
        key = (spec.dtype, spec.device)
        if i in group_of:
            if last_of[group_of[i]] == i:
                # Close the open buckets: no tensor after the group holds it back.
                open_.clear()
                opened.extend(grouped[group_of[i]].items())
            continue
        if alone_from is not None and spec.nbytes >= alone_from:
            opened.append((key, [i]))
            count[key] += 1
            continue
        members, size = open_.get(key, (None, 0))
        # The first bucket of this kind is still open while it is the only one.
        cap = first if count[key] == 1 else threshold
        # A new bucket if none is open or this tensor would push it past the
        # cap. (An empty tensor never does; it joins whatever bucket is open.)
        if members is None or (spec.nbytes and size + spec.nbytes > cap):
            members, size = [], 0
            opened.append((key, members))
            count[key] += 1
        members.append(i)
        open_[key] = (members, size + spec.nbytes)

    buckets = []
    for index, ((dtype, device), members) in enumerate(opened):
        ends = tuple(accumulate((specs[i].numel for i in members), initial=0))
        buckets.append(PlanEntry(index, dtype, device, tuple(members), ends[:-1], ends[-1]))
    return buckets


def even_groups(count: int, n: int) -> list[list[int]]:
    """``range(count)`` cut into ``n`` consecutive groups whose sizes differ by at
    most one, the larger first (Horovod's ``split_list`` for ``num_groups``);
    empty groups (``n > count``) are left out."""
    size, extra = divmod(count, n)
    bounds = [k * size + min(k, extra) for k in range(n + 1)]
    return [list(range(a, b)) for a, b in pairwise(bounds) if b > a]


def group_indices(groups: int | Sequence[Sequence[Any]] | None,
                  members: Sequence[Any]) -> list[list[int]]:
    """Horovod's ``groups`` as lists of indices into ``members`` (the tensors
    reduced, in order), as Horovod forms them: ``groups=N`` cuts ``members``
    into N groups of near-equal count (``even_groups``); listed objects are
    matched by identity, those not among ``members`` (no gradient) left out,
    and groups left empty dropped; None: no groups."""
    if groups is None:
        return []
    if isinstance(groups, int):
        return even_groups(len(members), groups)
    index = {id(m): i for i, m in enumerate(members)}
    found = ([index[id(m)] for m in group if id(m) in index] for group in groups)
    return [group for group in found if group]


def _check_groups(groups: Sequence[Sequence[int]], count: int) -> dict[int, int]:
    """Spec index -> its group's position in ``groups``, once they are checked."""
    group_of: dict[int, int] = {}
    for g, group in enumerate(groups):
        for i in group:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count:
                raise ValueError(
                    f"groups[{g}] holds {i!r}, which is not a spec index; expected ints in "
                    f"range({count})"
                )
            if i in group_of:
                raise ValueError(
                    f"tensor {i} is in groups[{group_of[i]}] and groups[{g}]; a tensor can "
                    "belong to one group only"
                )
            group_of[i] = g
    return group_of


def _check_threshold(what: str, threshold: object) -> None:
    if isinstance(threshold, bool) or not isinstance(threshold, int):
        raise ValueError(f"{what} must be an int number of bytes, got {threshold!r}")
    if threshold <= 0:
        raise ValueError(
            f"{what} must be > 0 bytes, got {threshold}; use e.g. 26214400 (25 MiB), "
            "or 1 for one tensor per bucket"
        )


def checked_specs(specs: Sequence[Any]) -> tuple[TensorSpec, ...]:
    """``specs`` as a tuple; a ``TypeError`` names the first that is not a ``TensorSpec``."""
    for i, spec in enumerate(specs):
        if not isinstance(spec, TensorSpec):
            raise TypeError(
                f"specs[{i}] must be a dp_plugin.reduce.fusion.TensorSpec, got "
                f"{type(spec).__name__}; build them with TensorSpec.of(name, tensor)"
            )
    return tuple(specs)


def _check_unique_names(specs: Sequence[TensorSpec]) -> None:
    seen: dict[str, int] = {}
    for i, spec in enumerate(checked_specs(specs)):
        if spec.name in seen:
            raise ValueError(
                f"tensor name {spec.name!r} is registered twice (positions {seen[spec.name]} "
                f"and {i}); give every tensor a unique name (e.g. from named_parameters())"
            )
        seen[spec.name] = i


def _check_permutation(order: Iterable[int], count: int) -> list[int]:
    walk = list(order)
    bad = [i for i in walk if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count]
    if bad:
        raise ValueError(
            f"bucket order holds {bad[:5]!r}, which are not spec indices; expected a "
            f"permutation of range({count})"
        )
    if len(walk) != count or len(set(walk)) != count:
        missing = sorted(set(range(count)) - set(walk))
        repeated = sorted(i for i, n in Counter(walk).items() if n > 1)
        raise ValueError(
            f"bucket order is not a permutation of range({count}): it has {len(walk)} entries, "
            f"missing {missing[:10]}, repeated {repeated[:10]}; list every tensor index "
            "exactly once"
        )
    return walk
