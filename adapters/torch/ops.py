"""Reduce ops and compression as horovod.torch spells them, and ``op=`` parsing.

The constants and the parsing rule are the core's (``dp_plugin.api.horovod_names``),
shared with the Keras adapter; this module words them for horovod.torch users.
"""

from __future__ import annotations

import functools

from dp_plugin.api import horovod_names as _names
from dp_plugin.api.horovod_names import Adasum, Average, Compression, Max, Min, Product, Sum

__all__ = ["Adasum", "Average", "Compression", "Max", "Min", "Product", "Sum", "parse_op"]

INSTEAD = ("op=hvd.Average (the default), which gives the same convergence for synchronous SGD "
           "without Adasum's learning-rate scaling")
"""What an ``op=hvd.Adasum`` error advises horovod.torch users."""

parse_op = functools.partial(_names.parse_op, prefix="hvd.", instead=INSTEAD)
"""Validate a user's ``op=``; Adasum gets a NotImplementedError naming the way out."""

resolve_op = functools.partial(_names.resolve_op, prefix="hvd.", instead=INSTEAD)
"""Horovod's ``op``/deprecated ``average`` rule; ``None`` means Average."""
