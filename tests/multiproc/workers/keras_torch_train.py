"""Worker: Keras 3 on the torch backend, trained on every rank, equals one process.

Run under any launcher (see tests/multiproc/harness.py)::

    python keras_torch_train.py --case fit     # prints "rank R OK"

``KERAS_BACKEND=torch`` is set before Keras is imported; TensorFlow must
never be imported (checked at the end; the models are seeded through their
initializers, since ``keras.utils.set_random_seed`` imports TensorFlow). Each rank starts from a
model initialised with its own seed; after ``fit`` the weights must be
bitwise identical on all ranks (a digest is all-gathered) and, on rank 0,
within 1e-5 of a single-process run from rank 0's initial weights on the
concatenated global batches (rank r's batch of step s is rows
``[s*G + r*B, s*G + (r+1)*B)`` of the global data, ``G = B * size``).

Cases:
- fit: a Dense model, ``DistributedCallback``; the optimizer's momentums
  start rank-dependent, so the optimizer state's broadcast is checked too.
- optimizer: ``DistributedOptimizer`` + ``BroadcastGlobalVariablesCallback``.
- conv_sync_bn: Conv2D + ``SyncBatchNormalization`` equals Conv2D +
  ``BatchNormalization`` in one process on the global batch, the moving
  statistics included.
- batch_norm: plain ``BatchNormalization`` (each rank's own statistics):
  the trainable weights are identical on all ranks and equal one process
  that averages the two ranks' gradients itself.
- validation: ``fit`` with ``validation_data``, a metric and two epochs;
  ``evaluate``/``predict`` identical on all ranks.
- callbacks: ``MetricAverageCallback`` makes every rank's history the mean
  of the ranks' epoch logs; ``LearningRateWarmupCallback`` (momentum
  corrected in the batch of each change) sets the learning rates one
  process sets, and the weights equal that process's.
- uneven: rank 0 has 10 batches per epoch and rank 1 has 11: ``fit`` with
  ``DistributedCallback`` (then with ``DistributedOptimizer`` and
  ``BroadcastGlobalVariablesCallback``) raises, before the first step and on
  every rank, a ``ValueError`` naming both counts and the fix; with that fix
  (``steps_per_epoch=10``) the same ``fit`` trains, ranks bitwise equal.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from typing import Any

os.environ["KERAS_BACKEND"] = "torch"

import keras
import numpy as np
import torch
from _fail_fast import run_cases

import dp_plugin.keras as dp
from dp_plugin.agree import checked
from dp_plugin.launch import runtime

FEATURES, OUTPUTS, HIDDEN = 6, 2, 16
LOCAL_BATCH = 8
STEPS = 4
LR = 0.05
TOL = 1e-5


# -- data and models -----------------------------------------------------------

def global_data(steps: int, seed: int, shape: tuple[int, ...] = (FEATURES,),
                classes: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = steps * LOCAL_BATCH * dp.size()
    x = rng.normal(size=(n, *shape)).astype(np.float32)
    if classes:
        return x, rng.integers(0, classes, size=(n,)).astype(np.int64)
    return x, rng.normal(size=(n, OUTPUTS)).astype(np.float32)


def local_rows(a: np.ndarray) -> np.ndarray:
    """This rank's share of every global batch, in step order."""
    g, r = LOCAL_BATCH * dp.size(), dp.rank()
    return np.concatenate([a[s : s + g][r * LOCAL_BATCH : (r + 1) * LOCAL_BATCH]
                           for s in range(0, len(a), g)])


def seeded(seed: int) -> keras.initializers.Initializer:
    # Not keras.utils.set_random_seed: it imports TensorFlow where it is installed.
    return keras.initializers.GlorotUniform(seed=seed)


def dense_model(seed: int, outputs: int = OUTPUTS, activation: str | None = None) -> keras.Model:
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(HIDDEN, activation="tanh", kernel_initializer=seeded(seed)),
        keras.layers.Dense(outputs, activation=activation, kernel_initializer=seeded(seed + 1)),
    ])


