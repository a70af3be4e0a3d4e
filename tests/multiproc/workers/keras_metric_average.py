"""Worker: MetricAverageCallback in real ``model.fit`` runs on every rank.

Run under any launcher (see tests/multiproc/harness.py)::

    python keras_metric_average.py --case metric_average     # prints "rank R OK"
    python keras_metric_average.py --list-cases

Two cases (TensorFlow starts slowly): ``metric_average`` runs 1-3 below,
``horovod_callbacks`` runs 4.

1. average: every rank fits a tiny model on its own data (seeded by rank),
   with validation data, ``metrics=["mae"]`` and an extra vector-valued log
   entry. A probe before MetricAverageCallback copies the local epoch logs,
   one after it copies what later callbacks see. Per epoch the local logs
   are all-gathered and the later view must equal their mean, be identical
   on every rank, and be what ``History`` recorded.
2. names differ: each rank logs an extra entry of its own; every rank must
   raise ValueError naming both ranks' metric lists (no hang).
3. non-numeric: one rank logs a string; every rank must raise TypeError
   naming that rank.

4. together: DistributedCallback, MetricAverageCallback and
   LearningRateWarmupCallback in one fit (Horovod's usual list); the
   warmup follows the closed form at this world size, the momentum is
   corrected in each step that changes the lr, and the ranks end with
   bitwise identical weights (rank 0 announces the end of the warmup).

Afterwards one all-reduce shows the ranks are still in step. Any failure
prints a traceback and exits 1 at once (the others then fail their next
collective after DP_PLUGIN_TIMEOUT).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from _fail_fast import run_cases

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import dp_plugin.tensorflow as dp
from dp_plugin.agree import checked
from dp_plugin.launch import runtime
from dp_plugin.tensorflow.callbacks_lr import LearningRateWarmupCallback
from dp_plugin.tensorflow.metric_average import MetricAverageCallback

EPOCHS = 2


class Snapshot(keras.callbacks.Callback):
    """Copies the epoch-end logs as they are at its place in the callback list."""

    def __init__(self) -> None:
        super().__init__()
        self.epochs: list[dict[str, Any]] = []

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epochs.append({k: np.array(v, dtype=np.float64) for k, v in (logs or {}).items()})


class Inject(keras.callbacks.Callback):
    """Adds entries to the epoch-end logs (before the averaging sees them)."""

    def __init__(self, add: Callable[[dict[str, Any]], None]) -> None:
        super().__init__()
        self.add = add

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            self.add(logs)


def make_model(rank: int) -> tuple[keras.Model, np.ndarray, np.ndarray]:
    keras.utils.set_random_seed(100 + rank)  # different weights and data on every rank
    x = np.random.default_rng(rank).normal(size=(16, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32) + rank).astype(np.float32)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model, x, y


def flat(logs: dict[str, Any]) -> np.ndarray:
    return np.concatenate([np.asarray(logs[k], np.float64).reshape(-1) for k in sorted(logs)])


def gather_rows(vec: np.ndarray) -> np.ndarray:
    return np.asarray(checked.allgather(runtime.engine(), vec[None, :], "test gather"))


def check_average(rank: int, size: int) -> None:
    model, x, y = make_model(rank)
    before, after = Snapshot(), Snapshot()
    vec = Inject(lambda logs: logs.update(vec=np.array([rank, 10.0 * rank])))
    history = model.fit(
        x, y, batch_size=4, epochs=EPOCHS, shuffle=False, verbose=0,
        validation_data=(x[:8] * 2, y[:8]),
        callbacks=[vec, before, MetricAverageCallback(), after],
    )
    assert len(before.epochs) == len(after.epochs) == EPOCHS
    for epoch in range(EPOCHS):
        local, averaged = before.epochs[epoch], after.epochs[epoch]
        assert sorted(local) == sorted(averaged) == ["loss", "mae", "val_loss", "val_mae", "vec"], (
            sorted(averaged))
        rows = gather_rows(flat(local))
        assert not np.allclose(rows[0], rows[1:]), "ranks should have different local metrics"
        np.testing.assert_allclose(flat(averaged), rows.mean(axis=0), rtol=1e-12, atol=0)
        np.testing.assert_array_equal(averaged["vec"], [(size - 1) / 2, 10.0 * (size - 1) / 2])
        same = gather_rows(flat(averaged))
        assert (same == same[0]).all(), f"ranks disagree on the averaged logs: {same}"
        for name in ("loss", "mae", "val_loss", "val_mae"):
            assert history.history[name][epoch] == float(averaged[name]), name


def check_different_names(rank: int) -> None:
    model, x, y = make_model(rank)
    extra = Inject(lambda logs: logs.update({f"only_rank{rank}": 1.0}))
    try:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[extra, MetricAverageCallback()])
    except ValueError as e:
        message = str(e)
        for part in ("ranks logged different metrics", "end of epoch 0",
                     "rank 0: [loss, mae, only_rank0]", "rank 1: [loss, mae, only_rank1]"):
            assert part in message, f"{part!r} not in: {message}"
    else:
        raise AssertionError("different metric names did not raise")


def check_non_numeric(rank: int) -> None:
    model, x, y = make_model(rank)
    note = Inject(lambda logs: logs.update(note="text" if rank == 1 else 1.0))
    try:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[note, MetricAverageCallback()])
    except TypeError as e:
        message = str(e)
        assert "rank(s) [1] logged a value that is not a number" in message, message
        assert ("'note': 'text'" in message) == (rank == 1), message
    else:
        raise AssertionError("a non-numeric log value did not raise")


class LrProbe(keras.callbacks.Callback):
    """The learning rate and momentum each train step runs with."""

    def __init__(self) -> None:
        super().__init__()
        self.lr: list[float] = []
        self.momentum: list[float] = []

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        opt = self.model.optimizer
        self.lr.append(float(tf.convert_to_tensor(opt.learning_rate)))
        self.momentum.append(float(tf.convert_to_tensor(opt.momentum, dtype=tf.float64)))


def check_together(rank: int, size: int) -> None:
    model, x, y = make_model(rank)
    model.compile(optimizer=keras.optimizers.SGD(0.1 / size, momentum=0.9), loss="mse")
    probe = LrProbe()
    history = model.fit(
        x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
        callbacks=[dp.DistributedCallback(), MetricAverageCallback(),
                   LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=1, verbose=1),
                   probe],
    )
    steps = len(x) // 4
    warm = [0.1 / size * ((b + 1) / steps * (size - 1) + 1) for b in range(steps)]
    lrs = warm + [0.1] * steps
    np.testing.assert_allclose(probe.lr, lrs, rtol=1e-6)
    momenta = [0.9 * new / old for new, old in zip(lrs, [0.1 / size, *lrs[:-1]], strict=True)]
    np.testing.assert_allclose(probe.momentum, momenta, rtol=1e-6)
    np.testing.assert_allclose(history.history["lr"], [0.1, 0.1], rtol=1e-6)
    weights = np.concatenate([w.reshape(-1) for w in model.get_weights()]).astype(np.float64)
    rows = gather_rows(weights)
    assert (rows == rows[0]).all(), f"ranks ended with different weights: {rows}"
    losses = gather_rows(np.array(history.history["loss"]))
    assert (losses == losses[0]).all(), losses


def case_metric_average(_: object) -> None:
    check_average(dp.rank(), dp.size())
    check_different_names(dp.rank())
    check_non_numeric(dp.rank())


def case_horovod_callbacks(_: object) -> None:
    check_together(dp.rank(), dp.size())


CASES = {
    "metric_average": case_metric_average,
    "horovod_callbacks": case_horovod_callbacks,
}


def start(_: object) -> None:
    dp.init()
    if dp.size() < 2:
        raise RuntimeError(f"run this worker on 2 or more ranks, got {dp.size()}")


def still_in_step(_: object) -> None:
    token = np.ones(1, dtype=np.float64)
    runtime.engine().allreduce_async(token, "sum", name="still in step").wait()
    assert token[0] == dp.size(), token
    dp.shutdown()


if __name__ == "__main__":
    run_cases(CASES, setup=start, teardown=still_in_step)
