"""dp_plugin: Horovod-style data parallelism for PyTorch 2.x and Keras 3.

The framework-agnostic core lives in ``dp_plugin/``; framework glue lives in
``adapters/`` and is installed as ``dp_plugin.torch``, ``dp_plugin.tensorflow``
and ``dp_plugin.keras`` (Horovod-Keras-style alias of the TensorFlow adapter).
``adapters`` is never a top-level import name: an unrelated PyPI package owns it.
"""

from setuptools import setup

setup(
    name="dp_plugin",
    version="0.1.0",
    description="Horovod-style data-parallel training for PyTorch 2.x and Keras 3",
    python_requires=">=3.10",
    packages=[
        "dp_plugin", "dp_plugin.engines", "dp_plugin.torch", "dp_plugin.tensorflow",
        "dp_plugin.keras",
    ],
    package_dir={
        "dp_plugin": "dp_plugin",
        "dp_plugin.torch": "adapters/torch",
        "dp_plugin.tensorflow": "adapters/tensorflow",
        "dp_plugin.keras": "adapters/keras",
    },
    install_requires=["numpy", "ml_dtypes"],
    extras_require={
        "torch": ["torch>=2.1"],
        "tensorflow": ["tensorflow>=2.16"],
        "mpi": ["mpi4py>=3.1"],
    },
)
