"""Copy-mode fusion buffers take turns on two slabs (``dp_plugin.reduce.bucket``):
fusion memory within twice the threshold, back-pressure, pinning."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dp_plugin.engines.base import Handle
from dp_plugin.errors import DPPluginError
from dp_plugin.reduce.arrays import NumpyOps
from dp_plugin.reduce.fusion import TensorSpec
from dp_plugin.reduce.hooks import GradBucket, HookState, allreduce_hook
from dp_plugin.reduce.reducer import GradientScheduler, Reducer
from tests.unit.fakes import FakeEngine, make_thread_group, run_ranks

# 12 tensors of 64 bytes; a 128-byte threshold makes 6 buckets of 2.
SPECS = [TensorSpec(f"t{i}", (16,), "float32") for i in range(12)]
THRESHOLD = 128


def grad(rank: int, step: int, i: int) -> np.ndarray:
    return np.random.default_rng([rank, step, i]).integers(-8, 9, 16).astype(np.float32)


def expected(step: int, i: int, size: int) -> np.ndarray:
    return np.mean([grad(r, step, i) for r in range(size)], axis=0)  # type: ignore[no-any-return]


def fusion_bytes(sched: GradientScheduler) -> int:
    """Bytes of fusion memory the scheduler holds: slabs plus pinned buffers."""
    pinned = sum(b.flat.nbytes for b in sched.buckets if b.pinned and b.flat is not None)
    return sched.slab_bytes() + pinned


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_copy_mode_keeps_fusion_memory_within_twice_the_threshold(compression: str) -> None:
    engines = make_thread_group(2)

    def body(e: FakeEngine) -> tuple[int, int]:
        sched = GradientScheduler(SPECS, engine=e, fusion_threshold=THRESHOLD,
                                  compression=compression, array_ops=NumpyOps())
        for step in range(3):
            grads = [grad(e.rank, step, i) for i in range(len(SPECS))]
            for i in reversed(range(len(SPECS))):
                sched.mark_ready(i, grads[i])
            sched.synchronize()
            tol = 0 if compression == "none" else 1e-2
            for i, g in enumerate(grads):
                np.testing.assert_allclose(g, expected(step, i, 2), atol=tol, err_msg=f"t{i}")
        return len(sched.plan), fusion_bytes(sched)

    for buckets, used in run_ranks(engines, body):
        assert buckets == 6
        assert 0 < used <= 2 * THRESHOLD  # one buffer per bucket would be 6 x 128


def test_a_rank_that_must_not_block_defers_the_third_bucket_until_the_first_is_done() -> None:
    """A joined rank (zeros, ``launch_all``) starts buckets 0 and 1, leaves
    bucket 2 for the slab of bucket 0, and ``all_done`` starts it once bucket 0
    finished, with no wait inside either call."""
    engines = make_thread_group(2)
    deferred = threading.Event()

    def body(e: FakeEngine) -> list[int]:
        sched = GradientScheduler(SPECS, engine=e, fusion_threshold=THRESHOLD,
                                  array_ops=NumpyOps())
        sched.agree()  # the first step's agreement, on both ranks
        seen = []
        if e.rank == 0:
            sched.launch_all()
            seen.append(sched._state.next_launch)
            assert not sched.all_done()
            deferred.set()
            deadline = time.monotonic() + 20
            while not sched.all_done():
                assert time.monotonic() < deadline, "all_done() never became true"
                time.sleep(0.005)
            seen.append(sched._state.next_launch)
            results = sched.synchronize()
        else:
            assert deferred.wait(20)
            results = [grad(1, 0, i) for i in range(len(SPECS))]
            for i in reversed(range(len(SPECS))):
                sched.mark_ready(i, results[i])  # its starts wait for their slabs
            sched.synchronize()
        for i, got in enumerate(results):
            np.testing.assert_array_equal(got, grad(1, 0, i) / 2)
        return seen

    assert run_ranks(engines, body)[0] == [2, 6]


def test_a_bucket_whose_views_were_taken_is_pinned_and_borrows_no_slab() -> None:
    engines = make_thread_group(2)

    def body(e: FakeEngine) -> tuple[list[bool], int]:
        sched = GradientScheduler(SPECS, engine=e, fusion_threshold=THRESHOLD,
                                  array_ops=NumpyOps())
        sched.rebuild_buckets = False
        views = {i: sched.view_for(i) for i in (0, 1)}  # bucket 5 (reverse order)
        for step in range(2):
            grads = [grad(e.rank, step, i) for i in range(len(SPECS))]
            for i in reversed(range(len(SPECS))):
                if i in views:
                    views[i][...] = grads[i]
                    grads[i] = views[i]
                sched.mark_ready(i, grads[i])
            sched.synchronize()
            for i, g in enumerate(grads):
                np.testing.assert_array_equal(g, expected(step, i, 2))
        pinned = [b.pinned for b in sched.buckets]
        return pinned, sched.slab_bytes()

    for pinned, slab_bytes in run_ranks(engines, body):
        assert pinned == [False] * 5 + [True]
        assert slab_bytes == 2 * THRESHOLD


def test_a_view_of_a_bucket_in_flight_is_refused() -> None:
    (e,) = make_thread_group(1)
    fused = Reducer(SPECS[:2], engine=e, name="g", fusion_threshold=THRESHOLD,
                    array_ops=NumpyOps())
    tensors = [grad(0, 0, i) for i in range(2)]
    fused.mark_ready(1, tensors[1])
    fused.mark_ready(0, tensors[0])  # the bucket of both starts
    with pytest.raises(DPPluginError, match="in flight"):
        fused.view_for(0)
    fused.synchronize()
    assert fused.view_for(0).shape == (16,) and fused.buckets[0].pinned


def test_a_bucket_over_the_threshold_keeps_its_own_buffer() -> None:
    """One tensor larger than the threshold (fp16 on the wire, so not reduced
    where it lies) gets a buffer of its own: slabs stay the threshold's size."""
    specs = [*SPECS, TensorSpec("big", (256,), "float32")]  # 1 KiB
    engines = make_thread_group(2)

    def body(e: FakeEngine) -> tuple[list[bool], int]:
        sched = GradientScheduler(specs, engine=e, fusion_threshold=THRESHOLD,
                                  compression="fp16", array_ops=NumpyOps())
        def inputs(rank: int) -> list[np.ndarray]:
            rng = np.random.default_rng(rank)
            return [rng.integers(-8, 9, s.shape).astype(np.float32) for s in specs]

        grads = inputs(e.rank)
        want = [(a + b) / 2 for a, b in zip(inputs(0), inputs(1), strict=True)]
        for i in reversed(range(len(specs))):
            sched.mark_ready(i, grads[i])
        sched.synchronize()
        for g, w in zip(grads, want, strict=True):
            np.testing.assert_array_equal(g, w)  # halves of small integers: exact in fp16
        return [b.pinned for b in sched.buckets], sched.slab_bytes()

    for pinned, slab_bytes in run_ranks(engines, body):
        assert pinned == [True] + [False] * 6  # the big tensor comes first (reverse order)
        assert 0 < slab_bytes <= 2 * THRESHOLD


