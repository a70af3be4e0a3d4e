"""alltoall, reducescatter and subgroup without processes.

The local engine (world size 1) covers the public API and input validation;
the in-process thread group of tests/unit/fakes.py (3 ranks as threads)
covers the base class's generic paths — all-to-all through all-gather,
reduce-scatter through all-reduce — and that a mistake on one rank raises on
every rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dp_plugin.agree import checked
from dp_plugin.agree.agreement import AGREE_NAME
from dp_plugin.config import Config
from dp_plugin.engines import base
from dp_plugin.engines.base import ReduceOp
from dp_plugin.engines.local import LocalEngine
from dp_plugin.launch.launchers import Topology
from tests.unit.fakes import FakeEngine, make_thread_group, run_ranks, run_ranks_outcomes

torch = pytest.importorskip("torch")


def _local() -> LocalEngine:
    return LocalEngine(Topology.single(), Config())


def _kind(arr: np.ndarray, kind: str) -> Any:
    return arr.copy() if kind == "numpy" else torch.from_numpy(arr.copy())


# -- local engine ------------------------------------------------------------

@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("splits", [None, [3], "tensor"])
def test_local_alltoall_returns_a_copy_and_the_counts(kind: str, splits: Any) -> None:
    engine = _local()
    data = np.arange(6, dtype=np.float32).reshape(3, 2)
    buf = _kind(data, kind)
    if splits == "tensor":
        splits = torch.tensor([3])
    out, received = checked.alltoall(engine, buf, splits)
    assert received == [3]
    assert type(out) is type(buf)
    np.testing.assert_array_equal(np.asarray(out), data)
    out[0, 0] = 99  # a new buffer: the input is untouched
    np.testing.assert_array_equal(np.asarray(buf), data)


@pytest.mark.parametrize(
    ("splits", "needle"),
    [
        ([1, 2], "has 2 entries but there are 1 ranks"),
        ([-1], "negative"),
        ([4], "sums to 4 but the buffer's first dimension is 3"),
        ([1.5], "must be ints"),
        (["3"], "must be ints"),
    ],
)
def test_local_alltoall_rejects_bad_splits(splits: Any, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as info:
        checked.alltoall(_local(), np.zeros(3, np.float32), splits, name="tokens")
    assert "alltoall 'tokens' cannot run" in str(info.value)
    assert "rank(s) [0] passed invalid splits" in str(info.value)


def test_local_alltoall_rejects_bad_buffers() -> None:
    engine = _local()
    with pytest.raises(ValueError, match=r"0-dim tensor.*reshape it to \(1,\)"):
        checked.alltoall(engine, np.zeros((), np.float32))
    with pytest.raises(TypeError, match="dtype complex64, which collectives do not support"):
        checked.alltoall(engine, np.zeros(3, np.complex64))
    # Any number of dimensions: the agreement describes them all.
    assert checked.alltoall(engine, np.zeros((1,) * 10, np.float32))[0].shape == (1,) * 10


@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_local_reducescatter_is_a_copy_of_the_input(op: ReduceOp, kind: str) -> None:
    data = np.arange(12, dtype=np.float64).reshape(4, 3)
    buf = _kind(data, kind)
    out = checked.reducescatter(_local(), buf, op)
    assert type(out) is type(buf)
    np.testing.assert_array_equal(np.asarray(out), data)
    out[0, 0] = -1
    np.testing.assert_array_equal(np.asarray(buf), data)


def test_local_reducescatter_validation() -> None:
    engine = _local()
    with pytest.raises(ValueError, match="'mean' is not known"):
        checked.reducescatter(engine, np.ones(2, np.float32), "mean")
    with pytest.raises(TypeError, match="dtype bool, which collectives do not support"):
        checked.reducescatter(engine, np.ones(2, bool), "sum")
    with pytest.raises(ValueError, match="0-dim tensor"):
        checked.reducescatter(engine, np.ones((), np.float32))


def test_local_subgroup_of_rank_zero_runs_every_collective() -> None:
    engine = _local()
    group = checked.subgroup(engine, [0], name="solo")
    assert group is not None and group is not engine
    assert (group.rank, group.size, group.global_ranks) == (0, 1, (0,))
    buf = np.ones(3, np.float32)
    group.allreduce_async(buf, "average").wait()
    group.broadcast(buf, 0)
    assert checked.allgather(group, buf).shape == (3,)
    group.barrier()
    assert checked.alltoall(group, np.ones((2, 2), np.float32))[1] == [2]
    assert checked.reducescatter(group, np.ones((2, 2), np.float32)).shape == (2, 2)
    group.shutdown()
    engine.allreduce_async(buf).wait()  # the parent is unaffected


@pytest.mark.parametrize(
    ("ranks", "needle"),
    [
        ([1], r"must lie in 0\.\.0"),
        ([], "ranks is empty"),
        ([0, 0], "must be sorted and unique"),
        (["0"], "must be ints"),
        (7, "not a sequence of ints"),
    ],
)
def test_subgroup_validation(ranks: Any, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as info:
        checked.subgroup(_local(), ranks, name="ps")
    assert "subgroup 'ps'" in str(info.value)


# -- pure helpers --------------------------------------------------------------

@pytest.mark.parametrize(
    ("rows", "size", "counts"),
    [(6, 3, [2, 2, 2]), (5, 3, [2, 2, 1]), (4, 3, [2, 1, 1]), (1, 3, [1, 0, 0]),
     (0, 2, [0, 0]), (7, 2, [4, 3])],
)
def test_reducescatter_counts_follow_horovod(rows: int, size: int, counts: list[int]) -> None:
    # Horovod 0.28.1: rows // size each, the first rows % size ranks one more.
    assert base.reducescatter_counts(rows, size) == counts


def test_group_topology_counts_members_per_host() -> None:
    parent = Topology(launcher="torchrun", rank=3, size=4, local_rank=1, local_size=2,
                      cross_rank=1, cross_size=2)
    hosts = [10, 10, 20, 20]  # ranks 0,1 on one host, 2,3 on another
    topo = base.group_topology(parent, (1, 2, 3), 3, hosts)
    assert (topo.rank, topo.size) == (2, 3)
    assert (topo.local_rank, topo.local_size) == (1, 2)  # rank 2 is before it on its host
    assert (topo.cross_rank, topo.cross_size) == (0, 1)  # the only member with local rank 1


# -- generic paths on three ranks (threads) --------------------------------------

def _send_counts(rank: int, size: int) -> list[int]:
    return [(rank + 2 * j) % 3 for j in range(size)]


def _rows(rank: int, rows: int) -> np.ndarray:
    return (rank * 100 + np.arange(rows * 2, dtype=np.float32)).reshape(rows, 2)


def test_generic_alltoall_uneven_with_zero_rows() -> None:
    engines = make_thread_group(3)

    def body(engine: FakeEngine) -> tuple[Any, list[int]]:
        mine = _send_counts(engine.rank, 3)
        buf = _kind(_rows(engine.rank, sum(mine)), "torch")
        return checked.alltoall(engine, buf, mine, name="a2a")

    for me, (out, received) in enumerate(run_ranks(engines, body)):
        want = []
        for src in range(3):
            theirs = _send_counts(src, 3)
            start = sum(theirs[:me])
            want.append(_rows(src, sum(theirs))[start:start + theirs[me]])
        assert received == [_send_counts(src, 3)[me] for src in range(3)]
        assert torch.is_tensor(out)
        np.testing.assert_array_equal(out.numpy(), np.concatenate(want))


@pytest.mark.parametrize("op", ["sum", "average", "max"])
def test_generic_reducescatter_uneven_rows(op: str) -> None:
    engines = make_thread_group(3)
    rows = 5  # ranks get 2, 2 and 1 rows

    def body(engine: FakeEngine) -> Any:
        return checked.reducescatter(engine, _rows(engine.rank, rows), op, name="rs")

    inputs = np.stack([_rows(r, rows) for r in range(3)])
    reduced = {"sum": inputs.sum(0), "average": inputs.sum(0) / 3, "max": inputs.max(0)}[op]
    outs = run_ranks(engines, body)
    np.testing.assert_allclose(np.concatenate(outs), reduced.astype(np.float32), rtol=1e-6)
    assert [o.shape[0] for o in outs] == [2, 2, 1]


def test_a_mistake_on_one_rank_raises_on_every_rank() -> None:
    engines = make_thread_group(3)

    def body(engine: FakeEngine) -> Any:
        splits = [2, 2] if engine.rank == 1 else [2, 2, 2]  # only rank 1 errs
        return checked.alltoall(engine, np.zeros((6, 2), np.float32), splits, name="a2a")

    outcomes = run_ranks_outcomes(engines, body)
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, ValueError), outcome
        assert "rank(s) [1] passed invalid splits" in str(outcome)
        # Only the rank at fault knows the detail; the others point to it.
        assert ("has 2 entries" in str(outcome)) == (rank == 1)


@pytest.mark.parametrize("mistake", ["bool", "splits"])
def test_a_mistake_every_rank_makes_is_blamed_on_every_rank(mistake: str) -> None:
    """When every rank made the same mistake the digests agree, only this
    rank's description was at hand, and the message blamed "rank(s) [0]"."""
    engines = make_thread_group(3)

    def body(engine: FakeEngine) -> Any:
        if mistake == "bool":
            return checked.reducescatter(engine, np.zeros((6, 2), bool), name="flags")
        return checked.alltoall(engine, np.zeros((6, 2), np.float32), [3, 3], name="a2a")

    said = ("every rank passed a tensor of dtype bool" if mistake == "bool"
            else "every rank passed invalid splits")
    for outcome in run_ranks_outcomes(engines, body):
        assert isinstance(outcome, TypeError if mistake == "bool" else ValueError), outcome
        assert said in str(outcome) and "rank(s)" not in str(outcome), str(outcome)


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("dtype", "Mismatched alltoall tensor types for 'alltoall'"),
        ("trailing", "same dimensions after the first"),
        ("rs-shape", "Every rank must pass the same shape"),
        ("rs-op", "Mismatched reducescatter tensor reduce ops"),
        ("members", "Mismatched subgroup members for 'process_set': rank(s) 0, 1 passed "
                    "ranks [0, 1]; rank(s) 2 passed ranks [0]"),
        ("ag-dtype", "rank(s) 2 passed a float64 tensor"),
        ("ag-trailing", "only the first may differ"),
    ],
)
def test_mismatches_between_ranks_raise_everywhere(case: str, needle: str) -> None:
    engines = make_thread_group(3)

    def body(engine: FakeEngine) -> Any:
        odd = engine.rank == 2
        if case == "dtype":
            return checked.alltoall(engine, np.zeros(3, np.float64 if odd else np.float32))
        if case == "trailing":
            return checked.alltoall(engine, np.zeros((3, 3 if odd else 2), np.float32))
        if case == "rs-shape":
            return checked.reducescatter(engine, np.zeros(4 if odd else 3, np.float32))
        if case == "rs-op":
            return checked.reducescatter(engine, np.zeros(3, np.float32), "min" if odd else "sum")
        if case == "ag-dtype":  # uneven first dimensions are fine, dtypes must agree
            rows = engine.rank + 2
            return checked.allgather(engine, np.zeros((rows, 2), np.float64 if odd else np.float32))
        if case == "ag-trailing":
            return checked.allgather(engine, np.zeros((engine.rank, 3 if odd else 2), np.float32))
        return checked.subgroup(engine, [0] if odd else [0, 1])

    outcomes = run_ranks_outcomes(engines, body)
    for outcome in outcomes:
        assert isinstance(outcome, ValueError), outcome
        assert needle in str(outcome)
    assert len({str(o) for o in outcomes}) == 1, "every rank must raise the same error"
    if case.startswith("ag-"):  # all-gather names every rank's buffer and the fix
        text = str(outcomes[0])
        assert "rank(s) 0, 1 passed" in text and "rank(s) 2 passed" in text, text
        assert "Every rank must pass the same" in text


