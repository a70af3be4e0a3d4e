"""Worker: Keras 3 on the torch backend, trained on every rank, equals one process.

Run under any launcher (see tests/multiproc/harness.py)::

    python keras_torch_train.py --case fit     # prints "rank R OK"

``KERAS_BACKEND=torch`` is set before Keras is imported; importing
``dp_plugin.keras`` must not import TensorFlow (checked first; Keras's
``set_random_seed`` imports it later where it is installed). Each rank starts from a
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
- callbacks: ``MetricAverageCallback`` averages the epoch logs and
  ``LearningRateWarmupCallback`` sets the same learning rate on every rank.
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
from dp_plugin import request, runtime

# Before keras.utils.set_random_seed, which imports TensorFlow where it is installed.
TF_IMPORTED = "tensorflow" in sys.modules

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


def dense_model(seed: int, outputs: int = OUTPUTS, activation: str | None = None) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(HIDDEN, activation="tanh"),
        keras.layers.Dense(outputs, activation=activation),
    ])


def conv_model(seed: int, norm: Callable[[], keras.layers.Layer]) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((5, 5, 2)),
        keras.layers.Conv2D(4, 3, padding="same"),
        norm(),
        keras.layers.Activation("relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(OUTPUTS),
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
    table = np.asarray(request.allgather(eng, digest(arrays), f"digest.{what}"))
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


CASES: dict[str, Callable[[object], None]] = {
    "fit": lambda _: case_fit(),
    "optimizer": lambda _: case_fit("optimizer"),
    "conv_sync_bn": lambda _: case_conv_sync_bn(),
    "batch_norm": lambda _: case_batch_norm(),
    "validation": lambda _: case_validation(),
}


def start(_: object) -> None:
    if TF_IMPORTED:
        raise AssertionError("import dp_plugin.keras on the torch backend imported TensorFlow")
    dp.init()
    print(f"rank {dp.rank()} engine {runtime.engine().name}, {dp.size()} ranks, "
          f"backend {keras.backend.backend()}")


def finish(_: object) -> None:
    runtime.engine().barrier()
    dp.shutdown()


if __name__ == "__main__":
    run_cases(CASES, setup=start, teardown=finish)
