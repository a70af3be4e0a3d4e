"""LearningRateScheduleCallback / LearningRateWarmupCallback in real ``model.fit`` runs.

One process. A probe callback placed after the callback under test records
the learning rate and momentum each train step runs with (and the momentum
after the step); they are checked against Horovod's closed-form values. For
SGD the final weights are also checked against a numpy replay of the same
steps with the recorded values, which shows the compiled step really used
the corrected momentum (Keras 3 would otherwise freeze it at trace time).
World size 4 for the warmup formula is a monkeypatched ``dp.size()``.
"""

from __future__ import annotations

import json
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf

import dp_plugin.tensorflow as dp
from dp_plugin.tensorflow.callbacks_lr import (
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
)

X = np.linspace(-1.0, 1.0, 24, dtype=np.float32).reshape(8, 3)
Y = X @ np.array([[0.5], [-1.0], [2.0]], dtype=np.float32) + 0.25
BATCH = 2
STEPS = len(X) // BATCH  # per epoch, what fit reports in params["steps"]



def momentum_of(optimizer: object) -> float:
    """The momentum a compiled step would use right now."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return float(tf.convert_to_tensor(getattr(inner, "momentum", 0.0), dtype=tf.float64))


class Probe(keras.callbacks.Callback):
    """Records, per train step, the lr and momentum it runs with and the momentum after."""

    def __init__(self) -> None:
        super().__init__()
        self.lr: list[float] = []
        self.momentum: list[float] = []
        self.momentum_after: list[float] = []

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        opt = self.model.optimizer
        self.lr.append(float(tf.convert_to_tensor(opt.learning_rate)))
        self.momentum.append(momentum_of(opt))

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.momentum_after.append(momentum_of(self.model.optimizer))


def linear_model(optimizer: keras.optimizers.Optimizer, jit: bool = False) -> keras.Model:
    model = keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(1, use_bias=False, kernel_initializer="ones"),
    ])
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit)
    return model


def fit(model: keras.Model, callback: keras.callbacks.Callback | None, epochs: int,
        **kwargs: object) -> tuple[Probe, keras.callbacks.History]:
    probe = Probe()
    callbacks = [probe] if callback is None else [callback, probe]
    history = model.fit(X, Y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=callbacks, **kwargs)
    return probe, history


def replay_sgd(w0: np.ndarray, lrs: list[float], momenta: list[float]) -> np.ndarray:
    """Keras SGD (``v = m * v - lr * g; w += v``) on the MSE loss, in float64."""
    w = w0.astype(np.float64)
    v = np.zeros_like(w)
    for step, (lr, m) in enumerate(zip(lrs, momenta, strict=True)):
        rows = slice((step % STEPS) * BATCH, (step % STEPS + 1) * BATCH)
        xb, yb = X[rows].astype(np.float64), Y[rows].astype(np.float64)
        grad = 2.0 / BATCH * xb.T @ (xb @ w - yb)
        v = m * v - lr * grad
        w = w + v
    return w


def assert_close(actual: list[float], expected: list[float]) -> None:
    # Learning rates live in a float32 variable.
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=0)


def expected_momenta(lrs: list[float], initial_lr: float, base: float) -> list[float]:
    """Horovod's correction: momentum * new_lr / old_lr in a step that changes the lr."""
    previous = [initial_lr, *lrs[:-1]]
    return [base * new / old for new, old in zip(lrs, previous, strict=True)]


# -- schedules against their closed forms ----------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
def test_staircase_constant_multiplier_with_momentum_correction(jit: bool) -> None:
    opt = keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)
    model = linear_model(opt, jit=jit)
    assert model.jit_compile == jit
    w0 = model.get_weights()[0]
    cb = LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5, start_epoch=1,
                                      end_epoch=3)
    probe, history = fit(model, cb, epochs=4)

    # epoch 0: before start_epoch, untouched; 1: 0.1 * 0.5**0; 2: 0.1 * 0.5**1;
    # 3: end_epoch is exclusive, so the last value stays.
    per_epoch = [0.05, 0.1, 0.05, 0.05]
    assert_close(probe.lr, [lr for lr in per_epoch for _ in range(STEPS)])
    # Corrected only in the first batch of epochs 1 and 2 (where the lr changes).
    expected = [0.9] * (4 * STEPS)
    expected[STEPS] = 0.9 * 0.1 / 0.05
    expected[2 * STEPS] = 0.9 * 0.05 / 0.1
    assert_close(probe.momentum, expected)
    assert probe.momentum_after == pytest.approx([0.9] * (4 * STEPS), abs=0)
    assert_close(history.history["lr"], per_epoch)
    np.testing.assert_allclose(model.get_weights()[0], replay_sgd(w0, probe.lr, probe.momentum),
                               rtol=1e-5, atol=1e-6)
    # Without the correction reaching the compiled step the result would differ.
    plain = replay_sgd(w0, probe.lr, [0.9] * len(probe.lr))
    assert not np.allclose(model.get_weights()[0], plain, rtol=1e-4, atol=1e-5)
    # The optimizer's config, serialization and state are those of plain SGD.
    assert opt.get_config()["momentum"] == 0.9
    json.dumps(keras.saving.serialize_keras_object(opt))
    assert keras.optimizers.SGD.from_config(opt.get_config()).momentum == 0.9
    assert len(opt.variables) == 3  # iteration, learning_rate, one velocity
    assert not any("dp_plugin" in v.path for v in opt.variables)