def test_allgather_of_uneven_rows_agrees_first() -> None:
    engines = make_thread_group(3)

    def body(engine: FakeEngine) -> Any:
        buf = np.full((engine.rank, 2), engine.rank, np.int32)
        return checked.allgather(engine, buf, name="ag")

    expected = np.concatenate([np.full((r, 2), r, np.int32) for r in range(3)])
    for outcome in run_ranks_outcomes(engines, body):
        np.testing.assert_array_equal(outcome, expected)
    # One agreement (an all-reduce of every rank's 14-word row), then the rows
    # (rows x 2 x 4 B).
    agreed = ("allreduce", AGREE_NAME, 3 * 14 * 8)
    assert all(e.log == [agreed, ("allgather", "ag", 8 * e.rank)] for e in engines)


def test_an_engine_without_subgroups_says_so_on_every_rank() -> None:
    engines = make_thread_group(2)
    for outcome in run_ranks_outcomes(engines, lambda e: checked.subgroup(e, [0], name="ps")):
        assert isinstance(outcome, NotImplementedError)
        assert "the fake engine cannot create process sets" in str(outcome)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["bool", "uint16"])
def test_gather_and_alltoall_move_every_horovod_dtype(kind: str, dtype: str) -> None:
    """Horovod all-gathers bool and uint16; the engines move them as raw bytes."""
    engines = make_thread_group(3)

    def data(rank: int, rows: int) -> np.ndarray:
        values = (rank * 7 + np.arange(rows * 3)).reshape(rows, 3)
        return (values % 2 == 0) if dtype == "bool" else (values * 1000 + 3).astype(np.uint16)

    def body(engine: FakeEngine) -> Any:
        gathered = checked.allgather(engine, _kind(data(engine.rank, engine.rank), kind), "ag")
        splits = [engine.rank] * 3  # rank r sends r rows to everyone (rank 0: none)
        received, counts = checked.alltoall(engine, _kind(data(engine.rank, 3 * engine.rank),
                                                          kind), splits, "a2a")
        return gathered, received, counts

    for me, (gathered, received, counts) in enumerate(run_ranks(engines, body)):
        assert str(gathered.dtype).removeprefix("torch.") == dtype
        np.testing.assert_array_equal(np.asarray(gathered),
                                      np.concatenate([data(r, r) for r in range(3)]))
        want = np.concatenate([data(r, 3 * r)[me * r:(me + 1) * r] for r in range(3)])
        assert counts == [0, 1, 2] and received.shape == (3, 3)
        np.testing.assert_array_equal(np.asarray(received), want)


