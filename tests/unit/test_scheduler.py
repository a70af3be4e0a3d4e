"""GradientScheduler on a fake thread group: N ranks as threads, no processes.

Results are compared with a numpy reference computed from every rank's
inputs; the fake engine records each rank's collectives so launch order can
be compared across ranks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pytest

from dp_plugin.agree.agreement import AGREE_NAME
from dp_plugin.api.timeline import StepStats
from dp_plugin.config import Config
from dp_plugin.errors import (
    CollectiveTimeoutError,
    DPPluginError,
    LayoutMismatchError,
    NotInitializedError,
)
from dp_plugin.launch import runtime
from dp_plugin.reduce.arrays import NumpyOps, as_numpy, numpy_dtype
from dp_plugin.reduce.fusion import TensorSpec, plan_buckets
from dp_plugin.reduce.reducer import GradientScheduler
from tests.unit.fakes import FakeEngine, make_thread_group, run_ranks, run_ranks_outcomes

SHAPES: list[tuple[int, ...]] = [(3, 4), (), (5,), (0,), (2, 3, 2), (7,), (1,), (4, 0, 2), (16,)]

REDUCE: dict[str, Callable[..., Any]] = {
    "sum": np.sum, "average": np.mean, "min": np.min, "max": np.max, "product": np.prod,
}

TOL = {"float64": 1e-12, "float32": 1e-6, "float16": 2e-3, "bfloat16": 1e-2}


def make_specs(dtypes: Sequence[str], shapes: Sequence[tuple[int, ...]] = SHAPES
               ) -> list[TensorSpec]:
    return [
        TensorSpec(f"t{i}", shape, dtypes[i % len(dtypes)])
        for i, shape in enumerate(shapes)
    ]


def values(rank: int, step: int, i: int, spec: TensorSpec) -> np.ndarray:
    """Deterministic inputs, exactly representable in every dtype (sums stay exact)."""
    rng = np.random.default_rng([rank, step, i])
    if spec.dtype.startswith(("float", "bfloat")):
        raw = np.asarray(rng.integers(-8, 9, size=spec.shape) / 4)
    else:
        raw = np.asarray(rng.integers(-5, 6, size=spec.shape))
    return raw.astype(numpy_dtype(spec.dtype))


def reference(op: str, specs: Sequence[TensorSpec], size: int, step: int,
              ranks: Iterable[int] | None = None) -> list[np.ndarray]:
    """What every rank must hold after the step (float64 maths, cast back)."""
    ranks = range(size) if ranks is None else ranks
    out = []
    for i, spec in enumerate(specs):
        stack = np.stack(
            [values(r, step, i, spec).astype(np.float64) for r in ranks]
            + [np.zeros(spec.shape)] * (size - len(list(ranks)))
        )
        out.append(REDUCE[op](stack, axis=0).astype(numpy_dtype(spec.dtype)))
    return out


def assert_close(got: Sequence[Any], want: Sequence[np.ndarray], specs: Sequence[TensorSpec],
                 rtol: float | None = None) -> None:
    for g, w, spec in zip(got, want, specs, strict=True):
        g = as_numpy(g)
        assert g.shape == w.shape and g.dtype == w.dtype, spec
        tol = TOL.get(spec.dtype, 0.0) if rtol is None else rtol
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=tol,
                                   atol=tol, err_msg=spec.name)


def run_steps(
    n: int,
    specs: Sequence[TensorSpec],
    *,
    steps: int = 3,
    order: Callable[[int, int], Sequence[int]] | None = None,
    config: Config | None = None,
    make: Callable[[np.ndarray], Any] = lambda a: a,
    spec_of_rank: Callable[[int], Sequence[TensorSpec]] | None = None,
    **kwargs: Any,
) -> tuple[list[FakeEngine], list[tuple[GradientScheduler, list[list[np.ndarray]]]]]:
    """Every rank runs ``steps`` steps; returns the engines and, per rank, the
    scheduler and a copy of each step's results."""
    engines = make_thread_group(n, config=config or Config(timeout_s=30.0))

    def body(e: FakeEngine) -> tuple[GradientScheduler, list[list[np.ndarray]]]:
        mine = specs if spec_of_rank is None else spec_of_rank(e.rank)
        sched = GradientScheduler(mine, engine=e, **kwargs)
        results = []
        for step in range(steps):
            grads = [make(values(e.rank, step, i, s)) for i, s in enumerate(mine)]
            walk = range(len(mine) - 1, -1, -1) if order is None else order(e.rank, step)
            for i in walk:
                sched.mark_ready(i, grads[i])
            out = sched.synchronize()
            assert all(o is g for o, g in zip(out, grads, strict=True))  # in place
            results.append([np.array(as_numpy(o), copy=True) for o in out])
        return sched, results

    return engines, run_ranks(engines, body)


