"""Worker: GradientScheduler on a real engine, against a numpy reference.

Run under any launcher (see tests/multiproc/harness.py)::

    python scheduler_worker.py --engine gloo --case reference   # prints "rank R OK"
    python scheduler_worker.py --engine mpi --case mismatch     # "rank R MISMATCH-OK", "rank R OK"

``reference`` runs many schedules (numpy and torch tensors; average with a
predivide factor, sum over integers too, fp16/bf16 compression, gradient
accumulation, a missing gradient, per-rank readiness order), each for
several steps over ~20 tensors of mixed dtypes and shapes with a threshold
that forces many buckets. Inputs are deterministic per (rank, step, tensor),
so every rank computes the expected result locally.

``mismatch``: the last rank registers one tensor with another shape; every
rank must raise ``LayoutMismatchError`` naming it. Any failure prints a
traceback and exits 1 at once (``os._exit``): the other ranks then fail
their next collective (``DP_PLUGIN_TIMEOUT``) instead of waiting.
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from _fail_fast import run_cases

from dp_plugin.config import Config
from dp_plugin.engines import create_engine
from dp_plugin.engines.base import Engine
from dp_plugin.errors import LayoutMismatchError
from dp_plugin.launch.launchers import detect
from dp_plugin.reduce.arrays import as_numpy, as_torch, numpy_dtype
from dp_plugin.reduce.fusion import TensorSpec
from dp_plugin.reduce.reducer import GradientScheduler

STEPS = 4
THRESHOLD = 256  # bytes: many buckets; several tensors exceed it on their own
SHAPES: list[tuple[int, ...]] = [
    (8, 4), (), (17,), (0,), (3, 5, 2), (40,), (1,), (2, 0, 3), (64,), (5, 5),
    (9,), (2, 2, 2, 2), (100,), (3,), (7, 3), (1, 1), (33,), (0,), (12,), (4, 4),
]
FLOATS = ("float32", "float64", "float16", "bfloat16")
MIXED = ("float32", "float16", "int32", "float64", "bfloat16", "int64", "int8", "float32")
REDUCE: dict[str, Callable[..., Any]] = {"sum": np.sum, "average": np.mean, "max": np.max}
RTOL = {"float64": 1e-12, "float32": 1e-6, "float16": 2e-3, "bfloat16": 1e-2}


@dataclass(frozen=True)
class Case:
    name: str
    dtypes: Sequence[str]
    op: str = "average"
    kwargs: dict[str, Any] = field(default_factory=dict)
    scale: float = 1.0
    """Expected result = reference(op) * scale (user pre/post factors)."""
    passes: int = 1
    missing: int | None = None
    """Spec index that the last rank never marks ready (it contributes zeros)."""


SCHEDULES = [
    Case("average", FLOATS, kwargs={"gradient_predivide_factor": 2.0}),
    Case("sum-mixed", MIXED, op="sum"),
    Case("sum-scaled", FLOATS, op="sum", kwargs={"prescale_factor": 0.5,
                                                 "postscale_factor": 4.0}, scale=2.0),
    Case("max", MIXED, op="max"),
    Case("fp16", ("float32", "float64", "int32"), op="sum", kwargs={"compression": "fp16"}),
    Case("bf16", ("float32", "float64"), op="sum", kwargs={"compression": "bf16"}),
    Case("accumulate", FLOATS, passes=2, kwargs={"backward_passes_per_step": 2}),
    Case("missing", MIXED, op="sum", missing=5),
]


def specs_for(case: Case, shapes: Sequence[tuple[int, ...]] = SHAPES) -> list[TensorSpec]:
    return [TensorSpec(f"layer{i}", s, case.dtypes[i % len(case.dtypes)])
            for i, s in enumerate(shapes)]


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def grad(rank: int, step: int, i: int, spec: TensorSpec, p: int = 0) -> np.ndarray:
    """Pass ``p`` of one gradient: quarters (ints for integer dtypes), exact everywhere."""
    rng = np.random.default_rng(_seed(rank, step, i, p))
    if spec.dtype in FLOATS:
        raw = np.asarray(rng.integers(-8, 9, size=spec.shape) / 4)
    else:
        raw = np.asarray(rng.integers(-9, 10, size=spec.shape))
    return raw.astype(numpy_dtype(spec.dtype))


def contribution(case: Case, rank: int, size: int, step: int, i: int,
                 spec: TensorSpec) -> np.ndarray:
    """What ``rank`` hands to the scheduler for tensor ``i`` (accumulated passes)."""
    if case.missing == i and rank == size - 1:
        return np.zeros(spec.shape, numpy_dtype(spec.dtype))
    total = grad(rank, step, i, spec).astype(np.float64)
    for p in range(1, case.passes):
        total += grad(rank, step, i, spec, p)
    return total.astype(numpy_dtype(spec.dtype))


def expected(case: Case, size: int, step: int, i: int, spec: TensorSpec) -> np.ndarray:
    stack = np.stack([contribution(case, r, size, step, i, spec).astype(np.float64)
                      for r in range(size)])
    return (REDUCE[case.op](stack, axis=0) * case.scale).astype(numpy_dtype(spec.dtype))


def ready_order(rank: int, step: int, count: int) -> list[int]:
    """Each rank, each step, reports readiness in its own order."""
    rng = np.random.default_rng(_seed("order", rank, step))
    return [int(i) for i in rng.permutation(count)]


def to_kind(arr: np.ndarray, kind: str) -> Any:
    return arr.copy() if kind == "numpy" else as_torch(arr.copy()).clone()


def check(what: str, got: Any, want: np.ndarray, dtype: str) -> None:
    g = as_numpy(got)
    if g.shape != want.shape or g.dtype != want.dtype:
        raise AssertionError(f"{what}: got {g.shape} {g.dtype}, expected {want.shape} "
                             f"{want.dtype}")
    rtol = RTOL.get(dtype, 0.0)
    a, b = g.astype(np.float64), want.astype(np.float64)
    if not np.allclose(a, b, rtol=rtol, atol=rtol):
        bad = np.flatnonzero(~np.isclose(a, b, rtol=rtol, atol=rtol))[:5]
        raise AssertionError(f"{what}: mismatch at {bad}: got {a.ravel()[bad]}, "
                             f"expected {b.ravel()[bad]}")


def run_case(engine: Engine, case: Case, kind: str) -> None:
    rank, size = engine.rank, engine.size
    specs = specs_for(case)
    sched = GradientScheduler(specs, engine=engine, op=case.op, fusion_threshold=THRESHOLD,
                              name=f"{case.name}-{kind}", **case.kwargs)
    try:
        for step in range(STEPS):
            grads = [to_kind(np.zeros(s.shape, numpy_dtype(s.dtype)), kind) for s in specs]
            for p in range(case.passes):
                for i in ready_order(rank, step * case.passes + p, len(specs)):
                    if case.missing == i and rank == size - 1:
                        continue
                    # Accumulate like autograd does into .grad, then report.
                    acc = as_numpy(grads[i]).astype(np.float64) + grad(rank, step, i,
                                                                      specs[i], p)
                    as_numpy(grads[i])[...] = acc.astype(numpy_dtype(specs[i].dtype))
                    sched.mark_ready(i, grads[i])
            out = sched.synchronize()
            for i, spec in enumerate(specs):
                check(f"{case.name}/{kind} step {step} {spec.name} ({spec.dtype}, "
                      f"{spec.shape})", out[i], expected(case, size, step, i, spec),
                      spec.dtype)
        if len(sched.plan) < 5:
            raise AssertionError(f"{case.name}: expected many buckets, got {len(sched.plan)}")
        last = sched.stats.last
        if last is None or last.step != STEPS - 1 or last.bytes_reduced <= 0:
            raise AssertionError(f"{case.name}: unexpected stats {last}")
    finally:
        sched.close()


def run_all(engine: Engine) -> None:
    for kind in ("numpy", "torch"):
        for case in SCHEDULES:
            run_case(engine, case, kind)
    engine.barrier()


def run_mismatch(engine: Engine) -> str:
    rank, size = engine.rank, engine.size
    case = Case("mismatch", FLOATS)
    shapes = list(SHAPES)
    if rank == size - 1:
        shapes[6] = (2,)
    specs = specs_for(case, shapes)
    sched = GradientScheduler(specs, engine=engine, fusion_threshold=THRESHOLD,
                              name="mismatch")
    try:
        for i in ready_order(rank, 0, len(specs)):
            sched.mark_ready(i, np.zeros(specs[i].shape, numpy_dtype(specs[i].dtype)))
        sched.synchronize()
    except LayoutMismatchError as exc:
        message = str(exc)
        for needle in (f"rank {rank}:", "'layer6' shape (1,)", f"rank(s) {size - 1} have",
                       "'layer6' shape (2,)", "same order"):
            if needle not in message:
                raise AssertionError(f"mismatch error lacks {needle!r}: {message}") from exc
        engine.barrier()  # every rank got here: nobody is left waiting
        return message
    raise AssertionError("no LayoutMismatchError although the last rank's layout differs")


def case_reference(engine: Engine) -> None:
    run_all(engine)


def case_mismatch(engine: Engine) -> None:
    message = run_mismatch(engine)
    print(f"rank {engine.rank} MISMATCH-OK: {message}", flush=True)


def case_prefused(engine: Engine) -> None:
    """Four 2 MiB buckets, all ready at once, for five steps: averaged right.
    Under horovodrun the test reads Horovod's timeline: its library must not
    copy these pre-fused buckets into its own fusion buffer again."""
    grads = [np.full(1 << 19, float(engine.rank + i), dtype=np.float32) for i in range(4)]
    sched = GradientScheduler([TensorSpec.of(f"p{i}", g) for i, g in enumerate(grads)],
                              engine=engine, fusion_threshold=2 << 20, name="prefused")
    if len(sched.plan) != 4:
        raise AssertionError(f"expected 4 buckets of 2 MiB, got {len(sched.plan)}")
    mean_rank = (engine.size - 1) / 2
    for step in range(5):
        for i in reversed(range(4)):
            grads[i][:] = engine.rank + i + step
            sched.mark_ready(i, grads[i])
        for i, out in enumerate(sched.synchronize()):
            if not np.all(as_numpy(out) == mean_rank + i + step):
                raise AssertionError(f"step {step}, bucket {i}: not the average")
    sched.close()


CASES = {
    "reference": case_reference,
    "mismatch": case_mismatch,
    "prefused": case_prefused,
}


def start(args: argparse.Namespace) -> Engine:
    return create_engine(args.engine, detect(), Config.from_env())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", required=True)
    run_cases(CASES, parser=parser, setup=start, teardown=lambda engine: engine.shutdown())
