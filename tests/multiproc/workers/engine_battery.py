"""Worker: run every collective of one engine against a numpy reference.

Run under any launcher (see tests/multiproc/harness.py)::

    python engine_battery.py --engine gloo --case collectives   # prints "rank R OK"
    DP_PLUGIN_TIMEOUT=2 python engine_battery.py --engine gloo --case timeout
                                                # prints "rank R TIMEOUT-OK", then "rank R OK"
    python engine_battery.py --list-cases

Inputs are deterministic per rank, so every rank can compute the expected
result of a collective from all ranks' inputs without communicating. Any
failure prints a traceback and exits 1 at once (``os._exit``): the other
ranks then fail their next collective instead of waiting for this one.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _fail_fast import run_cases

from dp_plugin.agree import checked
from dp_plugin.config import Config
from dp_plugin.engines import create_engine
from dp_plugin.engines.base import Engine
from dp_plugin.errors import CollectiveTimeoutError, DPPluginError
from dp_plugin.launch.launchers import detect
from dp_plugin.reduce.arrays import as_numpy, as_torch, is_torch, numpy_dtype

FLOATS = ("float16", "bfloat16", "float32", "float64")
INTS = ("int8", "uint8", "int16", "int32", "int64")
DTYPES = FLOATS + INTS
N = 257  # odd, so no engine gets away with pairwise-only chunking


# -- inputs and reference ---------------------------------------------------

def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def make_input(rank: int, size: int, op: str, dtype: str, n: int = N) -> np.ndarray:
    """This rank's input for one case; values keep the reduction exact."""
    rng = np.random.default_rng(_seed(rank, op, dtype, n))
    npdt = numpy_dtype(dtype)
    if dtype in INTS:
        info = np.iinfo(npdt)
        if op == "product":
            choices = [1, 2, 3] if info.min == 0 else [-2, -1, 1, 2]
            values = rng.choice(choices, n)
        elif op == "sum":
            # Large magnitudes (int64 near 2**62 / size) catch a detour through float64.
            bound = info.max // (size + 1)
            low = 0 if info.min == 0 else -bound
            values = rng.integers(low, bound, n, endpoint=True)
        else:
            values = rng.integers(info.min, info.max, n, endpoint=True)
        return values.astype(npdt)
    if op == "product":
        values = rng.choice([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], n)
    elif op in ("sum", "average"):
        values = rng.integers(-32, 32, n) / 4.0  # quarters: exact in every float dtype
    else:
        values = rng.standard_normal(n) * 100
    return values.astype(npdt)


def reference(inputs: list[np.ndarray], op: str) -> np.ndarray:
    dtype = inputs[0].dtype
    if op == "average":
        stacked = np.stack([x.astype(np.float64) for x in inputs])
        return (stacked.sum(axis=0) / len(inputs)).astype(dtype)
    stacked = np.stack(inputs)
    reducers: dict[str, Callable[..., Any]] = {
        "sum": np.sum, "min": np.min, "max": np.max, "product": np.prod,
    }
    return np.asarray(reducers[op](stacked, axis=0)).astype(dtype)


class Setup:
    """Where buffers live: ``--device cpu`` tests numpy arrays and CPU torch
    tensors; ``--device cuda`` tests torch tensors on ``cuda:local_rank``."""

    device = "cpu"
    kinds: tuple[str, ...] = ("numpy", "torch")


def to_kind(arr: np.ndarray, kind: str) -> Any:
    """An independent buffer of ``kind`` holding ``arr``'s values."""
    if kind == "numpy":
        return arr.copy()
    return as_torch(arr.copy()).clone().to(Setup.device)


def host(buf: Any) -> np.ndarray:
    return as_numpy(buf.detach().cpu() if is_torch(buf) else buf)


def check_equal(what: str, got: Any, expected: np.ndarray, dtype: str, op: str) -> None:
    got_np = host(got)
    if got_np.shape != expected.shape:
        raise AssertionError(f"{what}: shape {got_np.shape} != expected {expected.shape}")
    if str(got_np.dtype) != str(expected.dtype):
        raise AssertionError(f"{what}: dtype {got_np.dtype} != expected {expected.dtype}")
    if dtype in INTS or (dtype in ("float32", "float64") and op != "average"):
        if not np.array_equal(got_np, expected):
            bad = np.flatnonzero(got_np != expected)[:5]
            raise AssertionError(f"{what}: mismatch at {bad}: got {got_np[bad]}, "
                                 f"expected {expected[bad]}")
        return
    rtol = {"float16": 1e-2, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}[dtype]
    g, e = got_np.astype(np.float64), expected.astype(np.float64)
    if not np.allclose(g, e, rtol=rtol, atol=rtol):
        bad = np.flatnonzero(~np.isclose(g, e, rtol=rtol, atol=rtol))[:5]
        raise AssertionError(f"{what}: mismatch at {bad}: got {g[bad]}, expected {e[bad]}")


