"""Reduce-op constants and compression choices, spelled as in horovod.torch.

``hvd.Average`` etc. are the core's ``ReduceOp`` members, so they can be
passed straight to the core; ``Compression.fp16`` names the core's
compressor class (Horovod users pass the class, not an instance).
"""

from __future__ import annotations

from dp_plugin.compression import BF16Compressor, FP16Compressor, NoneCompressor
from dp_plugin.engines.base import ReduceOp

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


class _AdasumOp:
    """Placeholder value so ``op=hvd.Adasum`` can be named and then refused clearly."""

    def __repr__(self) -> str:
        return "Adasum"


Adasum = _AdasumOp()


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


class Compression:
    """Optional gradient compression, as ``horovod.torch.Compression``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
