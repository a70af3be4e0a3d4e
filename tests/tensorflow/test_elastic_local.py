"""dp_plugin.tensorflow.elastic in one process: commit, resume, refusals.

The multi-process proof (a worker killed under torchrun --max-restarts) is
tests/multiproc/test_tf_elastic.py; this is the core ``dp_plugin.elastic``
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
    """``_read`` unpickled whatever the file held (issue 32): anyone who could write
    ``commit_path`` could run code in every rank. Now only plain values and numpy
    load; a forged file is refused with CommitError and its code never runs."""
    path, marker = tmp_path / "elastic.pkl", tmp_path / "ran"
    state = dp.elastic.ObjectState(epoch=0, best=np.float64(0.5), commit_path=path)
    state.commit()
    record = pickle.loads(path.read_bytes())
    record["commit"]["values"]["epoch"] = _RunsCode(marker)
    path.write_bytes(pickle.dumps(record))
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
