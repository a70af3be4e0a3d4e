"""``import dp_plugin.keras as dp``: the same API as ``dp_plugin.tensorflow``.

Importing ``dp_plugin`` does not import this module (nor TensorFlow); only
``import dp_plugin.keras`` does.
"""

from dp_plugin.tensorflow import *  # noqa: F403 - this module is an alias
from dp_plugin.tensorflow import __all__ as __all__
