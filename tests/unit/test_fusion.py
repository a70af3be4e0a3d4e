"""Bucket planning: pure functions, no engine."""

from __future__ import annotations

import numpy as np
import pytest

from dp_plugin.reduce.fusion import (
    PlanEntry,
    TensorSpec,
    default_order,
    even_groups,
    group_indices,
    plan_buckets,
)


def f32(name: str, *shape: int, device: str = "cpu") -> TensorSpec:
    return TensorSpec(name, tuple(shape), "float32", device)


def members(plan: list[PlanEntry]) -> list[tuple[int, ...]]:
    return [b.members for b in plan]


# -- TensorSpec ------------------------------------------------------------

def test_spec_canonicalises_and_measures() -> None:
    spec = TensorSpec("w", [3, 4], "torch.float64")  # type: ignore[arg-type]
    assert spec.shape == (3, 4)
    assert spec.dtype == "float64"
    assert (spec.numel, spec.nbytes) == (12, 96)
    assert TensorSpec("s", (), "float16").numel == 1
    assert TensorSpec("e", (0, 5), "int8").nbytes == 0


def test_spec_of_numpy_and_torch() -> None:
    assert TensorSpec.of("a", np.zeros((2, 3), np.int32)) == TensorSpec("a", (2, 3), "int32")
    torch = pytest.importorskip("torch")
    spec = TensorSpec.of("b", torch.zeros(4, dtype=torch.bfloat16))
    assert spec == TensorSpec("b", (4,), "bfloat16", "cpu")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dtype": "complex64"}, TypeError, r"'w'.*complex64.*supported dtypes"),
        ({"dtype": "bool"}, TypeError, r"bool.*Cast the tensor"),
        ({"shape": (2, -1)}, ValueError, r"'w'.*non-negative ints.*-1"),
        ({"shape": (2.0,)}, ValueError, r"non-negative ints"),
        ({"shape": 5}, ValueError, r"tuple of ints"),
        ({"name": ""}, ValueError, r"non-empty string"),
        ({"device": ""}, ValueError, r"device"),
    ],
)
def test_spec_rejects_bad_input(kwargs: dict, error: type, match: str) -> None:
    args = {"name": "w", "shape": (2,), "dtype": "float32"} | kwargs
    with pytest.raises(error, match=match):
        TensorSpec(**args)


# -- plan_buckets ----------------------------------------------------------

def test_default_is_reverse_registration_order() -> None:
    specs = [f32(f"t{i}", 1) for i in range(4)]
    assert default_order(4) == [3, 2, 1, 0]
    assert members(plan_buckets(specs, 1 << 20)) == [(3, 2, 1, 0)]


def test_threshold_splits_and_offsets() -> None:
    specs = [f32("a", 2), f32("b", 3), f32("c", 1), f32("d", 4)]  # 8, 12, 4, 16 bytes
    plan = plan_buckets(specs, 24, order=[0, 1, 2, 3])
    assert members(plan) == [(0, 1, 2), (3,)]
    assert plan[0].offsets == (0, 2, 5)
    assert (plan[0].numel, plan[0].nbytes) == (6, 24)  # exactly the threshold fits
    assert plan[1] == PlanEntry(1, "float32", "cpu", (3,), (0,), 4)


def test_tensor_larger_than_threshold_gets_its_own_bucket() -> None:
    specs = [f32("small", 1), f32("big", 100), f32("small2", 1)]
    plan = plan_buckets(specs, 16, order=[0, 1, 2])
    assert members(plan) == [(0,), (1,), (2,)]
    assert plan[1].nbytes == 400


def test_threshold_smaller_than_every_tensor() -> None:
    specs = [f32(f"t{i}", 3) for i in range(5)]
    plan = plan_buckets(specs, 1)
    assert members(plan) == [(4,), (3,), (2,), (1,), (0,)]
    assert [b.index for b in plan] == list(range(5))


def test_never_mixes_dtype_or_device() -> None:
    specs = [
        f32("a", 2),
        TensorSpec("b", (2,), "float16"),
        f32("c", 2, device="cuda:0"),
        f32("d", 2),
        TensorSpec("e", (2,), "float16"),
        TensorSpec("f", (2,), "int64"),
    ]
    plan = plan_buckets(specs, 1 << 20, order=range(6))
    assert members(plan) == [(0, 3), (1, 4), (2,), (5,)]
    assert [(b.dtype, b.device) for b in plan] == [
        ("float32", "cpu"), ("float16", "cpu"), ("float32", "cuda:0"), ("int64", "cpu")
    ]


