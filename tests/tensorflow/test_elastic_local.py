"""dp_plugin.tensorflow.elastic in one process: commit, resume, refusals.

The multi-process proof (a worker killed under torchrun --max-restarts) is
tests/multiproc/test_tf_elastic.py; this is the core ``dp_plugin.api.elastic``
protocol as the TensorFlow adapter fills it in.
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import dp_plugin.tensorflow as dp
from dp_plugin.errors import LaunchError
from dp_plugin.tensorflow import elastic as tf_elastic


def _model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    return model


def test_a_commit_resumes_weights_values_and_generators(tmp_path: Path) -> None:
    path = tmp_path / "elastic.pkl"
    model = _model(0)
    state = dp.elastic.KerasState(model, batch=3, commit_path=path)
    state.commit()
    draw = (random.random(), np.random.rand())
    weights = [w.numpy() for w in model.weights]

    other = _model(1)
    fresh = dp.elastic.KerasState(other, batch=0, commit_path=path)
    assert dp.elastic.run(lambda s: s.batch)(fresh) == 3
    for a, b in zip(weights, other.weights, strict=True):
        np.testing.assert_array_equal(a, b.numpy())
    assert (random.random(), np.random.rand()) == draw


def test_a_foreign_or_different_commit_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.pkl"
    foreign.write_bytes(pickle.dumps({"weights": 1}))
    with pytest.raises(dp.elastic.CommitError, match="not an elastic commit"):
        dp.elastic.ObjectState(epoch=0, commit_path=foreign).load()
    path = tmp_path / "elastic.pkl"
    dp.elastic.ObjectState(epoch=0, commit_path=path).commit()
    with pytest.raises(dp.elastic.CommitError, match="another script"):
        dp.elastic.ObjectState(epoch=0, batch=0, commit_path=path).load()


def test_restarts_without_a_commit_path_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    with pytest.raises(LaunchError, match=r"TORCHELASTIC_MAX_RESTARTS=2.*no commit_path"):
        dp.elastic.run(lambda s: None)(dp.elastic.ObjectState(epoch=0))


class _RunsCode:
    """A pickle that calls ``Path.touch`` on load: what a forged commit could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_a_commit_is_loaded_without_running_code(tmp_path: Path) -> None:
    """``_read`` unpickled whatever the file held: anyone who could write
    ``commit_path`` could run code in every rank. Now only plain values and numpy
    load; a forged file is refused with CommitError and its code never runs."""
    path, marker = tmp_path / "elastic.pkl", tmp_path / "ran"
    state = dp.elastic.ObjectState(epoch=0, best=np.float64(0.5), commit_path=path)
    state.commit()
    record = tf_elastic._loads(path.read_bytes(), path)
    record["commit"]["values"]["epoch"] = _RunsCode(marker)
    path.write_bytes(tf_elastic._pickled(record))
    with pytest.raises(dp.elastic.CommitError, match=r"cannot be loaded as an elastic commit "
                       r"\(UnpicklingError: pathlib.*Path.touch is not a plain value"):
        dp.elastic.ObjectState(epoch=0, best=0.0, commit_path=path).load()
    assert not marker.exists()


def test_a_value_that_would_not_load_is_refused_at_commit(tmp_path: Path) -> None:
    path = tmp_path / "elastic.pkl"
    state = dp.elastic.ObjectState(epoch=0, note=object(), commit_path=path)
    with pytest.raises(dp.elastic.CommitError,
                       match=r"\['values'\]\['note'\] = <object object .*nothing was written"):
        state.commit()
    assert not path.exists()