def test_smooth_schedule_with_function_multiplier_and_autodetected_steps() -> None:
    opt = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    model = linear_model(opt)
    cb = LearningRateScheduleCallback(initial_lr=0.1, multiplier=lambda e: 1.0 / (1.0 + e),
                                      staircase=False, momentum_correction=False)
    probe, history = fit(model, cb, epochs=2)

    assert cb.steps_per_epoch == STEPS  # from fit's params["steps"]
    lrs = [0.1 / (1.0 + e + b / STEPS) for e in range(2) for b in range(STEPS)]
    assert_close(probe.lr, lrs)
    assert probe.momentum == [0.9] * len(lrs)  # no correction asked for
    assert isinstance(opt.momentum, float) and type(opt.momentum) is float
    assert_close(history.history["lr"], [lrs[STEPS - 1], lrs[-1]])


def test_smooth_constant_multiplier_uses_fractional_epochs() -> None:
    opt = keras.optimizers.SGD(learning_rate=0.2, momentum=0.8)
    model = linear_model(opt)
    w0 = model.get_weights()[0]
    cb = LearningRateScheduleCallback(initial_lr=0.2, multiplier=0.5, staircase=False,
                                      steps_per_epoch=STEPS)
    probe, _ = fit(model, cb, epochs=2)

    lrs = [0.2 * 0.5 ** (e + b / STEPS) for e in range(2) for b in range(STEPS)]
    assert_close(probe.lr, lrs)
    assert_close(probe.momentum, expected_momenta(lrs, 0.2, 0.8))
    np.testing.assert_allclose(model.get_weights()[0], replay_sgd(w0, probe.lr, probe.momentum),
                               rtol=1e-5, atol=1e-6)


def test_warmup_at_world_size_4(monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(dp, "size", lambda: 4)
    monkeypatch.setattr(dp, "rank", lambda: 0)
    opt = keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)
    model = linear_model(opt)
    w0 = model.get_weights()[0]
    cb = LearningRateWarmupCallback(initial_lr=0.2, warmup_epochs=2, verbose=1)
    probe, history = fit(model, cb, epochs=3)

    # Horovod: e = epoch + (batch + 1) / steps; lr = lr0 / n * (e * (n - 1) / warmup + 1).
    warm = [0.2 / 4 * ((e + (b + 1) / STEPS) * 3 / 2 + 1) for e in range(2) for b in range(STEPS)]
    assert warm[-1] == pytest.approx(0.2)
    lrs = warm + [warm[-1]] * STEPS  # after the warmup the lr is left alone
    assert_close(probe.lr, lrs)
    assert_close(probe.momentum, expected_momenta(lrs, 0.05, 0.9))
    assert probe.momentum_after == [0.9] * len(lrs)
    assert_close(history.history["lr"], [warm[STEPS - 1], 0.2, 0.2])
    np.testing.assert_allclose(model.get_weights()[0], replay_sgd(w0, probe.lr, probe.momentum),
                               rtol=1e-5, atol=1e-6)
    assert "\nEpoch 2: finished gradual learning rate warmup to 0.2.\n" in capsys.readouterr().out


def test_warmup_at_world_size_1_with_rmsprop(capsys: pytest.CaptureFixture[str]) -> None:
    assert dp.size() == 1
    opt = keras.optimizers.RMSprop(learning_rate=0.01, momentum=0.5)
    model = linear_model(opt)
    cb = LearningRateWarmupCallback(initial_lr=0.02, warmup_epochs=1)
    probe, _ = fit(model, cb, epochs=2)

    assert_close(probe.lr, [0.02] * (2 * STEPS))  # lr / 1 grows to lr / 1: constant
    # The first step doubles the lr (0.01 -> 0.02): momentum 0.5 * 2 for that step.
    assert_close(probe.momentum, [1.0] + [0.5] * (2 * STEPS - 1))
    assert probe.momentum_after == [0.5] * (2 * STEPS)
    assert capsys.readouterr().out == ""  # verbose=0


