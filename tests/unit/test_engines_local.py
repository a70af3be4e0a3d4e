"""The local engine: world size 1, every collective complete at once."""

from __future__ import annotations

import numpy as np
import pytest

from dp_plugin.config import Config
from dp_plugin.engines import create_engine
from dp_plugin.engines.base import ReduceOp
from dp_plugin.engines.local import LocalEngine
from dp_plugin.errors import EngineUnavailableError
from dp_plugin.launch import Topology

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
    with pytest.raises(TypeError, match="average is not defined for int32"):
        engine.allreduce_async(np.ones(3, np.int32), "average")
    with pytest.raises(TypeError, match="bool"):
        engine.allreduce_async(np.ones(3, bool))


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
    got = engine.allgather(buf)
    assert type(got) is type(buf)
    np.testing.assert_array_equal(np.asarray(got), rows)
    got[0, 0] = 99
    assert int(buf[0, 0]) == 0, "allgather must not share memory with its input"


def test_allgather_rejects_a_0_dim_buffer() -> None:
    with pytest.raises(ValueError, match="0-dim buffer"):
        _engine().allgather(np.float32(1.0).reshape(()))


def test_barrier_and_shutdown_are_harmless_and_idempotent() -> None:
    engine = _engine()
    engine.barrier()
    engine.shutdown()
    engine.shutdown()


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
