"""dp_plugin.tensorflow in one process (local engine): API, equivalence at size 1, errors.

Multi-worker behaviour (equivalence with a single process at 2 workers under
three launchers, MirroredStrategy, mixed precision, layout errors on every
rank) is in tests/multiproc/test_keras_*.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf

import dp_plugin.tensorflow as dp
from dp_plugin.errors import DPPluginError, NotInitializedError
from dp_plugin.launch import runtime
from dp_plugin.tensorflow import compat
from dp_plugin.tensorflow.optimizer import hook_of

RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 5)).astype(np.float32)
Y = RNG.normal(size=(32, 2)).astype(np.float32)



def model(seed: int = 0, built: bool = True) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)]
    return keras.Sequential(([keras.Input((5,))] if built else []) + layers)


def compiled(optimizer: keras.optimizers.Optimizer | None = None, **kw: object) -> keras.Model:
    m = model()
    m.compile(optimizer=optimizer or keras.optimizers.SGD(0.1, momentum=0.9), loss="mse", **kw)
    return m


def fit(m: keras.Model, callbacks: list[keras.callbacks.Callback], **kw: object) -> None:
    m.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=callbacks, **kw)


# -- import paths -----------------------------------------------------------------

def test_keras_alias_is_the_same_api() -> None:
    import dp_plugin.keras as alias

    assert set(alias.__all__) == set(dp.__all__)
    assert alias.DistributedCallback is dp.DistributedCallback
    assert alias.init is dp.init


def test_import_loads_neither_torch_nor_the_adapter_from_the_core() -> None:
    code = (
        "import sys, dp_plugin; assert 'dp_plugin.tensorflow' not in sys.modules\n"
        "assert 'dp_plugin.keras' not in sys.modules\n"
        "import dp_plugin.keras\n"
        "dp_plugin.keras.DistributedCallback  # the backend's API: imported at first use\n"
        "print('torch' in sys.modules, 'dp_plugin.tensorflow' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.stdout.split() == ["False", "True"]


# -- single process: the plugin changes nothing ------------------------------------

def test_fit_with_callback_equals_plain_fit_bitwise() -> None:
    plain, dist = compiled(), compiled()
    fit(plain, [])
    fit(dist, [dp.DistributedCallback()])
    for a, b in zip(plain.get_weights(), dist.get_weights(), strict=True):
        assert np.array_equal(a, b)
    hook = hook_of(dist.optimizer)
    assert hook is not None and hook.bridge.calls == len(X) // 8
    assert hook.bridge.schedulers[0].stats.last is not None
    # evaluate/predict are untouched by the reduction
    assert np.array_equal(plain.predict(X, verbose=0), dist.predict(X, verbose=0))
    assert plain.evaluate(X, Y, verbose=0) == dist.evaluate(X, Y, verbose=0)


def test_repeated_fit_reuses_the_traced_step_unless_settings_change() -> None:
    m = compiled()
    fit(m, [dp.DistributedCallback()])
    first = m.train_function
    fit(m, [dp.DistributedCallback()])
    assert m.train_function is first  # same settings: the traced step is kept
    fit(m, [dp.DistributedCallback(compression=dp.Compression.fp16)])
    assert m.train_function is not first  # new settings: traced again
    assert hook_of(m.optimizer).bridge.compression.name == "fp16"


def test_callback_installs_into_a_step_traced_without_it() -> None:
    m = compiled()
    fit(m, [])
    fit(m, [dp.DistributedCallback()])
    assert hook_of(m.optimizer).bridge.calls == len(X) // 8


def test_distributed_optimizer_and_tape_single_process() -> None:
    m = compiled(dp.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    fit(m, [dp.BroadcastGlobalVariablesCallback(0)])
    assert hook_of(m.optimizer).bridge.calls == len(X) // 8

    v = {"w": tf.Variable([1.0, 2.0]), "unused": tf.Variable(3.0)}
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v["w"] ** 2)
    grads = dp.DistributedGradientTape(tape).gradient(loss, v)
    assert grads["unused"] is None
    assert np.array_equal(grads["w"].numpy(), [2.0, 4.0])


def test_backward_passes_apply_every_nth_step() -> None:
    m = compiled(keras.optimizers.SGD(0.1))
    fit(m, [dp.DistributedCallback(backward_passes_per_step=2)])
    assert int(m.optimizer.iterations) == len(X) // 8 // 2


def test_broadcast_and_shard_at_size_one() -> None:
    v = tf.Variable([1.0, 2.0])
    dp.broadcast_variables([v], root_rank=0)
    tf.function(lambda: dp.broadcast_variables([v], root_rank=0) and None)()
    assert np.array_equal(v.numpy(), [1.0, 2.0])
    assert list(dp.shard(tf.data.Dataset.range(5)).as_numpy_iterator()) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="root_rank 1 is not a rank"):
        dp.broadcast_variables([v], root_rank=1)


def test_unbuilt_model_is_broadcast_after_the_first_batch() -> None:
    m = model(built=False)
    m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.warns(UserWarning, match="after it"):
        fit(m, [dp.DistributedCallback()])


def test_basics() -> None:
    assert (dp.rank(), dp.size(), dp.local_rank(), dp.local_size()) == (0, 1, 0, 1)
    assert dp.is_initialized()


# -- errors ------------------------------------------------------------------------

def test_callback_on_uncompiled_model() -> None:
    cb = dp.DistributedCallback()
    cb.set_model(model())
    with pytest.raises(DPPluginError, match="is not compiled"):
        cb.on_train_begin()


def test_callback_before_init() -> None:
    runtime.shutdown()
    m = compiled()
    with pytest.raises(NotInitializedError, match="DistributedCallback"):
        fit(m, [dp.DistributedCallback()])


def test_optimizer_wrapped_twice() -> None:
    opt = dp.DistributedOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="wrapping it twice"):
        dp.DistributedOptimizer(opt)
    with pytest.raises(ValueError, match="wrapping it twice"):
        dp.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(opt))
    m = compiled(opt)
    with pytest.raises(ValueError, match="would reduce them twice"):
        fit(m, [dp.DistributedCallback()])
    with pytest.raises(TypeError, match="Keras 3 optimizer"):
        dp.DistributedOptimizer("sgd")


def test_tape_errors() -> None:
    with pytest.raises(TypeError, match=r"tf\.GradientTape"):
        dp.DistributedGradientTape(object())  # type: ignore[arg-type]
    with tf.GradientTape() as tape:
        pass
    with pytest.raises(ValueError, match="wrapping it twice"):
        dp.DistributedGradientTape(dp.DistributedGradientTape(tape))  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"op": dp.Adasum}, NotImplementedError, "Adasum is not supported"),
    ({"op": dp.Max}, ValueError, "not a gradient reduction"),
    ({"op": "median"}, ValueError, "not known"),
    ({"compression": "zip"}, ValueError, "compression 'zip'"),
    ({"backward_passes_per_step": 0}, ValueError, "backward_passes_per_step"),
    ({"gradient_predivide_factor": 0}, ValueError, "gradient_predivide_factor"),
    # Refused at the public edge, not first at the first traced step.
    ({"op": dp.Sum, "gradient_predivide_factor": 2.0}, ValueError,
     r"gradient_predivide_factor=2 only applies to op='average' \(got op='sum'\)"),
    ({"root_rank": -1}, ValueError, "root_rank"),
])
def test_bad_arguments(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        dp.DistributedCallback(**kwargs)


def test_root_rank_out_of_range_at_fit() -> None:
    with pytest.raises(ValueError, match="root_rank 2 is not a rank"):
        fit(compiled(), [dp.DistributedCallback(root_rank=2)])


def test_keras_version_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake(version: str, backend: str = "tensorflow") -> types.SimpleNamespace:
        return types.SimpleNamespace(
            __version__=version, backend=types.SimpleNamespace(backend=lambda: backend))

    compat.check_keras(fake("3.15.1"))
    compat.check_keras(fake("3.3.0"))
    for bad in ("3.2.1", "3.16.0", "4.0.0", "2.15.0"):
        with pytest.raises(compat.UnsupportedKerasError, match=r"keras>=3\.3,<3\.16"):
            compat.check_keras(fake(bad))
    with pytest.raises(compat.UnsupportedKerasError, match="KERAS_BACKEND=tensorflow"):
        compat.check_keras(fake("3.15.1", backend="jax"))
    with pytest.raises(compat.UnsupportedKerasError, match="cannot read"):
        compat.check_keras(fake("nightly"))
    monkeypatch.setattr(keras, "__version__", "3.16.0")
    with pytest.raises(compat.UnsupportedKerasError, match=r"3\.16\.0"):
        dp.DistributedOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(compat.UnsupportedKerasError):
        fit(compiled(), [dp.DistributedCallback()])


def test_supported_strategies() -> None:
    compat.check_strategy(tf.distribute.get_strategy(), "test")
    compat.check_strategy(tf.distribute.OneDeviceStrategy("/cpu:0"), "test")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compat.check_strategy(tf.distribute.MirroredStrategy(["/cpu:0"]), "test")
