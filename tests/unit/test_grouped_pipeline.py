"""A one-shot fused collective (``fused_collective``) travels in chunks of
``PIPELINE_CHUNK`` bytes, each with a buffer of its own, so every chunk is
packed and on its way before the first one finishes: packing and
unpacking overlap the transfer instead of running before and after it."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from dp_plugin.engines.base import ReduceOp
from dp_plugin.reduce import collective
from dp_plugin.reduce.arrays import NumpyOps
from dp_plugin.reduce.collective import fused_collective
from dp_plugin.reduce.fusion import TensorSpec, plan_buckets
from dp_plugin.reduce.hooks import ReducePolicy, allreduce_hook
from dp_plugin.reduce.reducer import GradientScheduler
from tests.unit.fakes import FakeEngine, make_thread_group, run_ranks

# 10 tensors of 64 bytes, one of 400; chunks of 128 bytes.
SPECS = [TensorSpec(f"t{i}", (16,), "float32") for i in range(10)]
SPECS.insert(4, TensorSpec("big", (100,), "float32"))
CHUNK = 128


def data(rank: int, spec: TensorSpec) -> np.ndarray:
    rng = np.random.default_rng([rank, spec.numel, len(spec.name), ord(spec.name[-1])])
    return rng.integers(-8, 9, spec.numel).astype(np.float32)


def test_every_chunk_is_in_flight_before_the_first_completes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 starts only after rank 0 has started every chunk: with chunks
    that waited for a slab (or one bucket for everything), rank 0 could not
    start them all while none can complete."""
    monkeypatch.setattr(collective, "PIPELINE_CHUNK", CHUNK)
    engines = make_thread_group(2)
    rank0_started = threading.Event()

    def body(e: FakeEngine) -> tuple[int, list[np.ndarray]]:
        outs = [data(e.rank, s) for s in SPECS]
        if e.rank == 1:
            assert rank0_started.wait(20), "rank 0 blocked while starting its chunks"
        fused = fused_collective(outs, engine=e, name="grouped",
                                 policy=ReducePolicy(ReduceOp.AVERAGE, e.size))
        if e.rank == 0:
            assert not any(h.done() for h in fused.handles)
            rank0_started.set()
        fused.finish()
        return len(fused.handles), outs

    results = run_ranks(engines, body)
    for buckets, outs in results:
        # 2 x 64 per chunk before and after the big one (its own): 2 + 1 + 3.
        assert buckets == 6
        for spec, out in zip(SPECS, outs, strict=True):
            np.testing.assert_array_equal(out, (data(0, spec) + data(1, spec)) / 2,
                                          err_msg=spec.name)
    np.testing.assert_array_equal(np.concatenate(results[0][1]), np.concatenate(results[1][1]))


def test_a_gradient_reducer_keeps_its_buckets_and_slabs() -> None:
    """Gradients take turns on slabs; only the tensor over the threshold has
    a buffer of its own (the one-shot chunks above all have one)."""
    fused = GradientScheduler(SPECS, engine=make_thread_group(1)[0], name="bucketed",
                              fusion_threshold=CHUNK, array_ops=NumpyOps())
    assert [b.pinned for b in fused.buckets] == [b.names == ("big",) for b in fused.buckets]
    assert len(fused.buckets) == 6 and fused.slabs


def test_a_large_tensor_travels_alone_without_closing_the_open_bucket() -> None:
    """``alone_from``: the 400-byte tensor gets a bucket of its own and the
    small ones on either side of it still share one (without the rule, the
    large tensor closes the bucket and the last small one opens another)."""
    specs = [TensorSpec("a", (8,), "float32"), TensorSpec("b", (8,), "float32"),
             TensorSpec("big", (100,), "float32"), TensorSpec("c", (8,), "float32")]
    assert [b.members for b in plan_buckets(specs, 128, order=range(4))] == [(0, 1), (2,), (3,)]
    alone = plan_buckets(specs, 128, order=range(4), alone_from=256)
    assert [b.members for b in alone] == [(0, 1, 3), (2,)]
    assert [b.offsets for b in alone] == [(0, 8, 16), (0,)]


def test_a_grouped_collective_reduces_its_large_tensors_where_they_lie(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collective, "PIPELINE_CHUNK", CHUNK)
    monkeypatch.setattr(collective, "DIRECT_BYTES", 256)
    seen: list[tuple[tuple[str, ...], Any]] = []

    def recording(state: Any, bucket: Any) -> Any:
        seen.append((bucket.names, bucket.buffer()))
        return allreduce_hook(state, bucket)

    outs = [data(0, s) for s in SPECS]
    fused_collective(outs, engine=make_thread_group(1)[0], name="grouped", hook=recording,
                     names=[s.name for s in SPECS]).finish()
    assert [len(names) for names, _ in seen] == [2, 2, 1, 2, 2, 2]
    big = [flat for names, flat in seen if names == ("big",)]
    assert len(big) == 1 and np.shares_memory(big[0], outs[4])


@pytest.mark.parametrize("size", [2, 3])
def test_out_of_place_equals_in_place_and_only_reads_its_sources(
        monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """``fused_collective(outputs, sources=...)``: the tensors that travel alone are copied
    into their outputs, the small ones packed from the sources and unpacked
    into the outputs; the results are bitwise those of the in-place run, and
    the sources are never written."""
    monkeypatch.setattr(collective, "PIPELINE_CHUNK", CHUNK)
    monkeypatch.setattr(collective, "DIRECT_BYTES", 256)
    specs = [*SPECS, TensorSpec("wide", (40,), "float64"), TensorSpec("ints", (70,), "int32"),
             TensorSpec("few", (3,), "int32")]

    def values(rank: int, spec: TensorSpec) -> np.ndarray:
        return data(rank, spec).astype(spec.dtype)

    def body(e: FakeEngine) -> tuple[list[np.ndarray], list[np.ndarray]]:
        def run(outs: list[np.ndarray], sources: list[np.ndarray] | None = None) -> None:
            fused_collective(outs, engine=e, name="grouped", names=[s.name for s in specs],
                             policy=ReducePolicy(ReduceOp.SUM, e.size, prescale=0.5,
                                                 postscale=3.0), sources=sources).finish()
        sources = [values(e.rank, s) for s in specs]
        outs = [np.full(s.shape, np.nan if s.dtype != "int32" else -1, s.dtype) for s in specs]
        run(outs, sources)
        for spec, source in zip(specs, sources, strict=True):
            np.testing.assert_array_equal(source, values(e.rank, spec), err_msg=spec.name)
        inplace = [values(e.rank, s) for s in specs]
        run(inplace)
        return outs, inplace

    results = run_ranks(make_thread_group(size), body)
    for outs, inplace in results:
        for spec, out, same in zip(specs, outs, inplace, strict=True):
            assert out.dtype == same.dtype and out.shape == same.shape
            np.testing.assert_array_equal(out, same, err_msg=spec.name)
            if spec.dtype == "float32":
                want = sum(data(r, spec) * 0.5 for r in range(size)) * 3.0
                np.testing.assert_allclose(out, want, rtol=1e-6, err_msg=spec.name)
        for out, first in zip(outs, results[0][0], strict=True):
            np.testing.assert_array_equal(out, first)
