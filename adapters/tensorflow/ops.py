"""Reduce-op constants and compression choices, spelled as in horovod.tensorflow.

The constants are the core's (``dp_plugin.horovod_names``), shared with the
PyTorch adapter; this module adds the Keras adapter's ``op=`` and
``compression=`` parsing.
"""

from __future__ import annotations

from dp_plugin import horovod_names as _names
from dp_plugin.compression import Compressor
from dp_plugin.compression import get_compressor as _get_compressor
from dp_plugin.edge import caller
from dp_plugin.engines.base import ReduceOp
from dp_plugin.horovod_names import Adasum, Average, Compression, Max, Min, Product, Sum

__all__ = [
    "Adasum", "Average", "Compression", "Max", "Min", "Product", "Sum",
    "parse_compression", "parse_gradient_op",
]


def parse_gradient_op(op: object) -> ReduceOp:
    """Validate a user's ``op=`` for gradients: Average (default) or Sum."""
    parsed = _names.parse_op(op, prefix="dp.",
                             instead="op=dp.Average (the default) or op=dp.Sum")
    _names.require_sum_or_average(parsed, "is not a gradient reduction (Average is the "
                                  "default)", prefix="dp.")
    return parsed


def parse_compression(compression: object) -> Compressor:
    """A compressor from ``Compression.x``, a name ('none', 'fp16', 'bf16') or an object."""
    try:
        return _get_compressor(compression)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"{caller()}: {exc}; use dp.Compression.none/fp16/bf16") from None
