"""``import dp_plugin.keras as dp``: data-parallel Keras 3, on the backend Keras runs.

One set of names for every supported backend, chosen from
``keras.backend.backend()`` when this package is imported:

- ``tensorflow``: ``dp_plugin.tensorflow``'s API, Horovod-Keras flavoured
  (``tensorflow_api``);
- ``torch``: the same Keras callbacks and optimizer over the torch adapter
  (``torch_api``); TensorFlow is not imported.

Other backends are refused with the reason and what to use (JAX has its own
multi-process path: ``keras.distribution`` with ``jax.distributed``; see
docs/keras.md). It lives with the adapters (installed as ``dp_plugin.keras``):
importing ``dp_plugin`` imports neither this package nor a framework.
"""

import keras as _keras

BACKEND = _keras.backend.backend()
"""The Keras backend this package was imported under."""

if BACKEND == "tensorflow":
    from dp_plugin.keras.tensorflow_api import *  # noqa: F403 - the backend's API
    from dp_plugin.keras.tensorflow_api import __all__ as __all__
elif BACKEND == "torch":
    from dp_plugin.keras.torch_api import *  # noqa: F403 - the backend's API
    from dp_plugin.keras.torch_api import __all__ as __all__
else:
    raise ImportError(
        f"dp_plugin.keras supports KERAS_BACKEND=tensorflow and KERAS_BACKEND=torch, but Keras "
        f"runs on {BACKEND!r}. "
        + ("For JAX use Keras's own multi-process training: jax.distributed.initialize() "
           "on every process, then keras.distribution.set_distribution("
           "keras.distribution.DataParallel()) (docs/keras.md). " if BACKEND == "jax" else "")
        + "Or set KERAS_BACKEND=torch (or tensorflow) before Keras is first imported")