def test_integer_average_reducescatter_truncates_like_allreduce() -> None:
    """op=average of int32 is the sum times 1/size in double precision,
    truncated toward zero: the rule of the all-reduce (ReducePolicy)."""
    engines = make_thread_group(3)
    inputs = [np.array([[7], [-7], [5], [1]], np.int32) * (r + 1) for r in range(3)]

    def body(engine: FakeEngine) -> Any:
        return checked.reducescatter(engine, inputs[engine.rank].copy(), "average", "rs")

    total = sum(inputs).astype(np.float64)
    expected = np.trunc(total * (1.0 / 3)).astype(np.int32)
    np.testing.assert_array_equal(np.concatenate(run_ranks(engines, body)), expected)


def test_engine_average_is_the_policy_average() -> None:
    """The engine's op=average and ReducePolicy's Average round alike (bitwise)."""
    from dp_plugin.reduce.arrays import NumpyOps
    from dp_plugin.reduce.hooks import ReducePolicy

    engines = make_thread_group(3)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(1000).astype(np.float32) for _ in range(3)]

    def body(engine: FakeEngine) -> Any:
        buf = inputs[engine.rank].copy()
        engine.allreduce_async(buf, "average", name="avg").wait()
        return buf

    policy = ReducePolicy("average", 3)
    summed = inputs[0] + inputs[1] + inputs[2]
    NumpyOps().scale_(summed, policy.postscale)
    for out in run_ranks(engines, body):
        np.testing.assert_array_equal(out, summed)


