"""dp_plugin: Horovod-style data parallelism for PyTorch 2.x and Keras 3.

The framework-agnostic core lives in ``dp_plugin/``; framework glue lives in
``adapters/`` and is installed as ``dp_plugin.torch``, ``dp_plugin.tensorflow``
and ``dp_plugin.keras`` (Keras 3 on the TensorFlow and torch backends).
``adapters`` is never a top-level import name: an unrelated PyPI package owns it.
Metadata, dependencies and the ``dp-plugin`` console script are in pyproject.toml.
"""

from setuptools import setup

setup(
    packages=[
        "dp_plugin", "dp_plugin.reduce", "dp_plugin.agree", "dp_plugin.launch",
        "dp_plugin.api", "dp_plugin.engines", "dp_plugin.torch", "dp_plugin.tensorflow",
        "dp_plugin.keras", "dp_plugin.cli", "dp_plugin.ray", "dp_plugin.lightning",
    ],
    package_dir={
        "dp_plugin": "dp_plugin",
        "dp_plugin.torch": "adapters/torch",
        "dp_plugin.tensorflow": "adapters/tensorflow",
        "dp_plugin.keras": "adapters/keras",
        "dp_plugin.lightning": "adapters/torch/lightning",
    },
    # The TensorFlow adapter compiles this kernel on first use (status_op.py).
    package_data={"dp_plugin.tensorflow": ["status_op.cc"]},
)