def conv_model(seed: int, norm: Callable[[], keras.layers.Layer]) -> keras.Model:
    return keras.Sequential([
        keras.Input((5, 5, 2)),
        keras.layers.Conv2D(4, 3, padding="same", kernel_initializer=seeded(seed)),
        norm(),
        keras.layers.Activation("relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(OUTPUTS, kernel_initializer=seeded(seed + 1)),
    ])


def sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(LR, momentum=0.9)


# -- checks ----------------------------------------------------------------------

def digest(arrays: list[np.ndarray]) -> np.ndarray:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return np.frombuffer(h.digest(), dtype=np.uint8).copy()


def assert_identical_on_all_ranks(arrays: list[np.ndarray], what: str) -> None:
    eng = runtime.engine()
    table = np.asarray(checked.allgather(eng, digest(arrays), f"digest.{what}"))
    table = table.reshape(eng.size, -1)
    differing = [r for r in range(eng.size) if not np.array_equal(table[r], table[0])]
    if differing:
        raise AssertionError(f"{what}: ranks {differing} end with weights different from rank 0")


def assert_close(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    worst = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want, strict=True))
    if not worst <= TOL:
        raise AssertionError(f"{what}: differs from the single-process run by {worst:g} > {TOL:g}")
    print(f"rank {dp.rank()} {what}: max |distributed - single process| = {worst:.3g}")


def momentums(optimizer: keras.optimizers.Optimizer) -> list[Any]:
    return [v for v in optimizer.variables if "momentum" in v.path]


def trainable(model: keras.Model) -> list[np.ndarray]:
    return [keras.ops.convert_to_numpy(v.value) for v in model.trainable_weights]


# -- cases -------------------------------------------------------------------------

def case_fit(wrap: str = "callback") -> None:
    x, y = global_data(STEPS, seed=1)
    model = dense_model(seed=100 + dp.rank())
    opt = sgd()
    if wrap == "optimizer":
        opt = dp.DistributedOptimizer(opt)
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)
    rng = np.random.default_rng(7 + dp.rank())  # only the root's state may survive
    for v in momentums(opt):
        v.assign(rng.normal(size=v.shape).astype(np.float32) * 0.01)
    init_w = model.get_weights()
    init_m = [keras.ops.convert_to_numpy(v.value) for v in momentums(opt)]
    callback = (dp.DistributedCallback() if wrap == "callback"
                else dp.BroadcastGlobalVariablesCallback(0))
    model.fit(local_rows(x), local_rows(y), batch_size=LOCAL_BATCH, epochs=1, shuffle=False,
              verbose=0, callbacks=[callback])
    final = model.get_weights()
    what = f"fit[{wrap}]"
    assert_identical_on_all_ranks(final, what)
    if dp.rank() == 0:
        ref = dense_model(seed=0)
        ref.set_weights(init_w)
        ref_opt = sgd()
        ref.compile(optimizer=ref_opt, loss="mse")
        ref_opt.build(ref.trainable_variables)
        for v, m in zip(momentums(ref_opt), init_m, strict=True):
            v.assign(m)
        ref.fit(x, y, batch_size=LOCAL_BATCH * dp.size(), epochs=1, shuffle=False, verbose=0)
        assert_close(final, ref.get_weights(), what)


def case_conv_sync_bn() -> None:
    x, y = global_data(STEPS, seed=2, shape=(5, 5, 2))
    model = conv_model(100 + dp.rank(), lambda: dp.SyncBatchNormalization(momentum=0.5))
    model.compile(optimizer=sgd(), loss="mse")
    init_w = model.get_weights()
    model.fit(local_rows(x), local_rows(y), batch_size=LOCAL_BATCH, epochs=1, shuffle=False,
              verbose=0, callbacks=[dp.DistributedCallback()])
    final = model.get_weights()  # moving mean and variance too
    assert_identical_on_all_ranks(final, "conv_sync_bn")
    if dp.rank() == 0:
        ref = conv_model(0, lambda: keras.layers.BatchNormalization(momentum=0.5))
        ref.set_weights(init_w)
        ref.compile(optimizer=sgd(), loss="mse")
        ref.fit(x, y, batch_size=LOCAL_BATCH * dp.size(), epochs=1, shuffle=False, verbose=0)
        assert_close(final, ref.get_weights(), "conv_sync_bn")