def calls(engine: FakeEngine) -> list[tuple[str, str]]:
    """The engine's collectives; the agreement's all-reduce of rows shows as 'agree'."""
    return [("agree" if name == AGREE_NAME else kind, name) for kind, name, _ in engine.log]


def shuffled(rank: int, step: int, count: int = len(SHAPES)) -> list[int]:
    return [int(i) for i in np.random.default_rng([99, rank, step]).permutation(count)]


# -- correctness against numpy --------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32"])
def test_matches_numpy_reference(n: int, dtype: str) -> None:
    op = "sum" if dtype == "int32" else "average"
    specs = make_specs([dtype])
    # 24 bytes: several buckets, some tensors larger than the threshold.
    engines, ranks = run_steps(n, specs, op=op, fusion_threshold=24)
    for step in range(3):
        want = reference(op, specs, n, step)
        for _, results in ranks:
            assert_close(results[step], want, specs)
    assert all(calls(e) == calls(engines[0]) for e in engines)


def test_mixed_dtypes_threshold_smaller_than_every_tensor() -> None:
    specs = make_specs(["float32", "float16", "float64", "bfloat16"])
    _, ranks = run_steps(3, specs, fusion_threshold=1, order=shuffled)
    sched = ranks[0][0]
    # One non-empty tensor per bucket (empty ones may share).
    assert all(sum(specs[i].numel > 0 for i in b.members) <= 1 for b in sched.plan)
    for step in range(3):
        for _, results in ranks:
            assert_close(results[step], reference("average", specs, 3, step), specs)


@pytest.mark.parametrize("op", ["sum", "min", "max", "product"])
@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_reduce_ops(op: str, dtype: str) -> None:
    specs = make_specs([dtype])
    _, ranks = run_steps(3, specs, op=op, fusion_threshold=64, steps=2)
    for step in range(2):
        for _, results in ranks:
            assert_close(results[step], reference(op, specs, 3, step), specs)


@pytest.mark.parametrize("n", [2, 3])
def test_predivide_and_user_factors(n: int) -> None:
    specs = make_specs(["float64"])
    _, ranks = run_steps(n, specs, op="average", gradient_predivide_factor=4.0,
                         prescale_factor=0.5, postscale_factor=3.0, steps=1)
    want = [w * 1.5 for w in reference("average", specs, n, 0)]
    assert_close(ranks[-1][1][0], want, specs)
    _, ranks = run_steps(n, specs, op="sum", prescale_factor=2.0, postscale_factor=0.25,
                         steps=1)
    want = [w * 0.5 for w in reference("sum", specs, n, 0)]
    assert_close(ranks[0][1][0], want, specs)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_predivide_scales_before_the_sum() -> None:
    # Near float16's maximum a plain sum overflows; pre-dividing keeps it finite.
    spec = [TensorSpec("g", (4,), "float16")]
    engines = make_thread_group(2)

    def body(e: FakeEngine, factor: float) -> np.ndarray:
        sched = GradientScheduler(spec, engine=e, gradient_predivide_factor=factor)
        grad = np.full(4, 40000.0, np.float16)
        sched.mark_ready(0, grad)
        sched.synchronize()
        return grad

    plain = run_ranks(engines, lambda e: body(e, 1.0))
    engines = make_thread_group(2)
    divided = run_ranks(engines, lambda e: body(e, 2.0))
    assert np.isinf(plain[0]).all()
    np.testing.assert_array_equal(divided[0], np.full(4, 40000.0, np.float16))


