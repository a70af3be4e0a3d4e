"""One ``Bucket`` from pack to unpack: it knows itself how each member
travels (copied, aliased, direct) and which bucket had its slab before."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dp_plugin.engines.base import ReduceOp
from dp_plugin.reduce.arrays import NumpyOps
from dp_plugin.reduce.bucket import Bucket, Slab
from dp_plugin.reduce.fusion import TensorSpec, plan_buckets
from dp_plugin.reduce.hooks import HookState, ReducePolicy, allreduce_hook
from tests.unit.fakes import make_thread_group

OPS = NumpyOps()
# One rank: the sum is the input, so the result is input * prescale * postscale.
POLICY = ReducePolicy(ReduceOp.SUM, 1, prescale=2.0, postscale=0.25)


def _buckets(specs: list[TensorSpec], threshold: int,
             slab: Slab | None = None) -> list[Bucket]:
    plan = plan_buckets(specs, threshold, order=range(len(specs)))
    return [Bucket(e, specs, f"t.bucket{e.index}", wire_dtype=e.dtype, slab=slab) for e in plan]


def _run(bucket: Bucket, tensors: list[np.ndarray]) -> None:
    state = HookState(make_thread_group(1)[0], POLICY.engine_op)
    bucket.start(OPS, tensors, POLICY, allreduce_hook, state)
    assert bucket.pending
    assert bucket.finish() is not None and not bucket.pending and bucket.handle is None


def test_a_member_that_is_its_slice_is_only_scaled_and_the_others_are_copied() -> None:
    specs = [TensorSpec("a", (4,), "float32"), TensorSpec("b", (2, 3), "float32")]
    (bucket,) = _buckets(specs, 1024)
    aliased = bucket.view(OPS, 0)  # an adapter keeps its gradient there
    aliased[:] = [1, 2, 3, 4]
    copied = np.arange(6, dtype=np.float32).reshape(2, 3)
    _run(bucket, [aliased, copied])
    np.testing.assert_array_equal(aliased, [0.5, 1, 1.5, 2])
    np.testing.assert_array_equal(copied, np.arange(6).reshape(2, 3) * 0.5)
    assert OPS.shares_memory(bucket.views[0], aliased)
    assert bucket.pinned and not OPS.shares_memory(bucket.views[1], copied.reshape(-1))


def test_a_bucket_of_one_contiguous_member_is_reduced_where_it_lies() -> None:
    (bucket,) = _buckets([TensorSpec("w", (8,), "float32")], 1024)
    grad = np.full(8, 4.0, dtype=np.float32)
    _run(bucket, [grad])
    np.testing.assert_array_equal(grad, np.full(8, 2.0))
    assert bucket.flat is None  # no fusion buffer was needed


def test_a_bucket_unpacks_the_one_that_had_its_slab_before_packing_into_it() -> None:
    specs = [TensorSpec(f"t{i}", (2,), "float32") for i in range(4)]
    slab = Slab(4, "float32", "cpu")
    first, second = _buckets(specs, 16, slab)
    assert not first.pinned and first.slab is slab
    state = HookState(make_thread_group(1)[0], POLICY.engine_op)
    grads = [np.full(2, float(i + 1), dtype=np.float32) for i in range(4)]
    first.start(OPS, grads[:2], POLICY, allreduce_hook, state)
    assert slab.owner is first and first.pending
    second.start(OPS, grads[2:], POLICY, allreduce_hook, state)
    # first was waited for and unpacked before second packed over its values
    assert slab.owner is second and not first.pending
    np.testing.assert_array_equal(np.concatenate(grads[:2]), [0.5, 0.5, 1, 1])
    first.finish()
    second.finish()
    np.testing.assert_array_equal(np.concatenate(grads[2:]), [1.5, 1.5, 2, 2])


def test_an_error_of_the_hook_names_the_bucket() -> None:
    (bucket,) = _buckets([TensorSpec("w", (8,), "float32"), TensorSpec("v", (2,), "float32")],
                         1024)

    def broken(state: HookState, grad_bucket: Any) -> Any:
        raise RuntimeError("the wire broke")

    state = HookState(make_thread_group(1)[0], POLICY.engine_op)
    with pytest.raises(RuntimeError, match="the wire broke") as info:
        bucket.start(OPS, [np.zeros(8, np.float32), np.zeros(2, np.float32)], POLICY, broken,
                     state)
    assert info.value.__notes__ == [
        "while reducing bucket 0 of 't': 2 tensor(s), 40 bytes float32 on cpu, first 'w', 'v'"]