def test_second_fit_traces_the_train_step_again() -> None:
    opt = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    model = linear_model(opt)
    w0 = model.get_weights()[0]
    first, _ = fit(model, None, epochs=1)  # traces the step with momentum as a constant
    cb = LearningRateScheduleCallback(initial_lr=0.2, multiplier=lambda e: 1.0 + e)
    second, _ = fit(model, cb, epochs=2)

    assert_close(second.lr, [0.2] * STEPS + [0.4] * STEPS)
    assert_close(second.momentum, ([0.9 * 2] + [0.9] * (STEPS - 1)) * 2)
    lrs = first.lr + second.lr
    momenta = first.momentum + second.momentum
    np.testing.assert_allclose(model.get_weights()[0], replay_sgd(w0, lrs, momenta),
                               rtol=1e-5, atol=1e-6)


def test_mixed_precision_loss_scale_optimizer() -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        opt = keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)
        model = linear_model(opt)
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        cb = LearningRateScheduleCallback(initial_lr=0.1, multiplier=1.0)
        probe, history = fit(model, cb, epochs=1)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # Keras may begin one more batch to find the end of a dataset of unknown length.
    assert len(probe.lr) in (STEPS, STEPS + 1)
    assert_close(probe.lr, [0.1] * len(probe.lr))
    assert_close(probe.momentum, [0.9 * 2] + [0.9] * (STEPS - 1))
    assert probe.momentum_after == [0.9] * STEPS
    assert_close(history.history["lr"], [0.1])


def test_optimizer_without_momentum_is_left_alone() -> None:
    opt = keras.optimizers.Adam(learning_rate=0.01)
    model = linear_model(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        probe, _ = fit(model, LearningRateScheduleCallback(0.02, 0.5), epochs=2)
    assert_close(probe.lr, [0.02] * STEPS + [0.01] * STEPS)
    assert not hasattr(opt, "momentum")


# -- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"initial_lr": None}, ValueError, r"`initial_lr` is required"),
        ({"initial_lr": -0.1}, ValueError, r"initial_lr must be a finite number > 0, got -0.1"),
        ({"initial_lr": float("inf")}, ValueError, r"initial_lr must be a finite number > 0"),
        ({"initial_lr": "0.1"}, ValueError, r"initial_lr must be a finite number > 0, got '0.1'"),
        ({"multiplier": "half"}, TypeError, r"multiplier='half' is neither a number"),
        ({"start_epoch": -1}, ValueError, r"start_epoch must be an int >= 0, got -1"),
        ({"start_epoch": 2, "end_epoch": 2}, ValueError, r"end_epoch=2 must be greater"),
        ({"steps_per_epoch": 0}, ValueError, r"steps_per_epoch must be an int >= 1, got 0"),
    ],
)
def test_schedule_rejects_bad_arguments(kwargs: dict, error: type[Exception],
                                        match: str) -> None:
    args = {"initial_lr": 0.1, "multiplier": 0.5, **kwargs}
    with pytest.raises(error, match=match):
        LearningRateScheduleCallback(**args)


@pytest.mark.parametrize("warmup_epochs", [0, 2.5, True])
def test_warmup_rejects_bad_epochs(warmup_epochs: object) -> None:
    match = r"LearningRateWarmupCallback: warmup_epochs must be an int >= 1, got "
    with pytest.raises(ValueError, match=match):
        LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=warmup_epochs)  # type: ignore[arg-type]


# Keras warns when a dataset of unknown length ends an epoch: expected here.
@pytest.mark.filterwarnings("ignore:Your input ran out of data")
def test_unknown_steps_per_epoch_is_an_error_naming_the_fix() -> None:
    model = linear_model(keras.optimizers.SGD(learning_rate=0.1))
    data = tf.data.Dataset.from_tensor_slices((X, Y)).filter(lambda x, y: True).batch(BATCH)
    assert data.cardinality() == tf.data.UNKNOWN_CARDINALITY
    cb = LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=1)
    with pytest.raises(ValueError, match=r"Could not autodetect the number of steps per epoch"
                                         r".*steps_per_epoch parameter to the "
                                         r"LearningRateWarmupCallback\(\)"):
        model.fit(data, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    # Given explicitly, the same data trains.
    cb = LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=1, steps_per_epoch=STEPS)
    probe = Probe()
    model.fit(data, epochs=1, shuffle=False, verbose=0, callbacks=[cb, probe])
    # Keras may begin one more batch to find the end of a dataset of unknown length.
    assert len(probe.lr) in (STEPS, STEPS + 1)
    assert_close(probe.lr, [0.1] * len(probe.lr))


def test_learning_rate_schedule_optimizer_is_rejected() -> None:
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.9)
    model = linear_model(keras.optimizers.SGD(learning_rate=schedule))
    with pytest.raises(TypeError, match=r"cannot be set.*float learning_rate"):
        fit(model, LearningRateScheduleCallback(0.1, 0.5), epochs=1)


def test_unsupported_momentum_optimizer_warns() -> None:
    class MomentumAdam(keras.optimizers.Adam):
        momentum = 0.5

    model = linear_model(MomentumAdam(learning_rate=0.01))
    with pytest.warns(UserWarning, match=r"momentum correction is not applied to MomentumAdam"):
        fit(model, LearningRateScheduleCallback(0.02, 0.5), epochs=1)