@pytest.mark.parametrize(("setting", "values"), [
    ("gradient_predivide_factor", (1.0, 2.0)),
    ("prescale_factor", (1.0, 0.5)),
    ("postscale_factor", (3.0, 1.0)),
])
def test_differing_scale_settings_are_named_as_the_user_set_them(
        setting: str, values: tuple[float, float]) -> None:
    """A different gradient_predivide_factor was reported as the derived
    ``postscale`` (``postscale * predivide / size``), not the argument the user set."""
    spec = [TensorSpec("g", (4,), "float32")]

    def body(e: FakeEngine) -> None:
        sched = GradientScheduler(spec, engine=e, **{setting: values[e.rank]})
        sched.mark_ready(0, np.ones(4, np.float32))
        sched.synchronize()

    outcomes = run_ranks_outcomes(make_thread_group(2), body)
    for err in outcomes:
        assert isinstance(err, LayoutMismatchError), outcomes
        assert f"{setting} differs (rank 0: {values[0]!r}; rank 1: {values[1]!r})" in str(err), \
            str(err)


@pytest.mark.parametrize(("compression", "wire"), [("fp16", "float16"), ("bf16", "bfloat16")])
def test_compression(compression: str, wire: str) -> None:
    specs = make_specs(["float32", "float64", "int32"])
    op = "sum"
    engines, ranks = run_steps(3, specs, op=op, compression=compression, fusion_threshold=48)
    for step in range(3):
        for _, results in ranks:
            # Inputs and their sums are exact in the wire type.
            assert_close(results[step], reference(op, specs, 3, step), specs, rtol=0)
    sched = ranks[0][0]
    itemsize = {"float16": 2, "bfloat16": 2}[wire]
    expect = sum(
        b.numel * (itemsize if b.dtype.startswith("float") else 4) for b in sched.plan
    )
    assert sched.stats.last is not None and sched.stats.last.bytes_reduced == expect
    assert all(calls(e) == calls(engines[0]) for e in engines)


def test_compression_rounds_through_the_wire_type() -> None:
    spec = [TensorSpec("g", (1,), "float32")]
    engines = make_thread_group(2)

    def body(e: FakeEngine) -> float:
        sched = GradientScheduler(spec, engine=e, op="sum", compression="fp16")
        grad = np.array([1.0 + 2.0**-12], np.float32)  # not representable in float16
        sched.mark_ready(0, grad)
        sched.synchronize()
        return float(grad[0])

    assert run_ranks(engines, body) == [2.0, 2.0]


def test_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    specs = make_specs(["float32", "bfloat16", "float64"])

    def make(a: np.ndarray) -> Any:
        return torch.from_numpy(a.astype(np.float32)).to(
            {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}.get(
                a.dtype, torch.bfloat16))

    _, ranks = run_steps(3, specs, make=make, fusion_threshold=32, order=shuffled)
    for step in range(3):
        for sched, results in ranks:
            assert_close(results[step], reference("average", specs, 3, step), specs)
            assert sched.ops is not None and sched.ops.kind == "torch"


# -- scheduling ------------------------------------------------------------

def test_launch_order_identical_when_readiness_differs() -> None:
    specs = make_specs(["float32", "float16"])
    config = Config(timeout_s=30.0, rebuild_buckets=False)
    engines, ranks = run_steps(3, specs, order=shuffled, fusion_threshold=20, config=config)
    assert len(ranks[0][0].plan) > 3
    logs = [calls(e) for e in engines]
    assert logs[0] == logs[1] == logs[2]
    launched = [name for kind, name in logs[0] if kind == "allreduce"]
    per_step = [f"grads.bucket{b.index}" for b in ranks[0][0].plan if b.numel]
    assert launched == per_step * 3  # strictly in bucket-index order, every step
    for step in range(3):
        for _, results in ranks:
            assert_close(results[step], reference("average", specs, 3, step), specs)


def test_launches_during_backward_as_buckets_complete() -> None:
    specs = [TensorSpec(f"w{i}", (4,), "float32") for i in range(4)]
    engines = make_thread_group(2)

    def body(e: FakeEngine) -> list[int]:
        sched = GradientScheduler(specs, engine=e, fusion_threshold=32)  # 2 per bucket
        seen = []
        grads = [np.ones(4, np.float32) for _ in specs]
        for i in [3, 2, 1, 0]:
            sched.mark_ready(i, grads[i])
            seen.append(sum(kind == "allreduce" for kind, _ in calls(e)))
        sched.synchronize()
        return seen

    # Bucket 0 = (3, 2) starts right after w2 is ready, before backward ends.
    assert run_ranks(engines, body) == [[0, 1, 1, 2]] * 2


