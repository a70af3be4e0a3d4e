"""Worker: the Keras adapter's multi-rank errors are raised on every rank, never hang.

Run under any launcher (see tests/multiproc/harness.py)::

    python keras_errors.py --case layout_mismatch     # prints "rank R OK"
    python keras_errors.py --list-cases

Two cases (TensorFlow starts slowly, so each launch checks several errors):
``layout_mismatch`` runs 1-3 below, ``strategies`` runs 4-5.

1. callback: the last rank builds a wider hidden layer; ``fit`` with
   ``DistributedCallback`` must raise ``LayoutMismatchError`` on every rank
   (from the weight broadcast's layout check), naming the differing weight.
2. bridge: the same models compiled with ``DistributedOptimizer`` and no
   broadcast; the first train step's layout check runs inside the numpy
   bridge and must fail on every rank with ``LayoutMismatchError`` (checked
   while the step is traced, before it runs).
3. tape: the same through ``DistributedGradientTape`` in a ``tf.function``
   (AutoGraph re-raises it as its ``StagingError``, with the message).
4. passes: ``backward_passes_per_step=2`` with a MirroredStrategy model is
   refused (``UnsupportedStrategyError``) when the step is traced.
5. strategy: a model under ``MultiWorkerMirroredStrategy`` is refused
   (``UnsupportedStrategyError``) before anything is communicated.

Afterwards a barrier and one all-reduce show the ranks are still in step.
Any unexpected outcome prints a traceback and exits 1 at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from _fail_fast import run_cases

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

# Two logical CPUs (before the runtime starts), for MirroredStrategy.
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import dp_plugin.tensorflow as dp  # noqa: E402
from dp_plugin.launch import runtime  # noqa: E402


def make_model() -> keras.Model:
    hidden = 12 if dp.rank() == dp.size() - 1 else 8
    return keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(hidden), keras.layers.Dense(1),
    ])


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(dp.rank())
    return rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(16, 1)).astype(np.float32)


def expect(what: str, check: Callable[[BaseException], bool], fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception as exc:
        if not check(exc):
            raise AssertionError(f"{what}: unexpected {type(exc).__name__}: {exc}") from exc
        first = str(exc).strip().splitlines()[0][:300]
        print(f"rank {dp.rank()} {what}: {type(exc).__name__}: {first}")
        print(f"rank {dp.rank()} {what.upper()}-OK")
        return
    raise AssertionError(f"{what}: no error was raised")


def is_layout_error(exc: BaseException) -> bool:
    return isinstance(exc, dp.LayoutMismatchError) and "kernel" in str(exc)


def case_callback() -> None:
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = data()
    expect("callback", is_layout_error,
           lambda: model.fit(x, y, batch_size=8, verbose=0, callbacks=[dp.DistributedCallback()]))


def case_bridge() -> None:
    model = make_model()
    model.compile(optimizer=dp.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = data()
    expect("bridge", is_layout_error, lambda: model.fit(x, y, batch_size=8, verbose=0))


def case_tape() -> None:
    model = make_model()
    x, y = data()

    @tf.function
    def grads() -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        return dp.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)

    # AutoGraph re-raises errors of the user's converted function as its own
    # StagingError (for any exception type it cannot rebuild), message kept.
    expect("tape", lambda e: is_layout_error(e) or (
        type(e).__name__ == "StagingError" and "LayoutMismatchError: rank" in str(e)
        and "kernel" in str(e)), grads)


def case_strategy() -> None:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = data()
    expect("strategy",
           lambda e: isinstance(e, dp.UnsupportedStrategyError)
           and "MultiWorkerMirroredStrategy" in str(e),
           lambda: model.fit(x, y, batch_size=8, verbose=0, callbacks=[dp.DistributedCallback()]))


def case_passes() -> None:
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = data()
    callback = dp.DistributedCallback(backward_passes_per_step=2)
    expect("passes",
           lambda e: isinstance(e, dp.UnsupportedStrategyError)
           and "backward_passes_per_step=2 needs one replica" in str(e),
           lambda: model.fit(x, y, batch_size=8, verbose=0, callbacks=[callback]))


def case_layout_mismatch(_: object) -> None:
    case_callback()
    case_bridge()
    case_tape()


def case_strategies(_: object) -> None:
    case_passes()
    case_strategy()


def case_uneven_shards(_: object) -> None:
    """The README's Keras snippet with 10 batches of 64 on rank 0 and 11 on rank 1:
    a plain ValueError on both ranks before the first step, naming each rank's
    count and the fix; with that fix (steps_per_epoch=10) the same fit trains.
    Before, LayoutMismatchError on one rank and TensorFlow's InvalidArgumentError
    on the other, at the end of the epoch, neither naming the batch counts."""
    rows = 64 * (10 + dp.rank())
    rng = np.random.default_rng(dp.rank())
    dataset = tf.data.Dataset.from_tensor_slices(
        (rng.normal(size=(rows, 4)).astype(np.float32),
         rng.normal(size=(rows, 1)).astype(np.float32)))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01 * dp.size()), loss="mse")
    callbacks = [dp.DistributedCallback(), dp.MetricAverageCallback()]
    expect("uneven", lambda exc: isinstance(exc, ValueError) and (
        "different numbers of batches per epoch (rank 0: 10; rank 1: 11)" in str(exc)
        and "steps_per_epoch=10" in str(exc) and "drop_remainder=True" in str(exc)),
        lambda: model.fit(dataset.batch(64), callbacks=callbacks, verbose=0))
    model.fit(dataset.batch(64), steps_per_epoch=10, callbacks=callbacks, verbose=0)
    weights = dp.allgather_object([w.numpy() for w in model.weights])
    for a, b in zip(weights[0], weights[1], strict=True):
        np.testing.assert_array_equal(a, b)
    print(f"rank {dp.rank()} STEPS-OK")


CASES = {
    "layout_mismatch": case_layout_mismatch,
    "strategies": case_strategies,
    "uneven_shards": case_uneven_shards,
}


def still_in_step(_: object) -> None:
    """After the errors a barrier and one all-reduce: the ranks are still in step."""
    eng = runtime.engine()
    eng.barrier()
    buf = np.ones(3, dtype=np.float32)
    eng.allreduce_async(buf, "sum", name="still_in_step").wait()
    if not np.array_equal(buf, np.full(3, dp.size(), dtype=np.float32)):
        raise AssertionError(f"ranks out of step after the errors: {buf}")
    dp.shutdown()


if __name__ == "__main__":
    run_cases(CASES, setup=lambda _: dp.init(), teardown=still_in_step)
