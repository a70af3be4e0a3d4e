"""``import dp_plugin.keras as dp``: data-parallel Keras 3, on the backend Keras runs.

One set of names for every supported backend, chosen from
``keras.backend.backend()`` when this package is imported:

- ``tensorflow``: ``dp_plugin.tensorflow``'s API, Horovod-Keras flavoured
  (``tensorflow_api``);
- ``torch``: the same Keras callbacks and optimizer over the torch adapter
  (``torch_api``); TensorFlow is not imported.

The callbacks that need no gradient path (``MetricAverageCallback``, the
learning-rate callbacks) are one implementation for both, in this package
(``metric_average``, ``callbacks_lr``). Other backends are refused with the
reason and what to use (JAX has its own multi-process path:
``keras.distribution`` with ``jax.distributed``; see docs/keras.md).

The backend's API module is imported at the first name read from this
package (PEP 562's module ``__getattr__``), not when the package is: the
TensorFlow adapter imports this package's shared callbacks while it is
itself being imported, and ``tensorflow_api`` imports that adapter. It
lives with the adapters (installed as ``dp_plugin.keras``): importing
``dp_plugin`` imports neither this package nor a framework.
"""

import importlib
from typing import Any

import keras as _keras

BACKEND = _keras.backend.backend()
"""The Keras backend this package was imported under."""

_APIS = {"tensorflow": "dp_plugin.keras.tensorflow_api", "torch": "dp_plugin.keras.torch_api"}

if BACKEND not in _APIS:
    raise ImportError(
        f"dp_plugin.keras supports KERAS_BACKEND=tensorflow and KERAS_BACKEND=torch, but Keras "
        f"runs on {BACKEND!r}. "
        + ("For JAX use Keras's own multi-process training: jax.distributed.initialize() "
           "on every process, then keras.distribution.set_distribution("
           "keras.distribution.DataParallel()) (docs/keras.md). " if BACKEND == "jax" else "")
        + "Or set KERAS_BACKEND=torch (or tensorflow) before Keras is first imported")


def _api() -> Any:
    return importlib.import_module(_APIS[BACKEND])


def __getattr__(name: str) -> Any:
    try:
        return getattr(_api(), name)
    except AttributeError:
        raise AttributeError(f"module 'dp_plugin.keras' has no attribute {name!r} on the "
                             f"{BACKEND} backend") from None


def __dir__() -> list[str]:
    return sorted({*globals(), *_api().__all__})