def case_batch_norm() -> None:
    """Plain BatchNormalization: each rank normalizes with its own batch's
    statistics, so one process on the global batch is not the reference; one
    that averages the per-rank gradients itself is."""
    x, y = global_data(STEPS, seed=3, shape=(5, 5, 2))
    model = conv_model(100 + dp.rank(), keras.layers.BatchNormalization)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    init_w = model.get_weights()
    model.fit(local_rows(x), local_rows(y), batch_size=LOCAL_BATCH, epochs=1, shuffle=False,
              verbose=0, callbacks=[dp.DistributedCallback()])
    final = trainable(model)
    assert_identical_on_all_ranks(final, "batch_norm")
    if dp.rank() == 0:
        ref = conv_model(0, keras.layers.BatchNormalization)
        ref.set_weights(init_w)
        opt = keras.optimizers.SGD(LR)
        opt.build(ref.trainable_variables)
        loss_fn = keras.losses.MeanSquaredError()
        g = LOCAL_BATCH * dp.size()
        for s in range(0, len(x), g):
            grads: list[torch.Tensor] = []
            for r in range(dp.size()):
                rows = slice(s + r * LOCAL_BATCH, s + (r + 1) * LOCAL_BATCH)
                ref.zero_grad()
                loss_fn(torch.as_tensor(y[rows]), ref(torch.as_tensor(x[rows]), training=True)
                        ).backward()
                mine = [v.value.grad.clone() for v in ref.trainable_weights]
                grads = mine if not grads else [a + b for a, b in zip(grads, mine, strict=True)]
            with torch.no_grad():
                opt.apply([gr / dp.size() for gr in grads], ref.trainable_weights)
        assert_close(final, trainable(ref), "batch_norm")