def test_arrays_and_scalars_of_plain_dtypes_come_back_exactly(tmp_path: Path) -> None:
    """A commit stores arrays as dtype name, shape and bytes (no dtype or array is
    unpickled): every plain dtype, shape and byte order comes back bitwise."""
    import ml_dtypes

    values = {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "strided": np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],
        "big_endian": np.array([1.5, -2.0], dtype=">f8"),
        "bf16": np.array([1.0, 0.5], dtype=ml_dtypes.bfloat16),
        "flags": np.array([True, False]), "empty": np.zeros((0, 3), np.int8),
        "dates": np.array(["2024-01-02"], dtype="datetime64[D]"),
        "text": np.array(["ab", "c"]), "zero_d": np.array(7, np.uint16),
        "scalar": np.float16(0.25), "complex": np.complex64(1 + 2j),
    }
    path = tmp_path / "elastic.pkl"
    dp.elastic.ObjectState(commit_path=path, **values).commit()
    back = dp.elastic.ObjectState(commit_path=path, **{k: None for k in values})
    assert back.load()
    for name, want in values.items():
        got = getattr(back, name)
        assert type(got) is type(want) and got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want)
        assert np.asarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), name


@pytest.mark.parametrize("value", [
    np.array([object()], dtype=object), np.zeros(2, dtype=[("a", "f4"), ("b", "i4")]),
    np.dtype("float32"), np.ma.masked_array([1.0], mask=[True]),
], ids=["object_array", "structured", "dtype", "masked"])
def test_a_value_without_a_plain_dtype_is_refused_at_commit(tmp_path: Path, value: Any) -> None:
    path = tmp_path / "elastic.pkl"
    with pytest.raises(dp.elastic.CommitError,
                       match=r"(?s)\['values'\]\['bad'\] = .*numpy.*nothing was written"):
        dp.elastic.ObjectState(bad=value, commit_path=path).commit()
    assert not path.exists()


@pytest.mark.parametrize(("pid", "reason"), [
    (("ndarray", "|O", (1,), b"A" * 8), r"dtype '\|O'.*never objects"),
    (("ndarray", "i4,O", (1,), b"A" * 12), r"dtype 'i4,O'.*never objects"),
    (("ndarray", "|V8", (1,), b"A" * 8), r"dtype '\|V8'"),
    (("scalar", "O", b"A" * 8), r"dtype 'O'"),
    (("ndarray", "<f4", (4,), b"A" * 8), r"8 bytes of data, not 16"),
    (("ndarray", "<f4", (-1,), b""), r"shape \(-1,\): not a shape"),
    (("module", "os.system"), r"unknown persistent id"),
], ids=["object", "object_field", "void", "object_scalar", "short", "negative", "unknown"])
def test_a_forged_array_record_is_refused(tmp_path: Path, pid: tuple[Any, ...],
                                          reason: str) -> None:
    """What a forged file could put where ``commit()`` writes an array."""

    class _Forger(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return pid if isinstance(obj, str) and obj == "forged" else None

    path = tmp_path / "elastic.pkl"
    dp.elastic.ObjectState(epoch=0, commit_path=path).commit()
    record = tf_elastic._loads(path.read_bytes(), path)
    record["commit"]["values"]["epoch"] = "forged"
    with path.open("wb") as out:
        _Forger(out, protocol=4).dump(record)
    loaded = r"cannot be loaded as an elastic commit \(UnpicklingError: .*"
    with pytest.raises(dp.elastic.CommitError, match=loaded + reason):
        dp.elastic.ObjectState(epoch=0, commit_path=path).load()


def test_a_pickled_numpy_dtype_is_refused(tmp_path: Path) -> None:
    """The classes a dtype's or an array's own pickle names are refused outright."""
    path = tmp_path / "elastic.pkl"
    dp.elastic.ObjectState(epoch=0, commit_path=path).commit()
    record = tf_elastic._loads(path.read_bytes(), path)
    for value, name in [(np.dtype("float32"), "numpy.dtype"),
                        (np.zeros(2), "numpy._core.multiarray._reconstruct")]:
        record["commit"]["values"]["epoch"] = value
        path.write_bytes(pickle.dumps(record, protocol=4))
        with pytest.raises(dp.elastic.CommitError, match=rf"{name} is not a plain value"):
            dp.elastic.ObjectState(epoch=0, commit_path=path).load()
