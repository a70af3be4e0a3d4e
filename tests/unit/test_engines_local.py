"""The local engine: world size 1, every collective complete at once."""

from __future__ import annotations

import numpy as np
import pytest

from dp_plugin.agree import checked
from dp_plugin.config import Config
from dp_plugin.engines import create_engine
from dp_plugin.engines.base import Handle, ReduceOp
from dp_plugin.engines.local import LocalEngine
from dp_plugin.errors import CollectiveTimeoutError, DPPluginError, EngineUnavailableError
from dp_plugin.launch.launchers import Topology

torch = pytest.importorskip("torch")


def _engine() -> LocalEngine:
    return LocalEngine(Topology.single(), Config())


def _two_rank_topology() -> Topology:
    return Topology(launcher="torchrun", rank=0, size=2, local_rank=0, local_size=2,
                    cross_rank=0, cross_size=1, rendezvous_addr="127.0.0.1",
                    rendezvous_port=29500)


@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_allreduce_of_one_rank_is_identity_and_done_at_once(op: ReduceOp, kind: str) -> None:
    engine = _engine()
    values = np.array([1.5, -2.0, 0.25, 7.0], dtype=np.float32)
    buf = values.copy() if kind == "numpy" else torch.from_numpy(values.copy())
    handle = engine.allreduce_async(buf, op, name="bucket-0")
    assert handle.done()
    handle.wait()
    np.testing.assert_array_equal(np.asarray(buf), values)
    assert "bucket-0" in handle.description


def test_integer_ops_and_empty_buffer() -> None:
    engine = _engine()
    ints = np.arange(-3, 4, dtype=np.int16)
    for op in ("sum", "min", "max", "product"):
        buf = ints.copy()
        engine.allreduce_async(buf, op).wait()
        np.testing.assert_array_equal(buf, ints)
    engine.allreduce_async(np.zeros(0, np.float64), "average").wait()


def test_input_validation_comes_from_the_engine_interface() -> None:
    engine = _engine()
    with pytest.raises(ValueError, match="'mean' is not known"):
        engine.allreduce_async(np.ones(3, np.float32), "mean")
    with pytest.raises(ValueError, match=r"1-D buffer, got shape \(2, 2\)"):
        engine.allreduce_async(np.ones((2, 2), np.float32))
    ints = np.array([3, -3, 7], np.int32)  # average of integers: the one Average rule
    engine.allreduce_async(ints, "average").wait()
    np.testing.assert_array_equal(ints, [3, -3, 7])
    big = np.array([2**53 + 1], np.int64)  # over one rank, no pass through double
    engine.allreduce_async(big, "average").wait()
    assert int(big[0]) == 2**53 + 1
    with pytest.raises(TypeError, match="bool"):
        engine.allreduce_async(np.ones(3, bool))
    # Only an engine that scales in the reduction (gloo on shared memory) folds a factor.
    assert engine.scaled_sum_async(np.ones(3, np.float32), 0.5) is None


def test_broadcast_from_rank_zero_only() -> None:
    engine = _engine()
    buf = np.arange(5, dtype=np.float64)
    engine.broadcast(buf, 0)
    np.testing.assert_array_equal(buf, np.arange(5))
    with pytest.raises(ValueError, match=r"root rank 1 is out of range; expected 0 <= root < 1"):
        engine.broadcast(buf, 1)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_allgather_returns_a_copy_of_the_same_kind(kind: str) -> None:
    engine = _engine()
    rows = np.arange(6, dtype=np.int64).reshape(3, 2)
    buf = rows.copy() if kind == "numpy" else torch.from_numpy(rows.copy())
    got = checked.allgather(engine, buf)
    assert type(got) is type(buf)
    np.testing.assert_array_equal(np.asarray(got), rows)
    got[0, 0] = 99
    assert int(buf[0, 0]) == 0, "allgather must not share memory with its input"


def test_allgather_rejects_a_0_dim_buffer() -> None:
    with pytest.raises(ValueError, match=r"0-dim tensor.*reshape it to \(1,\)"):
        checked.allgather(_engine(), np.float32(1.0).reshape(()))


def test_barrier_and_shutdown_are_harmless_and_idempotent() -> None:
    engine = _engine()
    engine.barrier()
    engine.shutdown()
    engine.shutdown()


def test_buffers_live_on_the_cpu() -> None:
    engine = _engine()
    assert engine.buffer_device == "cpu"
    group = checked.subgroup(engine, [0])
    assert group is not None and group.buffer_device == "cpu"


def test_a_closed_engine_refuses_every_collective() -> None:
    engine = _engine()
    engine.shutdown()
    buf = np.ones(2, np.float32)
    calls = {
        "allreduce": lambda: engine.allreduce_async(buf, name="b0"),
        "broadcast": lambda: engine.broadcast(buf, 0, name="b0"),
        "allgather": lambda: engine.allgather(buf, [2], "b0"),
        "barrier": engine.barrier,
        "alltoall": lambda: engine.alltoall(buf, [[2]], "b0"),
        "reducescatter": lambda: engine.reducescatter(buf, name="b0"),
        "subgroup": lambda: engine.subgroup([0], [0], "b0"),
    }
    for what, call in calls.items():
        with pytest.raises(DPPluginError, match="was shut down; call dp_plugin.init"
                           r"\(\) again") as info:
            call()
        assert what in str(info.value) and "local engine" in str(info.value)


class _NeverDone(Handle):
    def _test(self) -> bool:
        return False


def test_a_timeout_breaks_the_engine_and_its_subgroups() -> None:
    engine = _engine()
    group = checked.subgroup(engine, [0], "solo")
    assert group is not None
    handle = _NeverDone("local allreduce of 'bucket-3'", 0, 0.01, engine.mark_broken)
    with pytest.raises(CollectiveTimeoutError, match="bucket-3"):
        handle.wait()
    with pytest.raises(DPPluginError, match="timed out") as info:
        engine.barrier()
    assert "bucket-3" in str(info.value) and "Restart the job" in str(info.value)
    with pytest.raises(DPPluginError, match="create the subgroup again") as info:
        group.allreduce_async(np.ones(2, np.float32))
    assert "bucket-3" in str(info.value)
    engine.shutdown()  # still possible: the engine releases what it safely can


def test_a_subgroup_ends_with_its_parent() -> None:
    engine = _engine()
    group = checked.subgroup(engine, [0], "solo")
    assert group is not None
    engine.shutdown()
    with pytest.raises(DPPluginError, match=r"came from was shut down.*create the subgroup "
                       "again"):
        group.barrier()
    group.shutdown()
    group.shutdown()


def test_more_than_one_rank_is_an_error_naming_the_size() -> None:
    avail = LocalEngine.availability(_two_rank_topology())
    assert not avail.ok
    assert "2" in avail.reason and "multi-rank engine" in avail.reason
    with pytest.raises(EngineUnavailableError, match="started 2"):
        LocalEngine(_two_rank_topology(), Config())


def test_auto_picks_local_for_a_single_process() -> None:
    engine = create_engine("auto", Topology.single(), Config())
    assert isinstance(engine, LocalEngine)
    assert (engine.rank, engine.size) == (0, 1)