def test_complete_bucket_waits_for_lower_indices() -> None:
    specs = [TensorSpec(f"w{i}", (4,), "float32") for i in range(4)]
    engines = make_thread_group(1)
    sched = GradientScheduler(specs, engine=engines[0], fusion_threshold=32)
    grads = [np.ones(4, np.float32) for _ in specs]
    sched.mark_ready(0, grads[0])
    sched.mark_ready(1, grads[1])  # bucket 1 complete, bucket 0 not: nothing starts
    assert calls(engines[0]) == []
    sched.mark_ready(2, grads[2])
    sched.mark_ready(3, grads[3])
    assert calls(engines[0]) == [("allreduce", "grads.bucket0"), ("allreduce", "grads.bucket1")]
    sched.synchronize()


def test_ready_events_timestamp_finished_all_reduces() -> None:
    specs = [TensorSpec(f"w{i}", (4,), "float32") for i in range(4)]
    sched = GradientScheduler(specs, engine=_one_rank(), fusion_threshold=16)
    grads = [np.ones(4, np.float32) for _ in specs]
    sched.mark_ready(3, grads[3])
    sched.mark_ready(2, grads[2])  # polls bucket 0, which one rank finishes at once
    first = sched.buckets[0].handle
    assert first is not None and first.completed_at is not None
    for i in (1, 0):
        sched.mark_ready(i, grads[i])
    sched.synchronize()


def test_backward_passes_per_step() -> None:
    specs = [TensorSpec(f"w{i}", (3,), "float32") for i in range(3)]
    engines = make_thread_group(2)

    def body(e: FakeEngine) -> list[np.ndarray]:
        sched = GradientScheduler(specs, engine=e, backward_passes_per_step=2,
                                  fusion_threshold=12)
        grads = [np.zeros(3, np.float32) for _ in specs]
        for p in range(2):
            for i in (2, 1, 0):
                grads[i] += float(e.rank + p + i)  # the caller accumulates, like autograd
                sched.mark_ready(i, grads[i])
            if p == 0:
                assert calls(e) == []  # first pass: no communication at all
        assert sum(kind == "allreduce" for kind, _ in calls(e)) == 3
        with pytest.raises(DPPluginError, match=r"more than backward_passes_per_step times"
                           r".*Increase backward_passes_per_step.*'w1'"):
            sched.mark_ready(1, grads[1])
        sched.synchronize()
        # Counters are reset: the next step accepts two passes again.
        for _ in range(2):
            for i in (2, 1, 0):
                sched.mark_ready(i, grads[i])
        sched.synchronize()
        return grads

    out = run_ranks(engines, body)
    # step 1: rank r holds 2r+1+2i; average over ranks = 2+2i; step 2 averages equal values.
    for grads in out:
        for i, g in enumerate(grads):
            np.testing.assert_array_equal(g, np.full(3, 2.0 + 2 * i, np.float32))


def test_synchronize_after_fewer_passes_uses_what_was_given() -> None:
    specs = [TensorSpec("w", (2,), "float32")]
    engines = make_thread_group(2)

    def body(e: FakeEngine) -> np.ndarray:
        sched = GradientScheduler(specs, engine=e, backward_passes_per_step=3, op="sum")
        grad = np.full(2, e.rank + 1.0, np.float32)
        sched.mark_ready(0, grad)
        sched.synchronize()
        return grad

    for g in run_ranks(engines, body):
        np.testing.assert_array_equal(g, [3.0, 3.0])


def test_missing_gradients_contribute_zeros() -> None:
    specs = make_specs(["float32"], shapes=[(2,), (3,), (), (4,)])
    engines = make_thread_group(3)

    def body(e: FakeEngine) -> list[np.ndarray]:
        sched = GradientScheduler(specs, engine=e, op="sum", fusion_threshold=8)
        # t1 is never ready on any rank; t3 only on rank 0 (an unused branch elsewhere).
        grads = {i: values(e.rank, 0, i, s) for i, s in enumerate(specs)}
        marked = [0, 2, 3] if e.rank == 0 else [0, 2]
        for i in marked:
            sched.mark_ready(i, grads[i])
        out = sched.synchronize()
        for i in marked:
            assert out[i] is grads[i]
        return [np.array(o) for o in out]

    outs = run_ranks(engines, body)
    want = reference("sum", specs, 3, 0)
    want[1] = np.zeros(3, np.float32)
    want[3] = values(0, 0, 3, specs[3])
    for out in outs:
        assert_close(out, want, specs)


