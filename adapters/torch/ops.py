"""Reduce ops and compression as horovod.torch spells them, and ``op=`` parsing.

The constants are the core's (``dp_plugin.horovod_names``), shared with the
Keras adapter.
"""

from __future__ import annotations

from dp_plugin.engines.base import ReduceOp
from dp_plugin.horovod_names import Adasum, Average, Compression, Max, Min, Product, Sum

__all__ = ["Adasum", "Average", "Compression", "Max", "Min", "Product", "Sum", "parse_op"]


def parse_op(op: object, what: str) -> ReduceOp:
    """Validate a user's ``op=``; Adasum gets a NotImplementedError naming the way out."""
    if op is Adasum:
        raise NotImplementedError(
            f"{what}: op=hvd.Adasum is not supported by dp_plugin; use op=hvd.Average "
            "(the default), which gives the same convergence for synchronous SGD without "
            "Adasum's learning-rate scaling"
        )
    if op is None:
        return ReduceOp.AVERAGE
    return ReduceOp.parse(op)  # type: ignore[arg-type]