def test_float16_scales_in_float32_like_horovod_and_torch() -> None:
    """NumpyOps (TensorFlow's path) scales float16 in float32, rounding once:
    bitwise what torch's half multiply and Horovod's ScaleBuffer give."""
    from dp_plugin.reduce.arrays import NumpyOps, TorchOps

    halves = np.random.default_rng(1).standard_normal(20000).astype(np.float16)
    for factor in (0.1, 0.3, 1 / 3, 7.7):
        numpy_out = halves.copy()
        NumpyOps().scale_(numpy_out, factor)
        torch_out = torch.from_numpy(halves.copy())
        TorchOps().scale_(torch_out, factor)
        horovod = (halves.astype(np.float32) * np.float32(factor)).astype(np.float16)
        np.testing.assert_array_equal(numpy_out, horovod)
        np.testing.assert_array_equal(torch_out.numpy(), horovod)


class _FoldingEngine(LocalEngine):
    """One rank whose reduction scales float32 (as gloo on shared memory)."""

    folded_calls = 0

    def scaled_sum_async(self, buf: Any, factor: float, name: str = "allreduce") -> Any:
        if buf.dtype != np.float32:
            return None
        type(self).folded_calls += 1
        buf *= np.float32(factor)
        return self._done(self.describe("allreduce", name))


