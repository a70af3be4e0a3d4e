"""The reduce-op constants and ``Compression`` that Horovod users spell.

Both adapters export these same objects (``hvd.Average``, ``dp.Compression.fp16``
...): they are the core's ``ReduceOp`` members and compressor classes
(Horovod users pass the class), so they go to the core unchanged. They live
in the core because each adapter imports its framework, and the Keras adapter
must not load torch just to share a constant.
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
    """Sentinel so that ``op=Adasum`` can be named and then refused clearly."""

    def __repr__(self) -> str:
        return "Adasum"


Adasum = _AdasumOp()


class Compression:
    """Optional wire compression, as ``horovod.torch/tensorflow.Compression``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