def data_ptr(buf: Any) -> int:
    return int(buf.ctypes.data) if isinstance(buf, np.ndarray) else int(buf.data_ptr())


# -- the battery ---------------------------------------------------------------

def check_allreduce_all_ops(engine: Engine) -> int:
    rank, size = engine.rank, engine.size
    count = 0
    for kind in Setup.kinds:
        for dtype in DTYPES:
            for op in ("sum", "average", "min", "max", "product"):
                if op == "average" and dtype in INTS:
                    continue
                inputs = [make_input(r, size, op, dtype) for r in range(size)]
                buf = to_kind(inputs[rank], kind)
                ptr = data_ptr(buf)
                engine.allreduce_async(buf, op, name=f"{op}-{dtype}-{kind}").wait()
                what = f"allreduce {op} {dtype} {kind}"
                if data_ptr(buf) != ptr:
                    raise AssertionError(f"{what}: buffer was reallocated, not reduced in place")
                check_equal(what, buf, reference(inputs, op), dtype, op)
                count += 1
    return count


def check_empty(engine: Engine) -> None:
    for kind in Setup.kinds:
        for dtype in ("float32", "int64", "bfloat16"):
            empty = to_kind(np.zeros(0, dtype=numpy_dtype(dtype)), kind)
            for op in ("sum", "max") + (("average",) if dtype != "int64" else ()):
                engine.allreduce_async(empty, op, name=f"empty-{op}").wait()
            if tuple(empty.shape) != (0,):
                raise AssertionError(f"empty {kind} {dtype} buffer changed shape: {empty.shape}")
            engine.broadcast(empty, 0, name="empty-broadcast")


def check_large(engine: Engine) -> None:
    rank, size = engine.rank, engine.size
    n = 9 * 1024 * 1024 // 4 + 3  # > 8 MiB of float32, not a round number
    base = (np.arange(n, dtype=np.int64) % 7).astype(np.float32)
    expected = base * size + np.float32(sum(range(size)))
    for kind in Setup.kinds:
        buf = to_kind(base + np.float32(rank), kind)
        engine.allreduce_async(buf, "sum", name=f"large-{kind}").wait()
        check_equal(f"large allreduce {kind}", buf, expected, "float32", "sum")


def check_many_in_flight(engine: Engine) -> None:
    rank, size = engine.rank, engine.size
    cases = [("sum", "float32", "numpy"), ("max", "int64", "torch"),
             ("average", "float64", "numpy"), ("min", "int8", "torch"),
             ("product", "float32", "torch"), ("sum", "bfloat16", "numpy"),
             ("sum", "int32", "numpy"), ("average", "float16", "torch")]
    started = []
    for i, (op, dtype, kind) in enumerate(cases):
        kind = kind if kind in Setup.kinds else Setup.kinds[0]
        inputs = [make_input(r, size, op, dtype, n=1000 + i) for r in range(size)]
        buf = to_kind(inputs[rank], kind)
        handle = engine.allreduce_async(buf, op, name=f"inflight-{i}")
        started.append((handle, buf, reference(inputs, op), dtype, op, i))
    for handle, buf, expected, dtype, op, i in started:
        handle.wait()
        if not handle.done():
            raise AssertionError(f"in-flight {i}: done() is False after wait()")
        check_equal(f"in-flight allreduce {i} ({op} {dtype})", buf, expected, dtype, op)


def check_broadcast(engine: Engine) -> None:
    rank, size = engine.rank, engine.size
    for root in sorted({0, size - 1}):
        for kind in Setup.kinds:
            for dtype in ("float32", "int64", "bfloat16", "uint8", "int16"):
                values = [make_input(r, size, "max", dtype, n=33) for r in range(size)]
                buf = to_kind(values[rank], kind)
                ptr = data_ptr(buf)
                engine.broadcast(buf, root, name=f"bcast-{root}-{dtype}")
                what = f"broadcast root {root} {dtype} {kind}"
                if data_ptr(buf) != ptr:
                    raise AssertionError(f"{what}: buffer was reallocated")
                check_equal(what, buf, values[root], dtype, "max")


