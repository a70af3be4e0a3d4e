"""``dp_plugin.keras`` on ``KERAS_BACKEND=torch`` in one process (local engine).

Keras keeps the backend it was first imported with, and this pytest process
may already hold Keras on TensorFlow, so each check runs in a fresh
interpreter with ``KERAS_BACKEND`` set. Training across ranks:
tests/multiproc/test_keras_torch_train.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def run_python(code: str, backend: str = "torch") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KERAS_BACKEND": backend, "DP_PLUGIN_ENGINE": "local",
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=240, env=env)


def test_one_process_fit_misuse_and_no_tensorflow() -> None:
    """With one rank the callback changes nothing (bitwise); misuse raises with
    the fix; TensorFlow is never imported."""
    result = run_python("""
        import sys
        import keras, numpy as np, pytest
        import dp_plugin.keras as dp
        assert dp.BACKEND == "torch" and "tensorflow" not in sys.modules
        dp.init()

        def model():
            init = keras.initializers.GlorotUniform(seed=1)
            m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, kernel_initializer=init),
                                  keras.layers.Dense(2, kernel_initializer=init)])
            m.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
            return m

        x = np.linspace(-1, 1, 48, dtype="float32").reshape(16, 3)
        y = np.stack([x.sum(1), x[:, 0]], 1)
        plain, dist = model(), model()
        plain.fit(x, y, batch_size=4, verbose=0, shuffle=False)
        dist.fit(x, y, batch_size=4, verbose=0, shuffle=False,
                 callbacks=[dp.DistributedCallback(), dp.MetricAverageCallback()])
        for a, b in zip(plain.get_weights(), dist.get_weights(), strict=True):
            assert np.array_equal(a, b)

        with pytest.raises(ValueError, match="gradient_accumulation_steps"):
            dp.DistributedCallback(backward_passes_per_step=2)
        with pytest.raises(ValueError, match="compression="):
            dp.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="zip")
        opt = dp.DistributedOptimizer(keras.optimizers.SGD(0.1))
        with pytest.raises(ValueError, match="already distributed"):
            dp.DistributedOptimizer(opt)
        twice = model()
        twice.compile(optimizer=opt, loss="mse")
        with pytest.raises(ValueError, match="would reduce them twice"):
            twice.fit(x, y, verbose=0, callbacks=[dp.DistributedCallback()])
        assert "tensorflow" not in sys.modules
        print("OK")
    """)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("OK")


@pytest.mark.parametrize("backend", ["jax", "numpy"])
def test_other_backends_are_refused_naming_what_to_use(backend: str) -> None:
    # Keras's jax and numpy backends need jax, which is not installed here: the
    # backend Keras reports is replaced instead.
    result = run_python(f"""
        import keras
        keras.backend.backend = lambda: {backend!r}
        import dp_plugin.keras
    """)
    assert result.returncode != 0
    assert (f"supports KERAS_BACKEND=tensorflow and KERAS_BACKEND=torch, but Keras runs on "
            f"'{backend}'") in result.stderr
    assert "set KERAS_BACKEND=torch (or tensorflow)" in result.stderr
    assert ("keras.distribution" in result.stderr) == (backend == "jax")