def test_a_hooks_per_bucket_state_stays_per_bucket_while_buckets_share_slabs() -> None:
    """``GradBucket.scratch`` is the bucket's own (an error-feedback residual
    lives there); only ``shared`` is the slab's."""
    engines = make_thread_group(2)

    def body(e: FakeEngine) -> tuple[dict[int, set[int]], dict[int, set[int | None]]]:
        own: dict[int, set[int]] = {}
        shared: dict[int, set[int | None]] = {}

        def hook(state: HookState, bucket: GradBucket) -> Handle:
            bucket.scratch.setdefault("steps", 0)
            bucket.scratch["steps"] += 1
            own.setdefault(bucket.index, set()).add(id(bucket.scratch))
            shared.setdefault(bucket.index, set()).add(
                None if bucket.shared is None else id(bucket.shared))
            return allreduce_hook(state, bucket)

        sched = GradientScheduler(SPECS, engine=e, fusion_threshold=THRESHOLD, hook=hook,
                                  array_ops=NumpyOps())
        sched.rebuild_buckets = False
        for step in range(3):
            for i in reversed(range(len(SPECS))):
                sched.mark_ready(i, grad(e.rank, step, i))
            sched.synchronize()
        assert all(b.scratch["steps"] == 3 for b in sched.buckets)
        return own, shared

    for own, shared in run_ranks(engines, body):
        assert len(own) == 6 and all(len(ids) == 1 for ids in own.values())
        assert len({next(iter(ids)) for ids in own.values()}) == 6  # one dict per bucket
        assert len({next(iter(ids)) for ids in shared.values()}) == 2  # one per slab