def _rows(rank: int, nrows: int, dtype: str) -> np.ndarray:
    values = np.arange(nrows * 3).reshape(nrows, 3) + 100 * rank
    return values.astype(numpy_dtype(dtype))


def check_allgather(engine: Engine) -> None:
    rank, size = engine.rank, engine.size
    layouts: dict[str, Callable[[int], int]] = {
        "r+1 rows": lambda r: r + 1,
        "r rows (rank 0 sends none)": lambda r: r,
        "no rows anywhere": lambda r: 0,
    }
    for label, nrows in layouts.items():
        for kind in Setup.kinds:
            for dtype in ("float32", "int64", "bfloat16", "int16"):
                parts = [_rows(r, nrows(r), dtype) for r in range(size)]
                expected = np.concatenate(parts)
                mine = to_kind(parts[rank], kind)
                got = checked.allgather(engine, mine, f"gather-{label}")
                what = f"allgather {label} {dtype} {kind}"
                if (kind == "torch") != (type(got).__module__.startswith("torch")):
                    raise AssertionError(f"{what}: returned a {type(got)}, expected {kind}")
                check_equal(what, got, expected, dtype, "max")
                if nrows(rank) and data_ptr(got) == data_ptr(mine):
                    raise AssertionError(f"{what}: result shares memory with the input")
    # 1-D input: uneven lengths too.
    parts_1d = [np.arange(r * 2 + 1, dtype=np.float64) for r in range(size)]
    got = checked.allgather(engine, to_kind(parts_1d[rank], Setup.kinds[0]), "gather-1d")
    check_equal("allgather 1-D", got, np.concatenate(parts_1d), "float64", "max")


def _error_of(fn: Callable[[], object], what: str = "") -> str:
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError(f"{what or fn} did not raise")


def _refusal(fn: Callable[[], object]) -> str:
    try:
        fn()
    except DPPluginError as exc:
        if isinstance(exc, CollectiveTimeoutError):
            raise
        return str(exc)
    raise AssertionError(f"{fn} did not raise")