@pytest.mark.parametrize("wrapped", [False, True])
def test_the_allreduce_hook_folds_and_every_hook_is_scaled_once(wrapped: bool) -> None:
    """A fused collective and the Reducer always run their hook; the
    default ``allreduce_hook``, alone or inside a user's hook given the same
    bucket, folds the post-scale into the engine's reduction; a hook that
    does not, or a wrapper's bucket of another buffer (compression), gets
    the multiply at unpack. Either way the result is scaled exactly once."""
    from dataclasses import replace

    from dp_plugin.reduce.collective import fused_collective
    from dp_plugin.reduce.fusion import TensorSpec
    from dp_plugin.reduce.hooks import ReducePolicy, allreduce_hook, compression_wrapper
    from dp_plugin.reduce.reducer import GradientScheduler

    def one_shot(engine: Any, hook: Any, values: list[np.ndarray]) -> None:
        fused_collective(values, engine=engine, name="g", hook=hook,
                         policy=ReducePolicy("sum", 1, postscale=0.5)).finish()

    def gradients(engine: Any, hook: Any, values: list[np.ndarray]) -> None:
        sched = GradientScheduler([TensorSpec("w", (6,), "float32")], engine=engine, op="sum",
                                  postscale_factor=0.5, hook=hook, name="g")
        sched.mark_ready(0, values[0])
        sched.synchronize()

    def users_hook(state: Any, bucket: Any) -> Any:  # e.g. adds logging
        return allreduce_hook(state, bucket)

    def ignores_the_offer(state: Any, bucket: Any) -> Any:
        return state.engine.allreduce_async(bucket.buffer(), state.engine_op, name=bucket.label)

    def another_buffer(state: Any, bucket: Any) -> Any:  # a wrapper's own wire buffer
        wire = bucket.flat.copy()
        return allreduce_hook(state, replace(bucket, flat=wire)).then(
            lambda: np.copyto(bucket.flat, wire))

    for run in (one_shot, gradients):
        for hook, folds in ((users_hook if wrapped else allreduce_hook, True),
                            (ignores_the_offer, False),
                            (another_buffer, False),
                            (compression_wrapper(allreduce_hook, "fp16"), False)):
            _FoldingEngine.folded_calls = 0
            engine = _FoldingEngine(Topology.single(), Config())
            values = [np.arange(6, dtype=np.float32)]
            run(engine, hook, values)
            np.testing.assert_array_equal(values[0], np.arange(6, dtype=np.float32) * 0.5)
            assert _FoldingEngine.folded_calls == (1 if folds else 0), (run, hook)
