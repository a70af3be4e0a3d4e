"""The sharded optimizer state's plan (``dp_plugin.reduce.sharding``), without processes."""

from __future__ import annotations

import random

import pytest

from dp_plugin.config import Config
from dp_plugin.engines.base import reducescatter_counts
from dp_plugin.reduce.fusion import TensorSpec, plan_buckets
from dp_plugin.reduce.sharding import gather_rows, shard_bounds, shard_pieces


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("seed", range(4))
def test_every_element_is_owned_by_exactly_one_rank(size: int, seed: int) -> None:
    rng = random.Random(seed)
    shapes = [(rng.randint(1, 9), rng.randint(1, 7)) for _ in range(rng.randint(1, 12))]
    specs = [TensorSpec(f"t{i}", s, "float32", "cpu") for i, s in enumerate(shapes)]
    plan = plan_buckets(specs, rng.choice([16, 64, 400, 1 << 20]))
    sizes = [s.numel for s in specs]
    owned: dict[int, list[int]] = {i: [0] * n for i, n in enumerate(sizes)}
    for rank in range(size):
        pieces = shard_pieces(plan, sizes, rank, size)
        for b in plan:  # a rank's pieces of a bucket tile its range, in order
            lo, hi = shard_bounds(b.numel, rank, size)
            mine = [pc for pc in pieces if pc.bucket == b.index]
            assert [pc.offset for pc in mine] == sorted(pc.offset for pc in mine)
            assert sum(pc.numel for pc in mine) == hi - lo
            assert all(lo <= pc.offset and pc.offset + pc.numel <= hi for pc in mine)
        for pc in pieces:
            for e in range(pc.start, pc.stop):
                owned[pc.index][e] += 1
    assert all(count == 1 for counts in owned.values() for count in counts)


def test_ranges_are_the_engines_reducescatter_split() -> None:
    """Rank r's range is what ``Engine.reducescatter`` gives rank r (Horovod's
    rule: the first ``numel % size`` ranks one element more)."""
    assert [shard_bounds(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [shard_bounds(2, r, 3) for r in range(3)] == [(0, 1), (1, 2), (2, 2)]
    plan = plan_buckets([TensorSpec("w", (10,), "float32", "cpu")], 1 << 20)
    assert gather_rows(plan[0], 3) == reducescatter_counts(10, 3) == [4, 3, 3]


def test_a_piece_maps_bucket_offsets_to_tensor_elements() -> None:
    """A range that ends inside a tensor: rank 0 owns all of "a" and the first
    element of "b", rank 1 the rest of "b" (from its element 1, at offset 5)."""
    specs = [TensorSpec("a", (4,), "float32", "cpu"), TensorSpec("b", (6,), "float32", "cpu")]
    plan = plan_buckets(specs, 1 << 20, order=[0, 1])
    assert plan[0].offsets == (0, 4)
    as_tuples = [[(p.index, p.start, p.stop, p.offset) for p in shard_pieces(plan, [4, 6], r, 2)]
                 for r in range(2)]
    assert as_tuples == [[(0, 0, 4, 0), (1, 0, 1, 4)], [(1, 1, 6, 5)]]


def test_environment_variable() -> None:
    assert Config.from_env({}).shard_optimizer_state is False
    assert Config.from_env({"DP_PLUGIN_SHARD_OPTIMIZER_STATE": "1"}).shard_optimizer_state
    with pytest.raises(ValueError, match="DP_PLUGIN_SHARD_OPTIMIZER_STATE"):
        Config.from_env({"DP_PLUGIN_SHARD_OPTIMIZER_STATE": "maybe"})
