"""Reduce-op constants and compression choices, spelled as in horovod.tensorflow.

``dp.Average`` etc. are the core's ``ReduceOp`` members and ``Compression.fp16``
names the core's compressor class (Horovod users pass the class), so both go
to the core unchanged. The PyTorch adapter spells the same names; they are
repeated here because importing ``dp_plugin.torch`` would load torch.
"""

from __future__ import annotations

from dp_plugin.compression import BF16Compressor, Compressor, FP16Compressor, NoneCompressor
from dp_plugin.compression import get_compressor as _get_compressor
from dp_plugin.engines.base import ReduceOp

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

# Ops that make sense for gradients: a sum (optionally averaged) of the
# workers' contributions. Min/max/product of gradients is not a descent step.
_GRADIENT_OPS = (ReduceOp.AVERAGE, ReduceOp.SUM)


class _AdasumOp:
    """Placeholder so that ``op=dp.Adasum`` can be named and then refused clearly."""

    def __repr__(self) -> str:
        return "Adasum"


Adasum = _AdasumOp()


class Compression:
    """Optional gradient compression on the wire, as ``horovod.tensorflow.Compression``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def parse_gradient_op(op: object, what: str) -> ReduceOp:
    """Validate a user's ``op=`` for gradients: Average (default) or Sum."""
    if op is Adasum:
        raise NotImplementedError(
            f"{what}: op=dp.Adasum is not supported by dp_plugin; use op=dp.Average "
            "(the default) or op=dp.Sum"
        )
    parsed = ReduceOp.AVERAGE if op is None else ReduceOp.parse(op)  # type: ignore[arg-type]
    if parsed not in _GRADIENT_OPS:
        raise ValueError(
            f"{what}: op={parsed.value!r} is not a gradient reduction; use op=dp.Average "
            "(the default) or op=dp.Sum"
        )
    return parsed


def parse_compression(compression: object, what: str) -> Compressor:
    """A compressor from ``Compression.x``, a name ('none', 'fp16', 'bf16') or an object."""
    try:
        return _get_compressor(compression)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}; use dp.Compression.none/fp16/bf16") from None
