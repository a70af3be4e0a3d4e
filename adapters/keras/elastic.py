"""``dp_plugin.keras.elastic``: ``horovod.tensorflow.keras.elastic``'s names
(``KerasState``, ``run``, the commit/batch/epoch callbacks), which are
``dp_plugin.tensorflow.elastic``'s (see there and docs/elastic.md)."""

from dp_plugin.tensorflow.elastic import *  # noqa: F403 - this module is an alias
from dp_plugin.tensorflow.elastic import __all__ as __all__