def test_index_is_opening_order_with_interleaved_kinds() -> None:
    # float32 bucket 0 opens first but closes after the float16 one is complete.
    specs = [f32("a", 4), TensorSpec("h", (1,), "float16"), f32("b", 4), f32("c", 4)]
    plan = plan_buckets(specs, 32, order=[0, 1, 2, 3])
    assert members(plan) == [(0, 2), (1,), (3,)]
    assert [b.index for b in plan] == [0, 1, 2]


def test_empty_and_zero_dim_tensors() -> None:
    specs = [f32("empty", 0), f32("scalar"), f32("v", 3), f32("empty2", 2, 0)]
    plan = plan_buckets(specs, 4, order=[0, 1, 2, 3])
    # 0 bytes always fits; the scalar fills the 4-byte bucket; v needs its own.
    assert members(plan) == [(0, 1), (2, 3)]
    assert plan[0].offsets == (0, 0) and plan[0].numel == 1
    assert plan[1].offsets == (0, 3) and plan[1].numel == 3
    assert plan_buckets([], 10) == []
    only_empty = plan_buckets([f32("e", 0)], 10)
    assert only_empty[0].numel == 0 and only_empty[0].nbytes == 0


def test_plan_is_deterministic() -> None:
    rng = np.random.default_rng(0)
    dtypes = ["float32", "float16", "int32", "float64"]
    specs = [
        TensorSpec(f"p{i}", tuple(int(d) for d in rng.integers(0, 7, size=i % 3)),
                   dtypes[i % 4])
        for i in range(40)
    ]
    order = [int(i) for i in rng.permutation(40)]
    assert plan_buckets(specs, 64, order) == plan_buckets(list(specs), 64, list(order))
    # Every tensor appears exactly once; a bucket exceeds the threshold only
    # when one tensor alone does (empty tensors may join it).
    plan = plan_buckets(specs, 64, order)
    assert sorted(i for b in plan for i in b.members) == list(range(40))
    for b in plan:
        assert b.nbytes <= 64 or sum(specs[i].numel > 0 for i in b.members) == 1
        assert {specs[i].dtype for i in b.members} == {b.dtype}


@pytest.mark.parametrize("threshold", [0, -5])
def test_threshold_must_be_positive(threshold: int) -> None:
    with pytest.raises(ValueError, match=rf"threshold must be > 0 bytes, got {threshold}"):
        plan_buckets([f32("a", 1)], threshold)


def test_threshold_must_be_int() -> None:
    with pytest.raises(ValueError, match=r"int number of bytes, got 1.5"):
        plan_buckets([f32("a", 1)], 1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("order", "match"),
    [
        ([0, 1], r"not a permutation of range\(3\).*missing \[2\]"),
        ([0, 1, 1], r"missing \[2\], repeated \[1\]"),
        ([0, 1, 2, 0], r"4 entries"),
        ([0, 1, 3], r"\[3\].*not spec indices"),
        ([0, 1, -1], r"\[-1\].*not spec indices"),
    ],
)
def test_order_must_be_a_permutation(order: list[int], match: str) -> None:
    specs = [f32(f"t{i}", 1) for i in range(3)]
    with pytest.raises(ValueError, match=match):
        plan_buckets(specs, 100, order)


def test_duplicate_names_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"'w' is registered twice \(positions 0 and 2\)"):
        plan_buckets([f32("w", 1), f32("b", 1), f32("w", 2)], 100)


def test_specs_must_be_tensor_specs() -> None:
    with pytest.raises(TypeError, match=r"specs\[0\] must be a dp_plugin.reduce.fusion.TensorSpec"):
        plan_buckets([("w", (1,), "float32")], 100)  # type: ignore[list-item]


