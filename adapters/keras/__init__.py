"""``import dp_plugin.keras as dp``: the same API as ``dp_plugin.tensorflow``.

Horovod spells its Keras entry ``import horovod.keras as hvd``; this is the
same entry for dp_plugin. It lives with the adapters (installed as
``dp_plugin.keras``, see setup.py), not in the framework-agnostic core:
importing ``dp_plugin`` imports neither this module nor TensorFlow; only
``import dp_plugin.keras`` does.
"""

from dp_plugin.tensorflow import *  # noqa: F403 - this module is an alias
from dp_plugin.tensorflow import __all__ as __all__