def test_synchronize_with_nothing_marked() -> None:
    specs = make_specs(["float32", "int16"], shapes=[(2,), (3,)])
    engines = make_thread_group(2)

    def body(e: FakeEngine) -> list[Any]:
        sched = GradientScheduler(specs, engine=e, op="sum")
        return sched.synchronize()

    for out in run_ranks(engines, body):
        assert [o.dtype for o in out] == [np.float32, np.int16]
        assert all(not o.any() for o in out)


def test_empty_tensors_need_no_collective() -> None:
    specs = [TensorSpec("e", (0,), "float32"), TensorSpec("f", (3, 0), "float32")]
    engines = make_thread_group(2)

    def body(e: FakeEngine) -> None:
        sched = GradientScheduler(specs, engine=e)
        for i, s in enumerate(specs):
            sched.mark_ready(i, np.zeros(s.shape, np.float32))
        sched.synchronize()

    run_ranks(engines, body)
    assert all(kind != "allreduce" for kind, _ in calls(engines[0]))


class SpyOps(NumpyOps):
    """NumpyOps that records every allocation."""

    def __init__(self) -> None:
        self.allocations: list[tuple[str, Any]] = []

    def empty(self, numel: int, dtype: str, device: str) -> np.ndarray:
        self.allocations.append(("empty", (numel, dtype)))
        return super().empty(numel, dtype, device)

    def zeros(self, shape: tuple[int, ...], dtype: str, device: str) -> np.ndarray:
        self.allocations.append(("zeros", (shape, dtype)))
        return super().zeros(shape, dtype, device)


def _storage(sched: GradientScheduler) -> list[tuple[int, ...]]:
    """Identities of every buffer the scheduler keeps: pinned fusion buffers,
    slabs, and the hooks' scratch buffers of both."""
    owners = [(b.flat, b.scratch) for b in sched.buckets if b.pinned]
    owners += [(s.storage, s.shared) for s in sched.slabs]
    return [(id(flat), *(id(v) for _, v in sorted(scratch.items()))) for flat, scratch in owners]


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_no_buffer_allocation_after_warm_up(compression: str) -> None:
    specs = make_specs(["float32", "float64"])
    engines = make_thread_group(2)

    def body(e: FakeEngine) -> tuple[list[int], int]:
        spy = SpyOps()
        sched = GradientScheduler(specs, engine=e, fusion_threshold=24, array_ops=spy,
                                  compression=compression)
        per_step = []
        buffers: list[Any] = []
        for step in range(5):
            before = len(spy.allocations)
            for i in shuffled(e.rank, step):
                sched.mark_ready(i, values(e.rank, step, i, specs[i]))
            sched.synchronize()
            per_step.append(len(spy.allocations) - before)
            if step == 2:
                buffers = _storage(sched)
        return per_step, int(_storage(sched) == buffers)

    for per_step, same in run_ranks(engines, body):
        # Step 0 allocates; step 1 reallocates once for the rebuilt plan; then nothing.
        assert per_step[0] > 0
        assert per_step[2:] == [0, 0, 0]
        assert same


def test_rebuild_from_rank0_ready_order() -> None:
    specs = [TensorSpec(f"w{i}", (4,), "float32") for i in range(6)]
    orders = {0: [0, 1, 2, 3, 4, 5], 1: [2, 0, 5, 1, 3, 4], 2: [5, 4, 3, 2, 1, 0]}
    engines, ranks = run_steps(
        3, specs, fusion_threshold=32, steps=3,
        order=lambda r, step: orders[r] if step == 0 else orders[(r + step) % 3],
    )
    expected = plan_buckets(specs, 32, order=orders[0])
    assert [b.members for b in expected] == [(0, 1), (2, 3), (4, 5)]
    for sched, results in ranks:
        assert sched.rebuilt
        assert sched.plan == expected
        for step in range(3):
            assert_close(results[step], reference("average", specs, 3, step), specs)
    log = calls(engines[0])
    assert log.count(("broadcast", "grads.bucket_order")) == 1
    assert all(calls(e) == log for e in engines)