def test_first_bucket_has_a_cap_of_its_own_per_kind() -> None:
    # Reverse registration order: 5, 4, 3, 2, 1, 0 (4 float32 elements = 16 bytes each).
    specs = [TensorSpec(f"w{i}", (4,), "float32") for i in range(6)]
    plan = plan_buckets(specs, 48, first_threshold=16)
    assert [b.members for b in plan] == [(5,), (4, 3, 2), (1, 0)]
    # Per (dtype, device): each kind's first bucket is small.
    mixed = specs + [TensorSpec(f"d{i}", (2,), "float64") for i in range(3)]
    plan = plan_buckets(mixed, 48, first_threshold=16)
    assert [b.members for b in plan] == [(8,), (7, 6), (5,), (4, 3, 2), (1, 0)]
    # The smaller of the two caps applies; None means no separate cap.
    assert plan_buckets(specs, 16, first_threshold=48) == plan_buckets(specs, 16)
    assert plan_buckets(specs, 48, first_threshold=None) == plan_buckets(specs, 48)
    # It follows the ready order it is given (the rebuilt plan keeps it).
    plan = plan_buckets(specs, 48, order=[0, 1, 2, 3, 4, 5], first_threshold=16)
    assert [b.members for b in plan] == [(0,), (1, 2, 3), (4, 5)]


@pytest.mark.parametrize("first", [0, -1, 1.5, True])
def test_first_threshold_must_be_a_positive_int(first: object) -> None:
    specs = [TensorSpec("w", (4,), "float32")]
    with pytest.raises(ValueError, match=f"first bucket threshold .*{first!r}"):
        plan_buckets(specs, 48, first_threshold=first)  # type: ignore[arg-type]


# -- gradient groups (Horovod's DistributedOptimizer(groups=...)) -----------

def test_a_group_is_one_bucket_placed_where_it_is_ready() -> None:
    specs = [f32(f"t{i}", 4) for i in range(6)]  # 16 bytes each
    # Walk 5..0; the group {4, 1} is ready at 1; the open bucket closes there.
    plan = plan_buckets(specs, 32, groups=[[1, 4]])
    assert members(plan) == [(5, 3), (2,), (4, 1), (0,)]
    assert plan[2].offsets == (0, 4)  # in walk order, whatever order the group lists
    # A group over the threshold is still one bucket.
    assert members(plan_buckets(specs, 16, groups=[[0, 1, 2, 3, 4, 5]])) == [(5, 4, 3, 2, 1, 0)]


def test_groups_follow_the_ready_order_and_split_by_kind() -> None:
    specs = [f32("a", 1), TensorSpec("b", (1,), "float16"), f32("c", 1), f32("d", 1)]
    plan = plan_buckets(specs, 1 << 20, order=[0, 1, 2, 3], groups=[[0, 1, 2]])
    assert members(plan) == [(0, 2), (1,), (3,)]
    assert [b.dtype for b in plan] == ["float32", "float16", "float32"]
    # The same groups in another ready order: the group moves, not its members' fate.
    assert members(plan_buckets(specs, 1 << 20, order=[3, 2, 1, 0], groups=[[0, 1, 2]])) \
        == [(3,), (2, 0), (1,)]


def test_ungrouped_plan_is_unchanged_and_first_cap_skips_groups() -> None:
    specs = [f32(f"t{i}", 4) for i in range(5)]
    assert plan_buckets(specs, 32, groups=[]) == plan_buckets(specs, 32)
    # The group is not the first bucket of its kind: the first cap applies to t3.
    plan = plan_buckets(specs, 64, first_threshold=16, groups=[[4]])
    assert members(plan) == [(4,), (3,), (2, 1, 0)]


@pytest.mark.parametrize(("groups", "match"), [
    ([[0, 7]], r"groups\[0\] holds 7, which is not a spec index"),
    ([[0], [1, 0]], r"tensor 0 is in groups\[0\] and groups\[1\]"),
    ([[True]], "not a spec index"),
])
def test_bad_groups_are_refused(groups: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_buckets([f32("a", 1), f32("b", 1)], 16, groups=groups)


@pytest.mark.parametrize(("count", "n", "expected"), [
    (5, 2, [[0, 1, 2], [3, 4]]),
    (6, 3, [[0, 1], [2, 3], [4, 5]]),
    (2, 4, [[0], [1]]),  # more groups than tensors: the empty ones are left out
    (3, 1, [[0, 1, 2]]),
])
def test_even_groups_cut_like_horovods_split_list(count: int, n: int,
                                                  expected: list[list[int]]) -> None:
    assert even_groups(count, n) == expected


def test_group_indices_resolve_horovods_groups_argument() -> None:
    a, b, c, frozen = object(), object(), object(), object()
    assert group_indices(None, [a, b, c]) == []
    assert group_indices(2, [a, b, c]) == [[0, 1], [2]]
    # By identity; a member not reduced (no gradient) is left out, an empty group dropped.
    assert group_indices([[c, frozen, a], [frozen]], [a, b, c]) == [[2, 0]]