def case_validation() -> None:
    classes = 3
    x, y = global_data(STEPS, seed=4, classes=classes)
    vx, vy = global_data(2, seed=5, classes=classes)

    def train(model: keras.Model, xs: np.ndarray, ys: np.ndarray, batch: int,
              callbacks: list[Any]) -> None:
        model.fit(xs, ys, batch_size=batch, epochs=2, shuffle=False, verbose=0,
                  validation_data=(vx, vy), callbacks=callbacks)

    model = dense_model(200 + dp.rank(), outputs=classes, activation="softmax")
    model.compile(optimizer=sgd(), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    init_w = model.get_weights()
    train(model, local_rows(x), local_rows(y), LOCAL_BATCH, [dp.DistributedCallback()])
    final = model.get_weights()
    assert_identical_on_all_ranks(final, "validation")
    evaluated = np.array(model.evaluate(vx, vy, verbose=0), dtype=np.float64)
    predicted = model.predict(vx, verbose=0)
    assert_identical_on_all_ranks([evaluated, predicted], "validation evaluate/predict")
    if dp.rank() == 0:
        ref = dense_model(0, outputs=classes, activation="softmax")
        ref.set_weights(init_w)
        ref.compile(optimizer=sgd(), loss="sparse_categorical_crossentropy",
                    metrics=["accuracy"])
        train(ref, x, y, LOCAL_BATCH * dp.size(), [])
        assert_close(final, ref.get_weights(), "validation")


class Probe(keras.callbacks.Callback):
    """Records the learning rate and momentum each batch trains with, and each
    epoch's logs as this rank computed them (placed before MetricAverageCallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.rates: list[tuple[float, float]] = []
        self.logs: list[dict[str, float]] = []

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        opt = self.model.optimizer
        self.rates.append((float(opt.learning_rate),
                           float(opt.momentum)))

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.logs.append(dict(logs or {}))


def case_callbacks() -> None:
    """MetricAverageCallback and LearningRateWarmupCallback (with momentum
    correction) on the torch backend; the warmup equals one process's."""
    x, y = global_data(STEPS, seed=6)
    initial_lr, epochs = 0.1, 2

    def train(model: keras.Model, xs: np.ndarray, ys: np.ndarray, batch: int,
              distributed: list[Any]) -> Probe:
        probe = Probe()
        model.compile(optimizer=sgd(), loss="mse", metrics=["mae"])
        model.fit(xs, ys, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[*distributed[:1], dp.LearningRateWarmupCallback(
                      initial_lr, warmup_epochs=epochs), probe, *distributed[1:]])
        return probe

    model = dense_model(300 + dp.rank())
    init_w = model.get_weights()
    probe = train(model, local_rows(x), local_rows(y), LOCAL_BATCH,
                  [dp.DistributedCallback(), dp.MetricAverageCallback()])
    final = model.get_weights()
    assert_identical_on_all_ranks(final, "callbacks")
    history = model.history.history
    averaged = [history[k][e] for e in range(epochs) for k in sorted(history)]
    assert_identical_on_all_ranks([np.array(averaged)], "callbacks history")
    mine = np.array([log[k] for log in probe.logs for k in sorted(history)])
    everyone = np.asarray(checked.allgather(runtime.engine(), mine, "logs"))
    expected = everyone.reshape(dp.size(), -1).mean(axis=0)
    if not np.allclose(averaged, expected, rtol=1e-6):
        raise AssertionError(f"MetricAverageCallback: history {averaged} is not the mean of "
                             f"the ranks' logs {expected}")
    (lr0, _), (lr1, m1) = probe.rates[0], probe.rates[1]
    if not (np.isclose(m1, 0.9 * lr1 / lr0) and float(model.optimizer.momentum) == 0.9):
        raise AssertionError(f"momentum correction: {m1} at lr {lr1} after {lr0}, "
                             f"{model.optimizer.momentum} after fit")
    last = float(model.optimizer.learning_rate)
    if not np.isclose(last, initial_lr):
        raise AssertionError(f"warmup ended at learning rate {last}, not {initial_lr}")
    if dp.rank() == 0:
        ref = dense_model(0)
        ref.set_weights(init_w)
        ref_probe = train(ref, x, y, LOCAL_BATCH * dp.size(), [])
        if ref_probe.rates != probe.rates:
            raise AssertionError(f"rates {probe.rates} differ from one process's "
                                 f"{ref_probe.rates}")
        assert_close(final, ref.get_weights(), "callbacks")


def case_uneven() -> None:
    rows = LOCAL_BATCH * (10 + dp.rank())
    rng = np.random.default_rng(dp.rank())
    xs = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    ys = rng.normal(size=(rows, OUTPUTS)).astype(np.float32)
    for wrap in ("callback", "optimizer"):
        model = dense_model(seed=100 + dp.rank())
        opt = sgd() if wrap == "callback" else dp.DistributedOptimizer(sgd())
        model.compile(optimizer=opt, loss="mse")
        callback = (dp.DistributedCallback() if wrap == "callback"
                    else dp.BroadcastGlobalVariablesCallback(0))
        before = trainable(model)
        try:
            model.fit(xs, ys, batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0,
                      callbacks=[callback])
        except ValueError as exc:
            message = str(exc)
        else:
            raise AssertionError(f"uneven[{wrap}]: fit trained on 10 and 11 batches")
        for want in ("different numbers of batches per epoch (rank 0: 10; rank 1: 11)",
                     "steps_per_epoch=10"):
            if want not in message:
                raise AssertionError(f"uneven[{wrap}]: {want!r} not in {message!r}")
        if any(not np.array_equal(a, b) for a, b in zip(before, trainable(model), strict=True)):
            raise AssertionError(f"uneven[{wrap}]: a step ran before the error")
        model.fit(xs, ys, batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0,
                  steps_per_epoch=10, callbacks=[callback])
        assert_identical_on_all_ranks(trainable(model), f"uneven[{wrap}]")


CASES: dict[str, Callable[[object], None]] = {
    "callbacks": lambda _: case_callbacks(),
    "fit": lambda _: case_fit(),
    "optimizer": lambda _: case_fit("optimizer"),
    "conv_sync_bn": lambda _: case_conv_sync_bn(),
    "batch_norm": lambda _: case_batch_norm(),
    "validation": lambda _: case_validation(),
    "uneven": lambda _: case_uneven(),
}


def start(_: object) -> None:
    dp.init()
    print(f"rank {dp.rank()} engine {runtime.engine().name}, {dp.size()} ranks, "
          f"backend {keras.backend.backend()}")


def finish(_: object) -> None:
    if "tensorflow" in sys.modules:
        raise AssertionError("dp_plugin.keras on the torch backend imported TensorFlow")
    runtime.engine().barrier()
    dp.shutdown()


if __name__ == "__main__":
    run_cases(CASES, setup=start, teardown=finish)