def test_rebuild_disabled_or_single_rank() -> None:
    specs = [TensorSpec(f"w{i}", (4,), "float32") for i in range(4)]
    forward = lambda r, step: [0, 1, 2, 3]  # noqa: E731
    config = Config(timeout_s=30.0, rebuild_buckets=False)
    _, ranks = run_steps(2, specs, fusion_threshold=32, order=forward, config=config)
    assert not ranks[0][0].rebuilt
    assert ranks[0][0].plan == plan_buckets(specs, 32)
    engines, ranks = run_steps(1, specs, fusion_threshold=32, order=forward)
    assert ranks[0][0].rebuilt
    assert [b.members for b in ranks[0][0].plan] == [(0, 1), (2, 3)]
    assert all(kind != "broadcast" for kind, _ in calls(engines[0]))


def test_configured_first_bucket_is_small_and_survives_the_rebuild() -> None:
    specs = [TensorSpec(f"w{i}", (4,), "float32") for i in range(6)]
    config = Config(timeout_s=30.0, fusion_threshold=48, first_bucket_threshold=16, min_buckets=1)
    orders = {0: [0, 1, 2, 3, 4, 5], 1: [5, 4, 3, 2, 1, 0]}
    engines = make_thread_group(2, config=config)

    def body(e: FakeEngine) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        sched = GradientScheduler(specs, engine=e)
        before = [b.members for b in sched.plan]
        for i in orders[e.rank]:
            sched.mark_ready(i, values(e.rank, 0, i, specs[i]))
        sched.synchronize()
        return before, [b.members for b in sched.plan]

    for before, after in run_ranks(engines, body):
        assert before == [(5,), (4, 3, 2), (1, 0)]  # reverse registration order
        assert after == [(0,), (1, 2, 3), (4, 5)]  # rank 0's observed order
    # An explicit threshold applies to every bucket, the first included.
    sched = GradientScheduler(specs, engine=make_thread_group(1, config=config)[0],
                              fusion_threshold=48)
    assert [b.members for b in sched.plan] == [(5, 4, 3), (2, 1, 0)]


def test_the_default_plan_spreads_a_small_model_over_several_buckets() -> None:
    """8 MiB of gradients: DDP's 25 MiB would make one bucket, launched when
    backward ends; the default spreads them so the first ones overlap."""
    mib = 1 << 20
    specs = [TensorSpec(f"w{i}", (mib // 4,), "float32") for i in range(8)]
    plan = GradientScheduler(specs, engine=_one_rank()).plan
    assert len(plan) >= 4
    assert max(b.nbytes for b in plan) <= 2 * mib and plan[0].nbytes <= mib
    users = Config.from_env({"HOROVOD_FUSION_THRESHOLD": str(25 * mib)})
    engine = make_thread_group(1, config=users)[0]
    assert len(GradientScheduler(specs, engine=engine).plan) == 1  # the user's size, as set


# -- statistics and timeline -------------------------------------------------

def test_stats_and_timeline(tmp_path: Any) -> None:
    specs = make_specs(["float32"])
    path = tmp_path / "trace.json"
    config = Config(timeout_s=30.0, timeline=str(path))
    engines = make_thread_group(2, config=config)

    def body(e: FakeEngine) -> GradientScheduler:
        sched = GradientScheduler(specs, engine=e, fusion_threshold=24)
        for step in range(2):
            for i in range(len(specs)):
                sched.mark_ready(i, values(e.rank, step, i, specs[i]))
            sched.synchronize()
        sched.close()
        return sched

    scheds = run_ranks(engines, body)
    stats = list(scheds[0].stats)
    assert [s.step for s in stats] == [0, 1]
    nonempty = [b for b in scheds[0].plan if b.numel]
    for s in stats:
        assert isinstance(s, StepStats)
        assert s.buckets == len(nonempty)
        assert s.bytes_reduced == sum(b.nbytes for b in nonempty)
        assert s.step_s >= s.exposed_s >= 0 and s.allreduce_s >= 0
    for rank in range(2):
        events = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())
        cats = [ev.get("cat") for ev in events if ev.get("ph") == "X"]
        assert cats.count("step") == 2
        for cat in ("pack", "allreduce", "unpack"):
            assert cats.count(cat) == 2 * len(nonempty)


def test_two_schedulers_share_one_trace_file(tmp_path: Any) -> None:
    """Two schedulers (two optimizers) on one DP_PLUGIN_TIMELINE: one writer per
    file, so the file is strict JSON holding both schedulers' steps."""
    specs = make_specs(["float32"])
    path = tmp_path / "trace.json"
    engines = make_thread_group(2, config=Config(timeout_s=30.0, timeline=str(path)))

    def body(e: FakeEngine) -> None:
        first = GradientScheduler(specs, engine=e, fusion_threshold=24, name="a")
        second = GradientScheduler(specs, engine=e, fusion_threshold=24, name="b")
        for step in range(2):
            for sched in (first, second):
                for i in range(len(specs)):
                    sched.mark_ready(i, values(e.rank, step, i, specs[i]))
                sched.synchronize()
        first.close()
        second.close()

    run_ranks(engines, body)
    for rank in range(2):
        events = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())
        steps = [ev for ev in events if ev.get("ph") == "X" and ev.get("cat") == "step"]
        assert len(steps) == 4
        assert [ev for ev in events if ev.get("name") == "process_name"] == [
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
             "args": {"name": f"rank {rank}"}}]