def check_errors(engine: Engine) -> None:
    """Bad input fails with a clear message, identical on every rank, and
    leaves the engine usable."""
    size, rank = engine.size, engine.rank
    flat = to_kind(np.ones(4, dtype=np.float32), Setup.kinds[0])
    wide = 3 if rank == size - 1 else 2  # the last rank's rows are wider
    uneven = to_kind(np.zeros((rank + 1, wide), dtype=np.float32), Setup.kinds[0])
    ranks_named = [f"rank(s) {', '.join(map(str, range(size - 1)))} passed shape (*, 2)",
                   f"rank(s) {size - 1} passed shape (*, 3)"]
    cases = {
        "bad op": (lambda: engine.allreduce_async(flat, "mean"), ["'mean'", "average"]),
        "2-D buffer": (lambda: engine.allreduce_async(np.ones((2, 2), np.float32)),
                       ["(2, 2)", "1-D", "flatten"]),
        "root too big": (lambda: engine.broadcast(flat, size), [f"{size}", "root"]),
        "root negative": (lambda: engine.broadcast(flat, -1), ["-1", "root"]),
    }
    if size > 1:  # one rank's shapes cannot disagree (a one-GPU machine runs nccl at size 1)
        cases["allgather mismatch"] = (
            lambda: checked.allgather(engine, uneven, "mismatch"),
            ["Mismatched allgather tensor shapes for 'mismatch'", *ranks_named,
             "only the first may differ"])
    messages = []
    for label, (fn, needles) in cases.items():
        message = _error_of(fn, label)
        for needle in needles:
            if needle not in message:
                raise AssertionError(f"error for {label} lacks {needle!r}: {message}")
        messages.append(message)
    digest = np.frombuffer(hashlib.sha256("\n".join(messages).encode()).digest(), np.uint8)
    everyone = host(checked.allgather(engine, to_kind(digest, Setup.kinds[0]), "error-digests"))
    everyone = everyone.reshape(size, -1)
    if not (everyone == everyone[0]).all():
        raise AssertionError(f"error messages differ between ranks; mine: {messages}")
    # A 0-d all-gather input on the last rank only: every rank raises.
    scalar = np.zeros((), np.float32) if rank == size - 1 else np.zeros(2, np.float32)
    message = _error_of(lambda: checked.allgather(engine, to_kind(scalar, Setup.kinds[0]), "0d"),
                        "a 0-d all-gather input")
    # MismatchError, the one error of every agreement, is a ValueError (``_error_of``)
    if not message.startswith("MismatchError") or f"rank(s) [{size - 1}]" not in message:
        raise AssertionError(f"0-d all-gather input on rank {size - 1}: {message}")
    # Still usable after the errors.
    ok = to_kind(np.ones(4, dtype=np.float32), Setup.kinds[0])
    engine.allreduce_async(ok, "sum", name="after-errors").wait()
    check_equal("allreduce after errors", ok, np.full(4, size, np.float32), "float32", "sum")
    # Average of integers: the sum times 1/size, truncated (the one Average rule).
    ints = to_kind(np.array([1, -1, 2, 7], np.int32) * (rank + 1), Setup.kinds[0])
    engine.allreduce_async(ints, "average", name="int-average").wait()
    total = np.array([1, -1, 2, 7], np.float64) * (size * (size + 1) // 2)
    check_equal("int32 average", ints, np.trunc(total * (1.0 / size)).astype(np.int32),
                "int32", "average")


def case_collectives(engine: Engine) -> None:
    """All-reduce of every op x dtype, empty and > 8 MiB buffers, several in
    flight; broadcasts from every root; uneven all-gathers."""
    for check in (check_allreduce_all_ops, check_empty, check_large, check_many_in_flight,
                  check_broadcast, check_allgather):
        check(engine)
        engine.barrier()


def case_errors(engine: Engine) -> None:
    check_errors(engine)


def case_timeout(engine: Engine) -> None:
    """The last rank skips one all-reduce; every other rank must time out
    with an error naming the collective and itself, then exit promptly.
    Run with a short DP_PLUGIN_TIMEOUT; prints ``rank R TIMEOUT-OK``."""
    config = engine.config
    rank, size = engine.rank, engine.size
    engine.barrier()
    if rank == size - 1:
        time.sleep(config.timeout_s + 1)  # outlive the others' deadline, then leave
        print(f"rank {rank} TIMEOUT-OK (skipped the all-reduce)", flush=True)
        return
    buf = to_kind(np.ones(16, dtype=np.float32), Setup.kinds[0])
    started = time.monotonic()
    try:
        engine.allreduce_async(buf, "sum", name="bucket-7").wait()
    except CollectiveTimeoutError as exc:
        message = str(exc)
        waited = time.monotonic() - started
        for needle in ("bucket-7", f"rank {rank}", "DP_PLUGIN_TIMEOUT"):
            if needle not in message:
                raise AssertionError(f"timeout error lacks {needle!r}: {message}") from exc
        if waited > config.timeout_s + 30:
            raise AssertionError(f"timed out only after {waited:.1f} s") from exc
        # The timed-out all-reduce may still complete: the engine is broken.
        broken = _refusal(engine.barrier)
        for needle in ("bucket-7", "timed out", "Restart the job"):
            if needle not in broken:
                raise AssertionError(f"refusal after a timeout lacks {needle!r}: {broken}") from exc
        print(f"rank {rank} TIMEOUT-OK after {waited:.1f} s: {message}", flush=True)
        return
    raise AssertionError("the all-reduce finished although the last rank skipped it")


CASES = {
    "collectives": case_collectives,
    "errors": case_errors,
    "timeout": case_timeout,
}


def start_engine(args: argparse.Namespace, engine_class: type[Engine] | None = None) -> Engine:
    """The engine ``--engine`` names (or ``engine_class``), announced with its rendezvous."""
    topology = detect()
    if args.device == "cuda":
        Setup.device = f"cuda:{topology.local_rank}"
        Setup.kinds = ("torch",)
    config = Config.from_env()
    if engine_class is None:
        engine = create_engine(args.engine, topology, config)
    else:
        engine = engine_class(topology, config)  # type: ignore[call-arg]
    want_device = Setup.device if args.device == "cuda" else "cpu"
    if engine.buffer_device != want_device:
        raise AssertionError(f"buffer_device {engine.buffer_device}, want {want_device}")
    via = getattr(engine, "rendezvous_description", "no rendezvous")
    print(f"rank {topology.rank} engine {engine.name} under {topology.launcher}, size "
          f"{topology.size}, rendezvous: {via}, shared memory: "
          f"{getattr(engine, 'shared_memory', False)}", flush=True)
    return engine


def battery_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return parser


if __name__ == "__main__":
    run_cases(CASES, parser=battery_parser(), setup=start_engine,
              teardown=lambda engine: engine.shutdown())
