"""``jit_compile=True`` under the callbacks (the split train step, ``xla_split``) and
the bridge's per-bucket ops, in one process (local engine).

Across 2 workers (ranks bitwise equal, within 1e-5 of one process, and the
multi-replica fallback) see the ``fit_jit`` case of tests/multiproc/workers/keras_train.py.
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf

import dp_plugin.tensorflow as dp
from dp_plugin.config import Config
from dp_plugin.errors import DPPluginError
from dp_plugin.launch import runtime
from dp_plugin.tensorflow.optimizer import hook_of
from dp_plugin.tensorflow.xla_split import is_split, is_split_for

RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 5)).astype(np.float32)
Y = RNG.normal(size=(32, 2)).astype(np.float32)
STEPS = len(X) // 8
TOL = 1e-5



def compiled(jit: bool, optimizer: keras.optimizers.Optimizer | None = None,
             model_class: type = keras.Sequential, **kw: object) -> keras.Model:
    keras.utils.set_random_seed(0)
    m = model_class([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                     keras.layers.Dense(2)])
    m.compile(optimizer=optimizer or keras.optimizers.SGD(0.1, momentum=0.9), loss="mse",
              metrics=["mae"], jit_compile=jit, **kw)
    if jit and not m.jit_compile:
        pytest.skip("Keras refused jit_compile=True for this model")
    return m


def fit(m: keras.Model, callbacks: list[keras.callbacks.Callback]) -> dict:
    return m.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                 callbacks=callbacks).history


def assert_close(a: keras.Model, b: keras.Model) -> None:
    for wa, wb in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_allclose(wa, wb, atol=TOL, rtol=0)


def test_jit_compile_is_kept_and_trains_as_without_it() -> None:
    plain, jit = compiled(False), compiled(True)
    want = fit(plain, [dp.DistributedCallback()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "turning off jit_compile" warning
        got = fit(jit, [dp.DistributedCallback()])
    assert jit.jit_compile is True
    hook = hook_of(jit.optimizer)
    assert hook is not None and is_split_for(jit, hook)
    assert hook.bridge.calls == 2 * STEPS and int(jit.optimizer.iterations) == 2 * STEPS
    assert_close(jit, plain)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(got[key], want[key], atol=TOL, rtol=0)
    np.testing.assert_allclose(jit.evaluate(X, Y, verbose=0), plain.evaluate(X, Y, verbose=0),
                               atol=TOL, rtol=0)
    first = jit.train_function
    fit(jit, [dp.DistributedCallback()])
    assert jit.train_function is first  # same settings: the split step is reused


def test_jit_with_steps_per_execution_and_distributed_optimizer() -> None:
    plain = compiled(False)
    fit(plain, [dp.DistributedCallback()])
    jit = compiled(True, dp.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                   steps_per_execution=3)
    fit(jit, [dp.BroadcastGlobalVariablesCallback(0)])
    assert jit.jit_compile is True and is_split(jit)
    assert hook_of(jit.optimizer).bridge.calls == 2 * STEPS  # type: ignore[union-attr]
    assert_close(jit, plain)


def test_jit_with_backward_passes() -> None:
    plain, jit = compiled(False), compiled(True)
    fit(plain, [dp.DistributedCallback(backward_passes_per_step=2)])
    fit(jit, [dp.DistributedCallback(backward_passes_per_step=2)])
    assert jit.jit_compile is True and is_split(jit)
    assert int(jit.optimizer.iterations) == STEPS  # 2 epochs, every 2nd step applies
    assert_close(jit, plain)


def test_turning_jit_off_later_rebuilds_the_plain_step() -> None:
    m = compiled(True)
    fit(m, [dp.DistributedCallback()])
    assert is_split(m)
    m.jit_compile = False
    fit(m, [dp.DistributedCallback()])
    assert not is_split(m)
    assert hook_of(m.optimizer).bridge.calls == 4 * STEPS  # type: ignore[union-attr]


class AppliesTwice(keras.Sequential):
    def train_step(self, data: object) -> dict:
        x, y = data  # type: ignore[misc]
        for _ in range(2):
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights, strict=True))
        return self.compute_metrics(x, y, self(x), sample_weight=None)


def test_jit_train_step_applying_twice_is_refused() -> None:
    m = compiled(True, model_class=AppliesTwice)
    with pytest.raises(DPPluginError, match=r"more than once.*jit_compile=False"):
        fit(m, [dp.DistributedCallback()])
    plain = compiled(False, model_class=AppliesTwice)  # without XLA it trains
    fit(plain, [dp.DistributedCallback()])
    assert int(plain.optimizer.iterations) == 4 * STEPS


# -- the bridge: one launching op per bucket ---------------------------------------

def test_one_launching_op_per_bucket_and_equal_results() -> None:
    runtime.shutdown()
    runtime.init(Config(engine="local", fusion_threshold=64, first_bucket_threshold=None),
                 env={})
    variables = [tf.Variable(np.arange(n, dtype=np.float32)) for n in (10, 20, 30)]

    @tf.function
    def step() -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = sum(tf.reduce_sum(v * v) for v in variables)
        return dp.DistributedGradientTape(tape).gradient(loss, variables)

    graph = step.get_concrete_function().graph
    launches = [op for op in graph.get_operations() if op.name.startswith("dp_plugin_launch")]
    assert len(launches) == 3  # 40, 80 and 120 bytes: one bucket each at 64 bytes
    for got, v in zip(step(), variables, strict=True):
        assert np.array_equal(got.numpy(), 2 * v.numpy())


def test_tape_results_survive_the_next_step() -> None:
    """The tape's caller may keep its gradients: they are not the fusion buffer."""
    v = tf.Variable([1.0, 2.0, 3.0])

    def grads(scale: float) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = scale * tf.reduce_sum(v)
        return dp.DistributedGradientTape(tape).gradient(loss, [v])[0]

    first = grads(1.0)
    second = grads(5.0)
    assert np.array_equal(first.numpy(), [1.0, 1.0, 1.0])
    assert np.array_equal(second.numpy(), [5.0, 5.0, 5.0])


def test_jit_with_mixed_precision_loss_scaling() -> None:
    """The LossScaleOptimizer's apply (unscale, finiteness check, update) runs in the
    XLA apply part; the scale evolves as without XLA."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        plain, jit = compiled(False), compiled(True)
        assert isinstance(jit.optimizer, keras.optimizers.LossScaleOptimizer)
        fit(plain, [dp.DistributedCallback()])
        fit(jit, [dp.DistributedCallback()])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert jit.jit_compile is True and is_split(jit)
    assert int(jit.optimizer.iterations) == int(plain.optimizer.iterations) == 2 * STEPS
    assert float(jit.optimizer.dynamic_scale) == float(plain.optimizer.dynamic_scale)
    for wa, wb in zip(jit.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(wa, wb, atol=1e-3, rtol=0)