# -- errors ----------------------------------------------------------------

def test_layout_mismatch_raises_on_every_rank() -> None:
    specs = make_specs(["float32"])
    other = list(specs)
    other[4] = TensorSpec("t4", (2, 3, 3), "float32")

    def body(e: FakeEngine) -> str:
        mine = other if e.rank == 2 else specs
        sched = GradientScheduler(mine, engine=e, fusion_threshold=24)
        try:
            for i in shuffled(e.rank, 0):
                sched.mark_ready(i, np.zeros(mine[i].shape, np.float32))
            sched.synchronize()
        except LayoutMismatchError as exc:
            # Later calls refuse instead of starting collectives that could hang.
            with pytest.raises(DPPluginError, match=r"failed earlier.*LayoutMismatchError"):
                sched.synchronize()
            return str(exc)
        raise AssertionError("no LayoutMismatchError")

    engines = make_thread_group(3)
    messages = run_ranks(engines, body)
    for rank, msg in enumerate(messages):
        assert msg.startswith(f"rank {rank}: the tensors of scheduler 'grads' registered")
        assert "'t4' shape (2, 3, 2)" in msg and "rank(s) 2 have tensor 't4' shape (2, 3, 3)" in msg
    assert all(calls(e) == calls(engines[0]) for e in engines)
    assert all(kind != "allreduce" for kind, _ in calls(engines[0]))


def test_timeout_names_the_bucket() -> None:
    specs = [TensorSpec(f"layer{i}", (4,), "float32") for i in range(3)]
    engines = make_thread_group(2, config=Config(timeout_s=0.3))

    def body(e: FakeEngine) -> None:
        sched = GradientScheduler(specs, engine=e, fusion_threshold=16)
        for _ in range(2):
            for i in (2, 1, 0):
                sched.mark_ready(i, np.ones(4, np.float32))
            sched.synchronize()
        if e.rank == 1:
            e.go_silent()  # rank 1 dies: rank 0 must not hang
            return
        for i in (2, 1, 0):
            sched.mark_ready(i, np.ones(4, np.float32))
        with pytest.raises(CollectiveTimeoutError) as info:
            sched.synchronize()
        msg = str(info.value)
        assert "rank 0" in msg and "did not finish within 0.3 s" in msg
        assert "bucket 0 of 'grads': 1 tensor(s), 16 bytes float32 on cpu, first 'layer2'" in msg
        with pytest.raises(DPPluginError, match="failed earlier"):
            sched.mark_ready(0, np.ones(4, np.float32))

    run_ranks(engines, body, timeout=30)


