"""The scheduler's copy-free paths: gradients living in the fusion buffer
(``view_for``) and single-tensor buckets reduced in place."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dp_plugin.reduce.arrays import NumpyOps
from dp_plugin.reduce.fusion import TensorSpec
from dp_plugin.reduce.reducer import GradientScheduler
from tests.unit.fakes import FakeEngine, make_thread_group, run_ranks

SPECS = [TensorSpec(f"t{i}", shape, "float32") for i, shape in
         enumerate([(4, 3), (5,), (2, 2, 2), (7,)])]


class CountingOps(NumpyOps):
    """NumpyOps that counts data copies into and out of fusion buffers."""

    def __init__(self) -> None:
        self.copies = 0

    def pack(self, dst: Any, src: Any, factor: float = 1.0) -> None:
        self.copies += 1
        super().pack(dst, src, factor)

    def unpack(self, dst: Any, src: Any, factor: float = 1.0) -> None:
        self.copies += 1
        super().unpack(dst, src, factor)


def grad(rank: int, step: int, spec: TensorSpec) -> np.ndarray:
    rng = np.random.default_rng(1000 * step + 17 * rank + spec.numel)
    return rng.integers(-8, 8, size=spec.shape).astype(np.float32)


def expected(step: int, spec: TensorSpec, size: int) -> np.ndarray:
    return np.mean([grad(r, step, spec) for r in range(size)], axis=0)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_gradients_in_fusion_buffer_views_are_reduced_without_copies(size: int) -> None:
    engines = make_thread_group(size)

    def body(e: FakeEngine) -> list[int]:
        ops = CountingOps()
        sched = GradientScheduler(SPECS, engine=e, array_ops=ops)
        copies = []
        for step in range(3):
            version = sched.plan_version
            views = [sched.view_for(i) for i in range(len(SPECS))]
            for i in reversed(range(len(SPECS))):
                views[i][...] = grad(e.rank, step, SPECS[i])  # "backward" writes in place
                sched.mark_ready(i, views[i])
            before = ops.copies
            out = sched.synchronize()
            copies.append(ops.copies - before)
            for i, spec in enumerate(SPECS):
                assert out[i] is views[i]
                np.testing.assert_allclose(views[i], expected(step, spec, size), rtol=1e-6)
            assert version == sched.plan_version or step == 0
        return copies

    for copies in run_ranks(engines, body):
        assert copies == [0, 0, 0]


def test_view_shapes_and_mixed_views_and_copies() -> None:
    engines = make_thread_group(2)

    def body(e: FakeEngine) -> None:
        sched = GradientScheduler(SPECS, engine=e, op="sum")
        view = sched.view_for(2)
        assert view.shape == SPECS[2].shape
        view[...] = grad(e.rank, 0, SPECS[2])
        tensors = {i: grad(e.rank, 0, s) for i, s in enumerate(SPECS) if i != 2}
        tensors[2] = view
        for i in reversed(range(len(SPECS))):
            sched.mark_ready(i, tensors[i])
        sched.synchronize()
        for i, spec in enumerate(SPECS):
            np.testing.assert_allclose(tensors[i], 2 * expected(0, spec, 2), rtol=1e-6)

    run_ranks(engines, body)


@pytest.mark.parametrize("predivide", [1.0, 2.0])
def test_single_tensor_buckets_reduce_in_place_without_copies(predivide: float) -> None:
    engines = make_thread_group(3)

    def body(e: FakeEngine) -> int:
        ops = CountingOps()
        # A 1-byte threshold gives every tensor a bucket of its own.
        sched = GradientScheduler(SPECS, engine=e, fusion_threshold=1, array_ops=ops,
                                  gradient_predivide_factor=predivide)
        grads = [grad(e.rank, 0, s) for s in SPECS]
        for i in reversed(range(len(SPECS))):
            sched.mark_ready(i, grads[i])
        out = sched.synchronize()
        for i, spec in enumerate(SPECS):
            assert out[i] is grads[i]
            np.testing.assert_allclose(grads[i], expected(0, spec, 3), rtol=1e-6)
        return ops.copies

    assert run_ranks(engines, body) == [0, 0, 0]


def test_non_contiguous_single_tensor_falls_back_to_a_copy() -> None:
    engines = make_thread_group(2)
    spec = [TensorSpec("t", (3, 4), "float32")]

    def body(e: FakeEngine) -> np.ndarray:
        sched = GradientScheduler(spec, engine=e, op="sum")
        base = np.asfortranarray(np.full((3, 4), e.rank + 1, dtype=np.float32))
        sched.mark_ready(0, base)
        sched.synchronize()
        return base

    for result in run_ranks(engines, body):
        np.testing.assert_array_equal(result, np.full((3, 4), 3, dtype=np.float32))