def _one_rank() -> FakeEngine:
    return make_thread_group(1)[0]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"op": "mean"}, ValueError, r"'mean' is not known; valid ops: sum, average"),
        ({"compression": "zip"}, ValueError, r"'zip' is not known; valid values: none"),
        ({"gradient_predivide_factor": 0}, ValueError,
         r"gradient_predivide_factor must be a finite number > 0, got 0"),
        ({"prescale_factor": -1.0}, ValueError,
         r"prescale_factor must be a finite number > 0, got -1.0"),
        ({"postscale_factor": float("nan")}, ValueError, r"postscale_factor must be a finite"),
        ({"backward_passes_per_step": 0}, ValueError, r"backward_passes_per_step must be an int"),
        ({"backward_passes_per_step": 1.5}, ValueError, r">= 1, got 1.5"),
        ({"backward_passes_per_step": True}, ValueError, r"got True"),
        ({"fusion_threshold": 0}, ValueError, r"threshold must be > 0 bytes, got 0"),
        ({"op": "sum", "gradient_predivide_factor": 2.0}, ValueError,
         r"only applies to op='average'"),
        ({"op": "max", "prescale_factor": 2.0}, ValueError, r"op='max' does not allow scaling"),
        ({"name": ""}, ValueError, r"name must be a non-empty string"),
    ],
)
def test_constructor_validation(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        GradientScheduler([TensorSpec("w", (2,), "float32")], engine=_one_rank(), **kwargs)


def test_integer_tensors_need_sum_without_scaling() -> None:
    specs = [TensorSpec("w", (2,), "float32"), TensorSpec("steps", (1,), "int64")]
    with pytest.raises(TypeError, match=r"'steps' is int64, but op='average' needs floating"):
        GradientScheduler(specs, engine=_one_rank())
    with pytest.raises(TypeError, match=r"'steps' is int64, which cannot be scaled"):
        GradientScheduler(specs, engine=_one_rank(), op="sum", postscale_factor=0.5)
    GradientScheduler(specs, engine=_one_rank(), op="sum")
    with pytest.raises(TypeError, match=r"specs\[0\] must be a dp_plugin.reduce.fusion.TensorSpec"):
        GradientScheduler([("w", (2,), "float32")], engine=_one_rank())  # type: ignore[list-item]


def test_mark_ready_validation() -> None:
    sched = GradientScheduler(
        [TensorSpec("w", (2, 3), "float32"), TensorSpec("b", (3,), "float32")],
        engine=_one_rank(),
    )
    with pytest.raises(IndexError, match=r"index 2 is out of range: 2 tensors.*0\.\.1"):
        sched.mark_ready(2, np.zeros(3, np.float32))
    with pytest.raises(IndexError, match=r"index -1"):
        sched.mark_ready(-1, np.zeros(3, np.float32))
    with pytest.raises(TypeError, match=r"index must be an int, got 'w'"):
        sched.mark_ready("w", np.zeros(3, np.float32))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"registered 'w' shape \(2, 3\) float32 on cpu, got "
                       r"shape \(3, 2\) float32"):
        sched.mark_ready(0, np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match=r"got shape \(3,\) float64"):
        sched.mark_ready(1, np.zeros(3, np.float64))
    with pytest.raises(TypeError, match=r"tensor 'b': dtype bool cannot be all-reduced"):
        sched.mark_ready(1, np.zeros(3, bool))
    with pytest.raises(TypeError, match=r"numpy array or a torch tensor.*got list"):
        sched.mark_ready(1, [0.0, 0.0, 0.0])
    with pytest.raises(TypeError, match=r"got float32"):
        sched.mark_ready(1, np.float32(0))
    # None of the rejected calls counted as a pass.
    sched.mark_ready(1, np.ones(3, np.float32))
    sched.mark_ready(0, np.ones((2, 3), np.float32))
    assert [o.sum() for o in sched.synchronize()] == [6.0, 3.0]


def test_use_before_init(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "_engine", None)
    with pytest.raises(NotInitializedError, match=r"before dp_plugin.init\(\)"):
        GradientScheduler([TensorSpec("w", (2,), "float32")])


def test_engine_defaults_to_the_runtime_one(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _one_rank()
    monkeypatch.setattr(runtime, "_engine", engine)
    sched = GradientScheduler([TensorSpec("w", (2,), "float32")])
    assert sched.engine is engine
    # The engine's config: an 8-byte gradient spread over 4 buckets, at the 1 MiB floor.
    assert sched.fusion_threshold == engine.config.first_bucket_threshold == 1 << 20


def test_fake_group_reports_mismatched_collectives() -> None:
    engines = make_thread_group(2, config=Config(timeout_s=5.0))

    def body(e: FakeEngine) -> None:
        buf = np.ones(2 + e.rank, np.float32)
        e.allreduce_async(buf, "sum", name=f"x{e.rank}").wait()

    outcomes = run_ranks_outcomes(engines, body)
    assert all(isinstance(o, DPPluginError) and "mismatch" in str(o) for o in outcomes)
