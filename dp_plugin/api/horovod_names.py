"""The reduce-op constants and ``Compression`` that Horovod users spell.

Both adapters export these same objects (``hvd.Average``, ``dp.Compression.fp16``
...): they are the core's ``ReduceOp`` members and compressor classes
(Horovod users pass the class), so they go to the core unchanged. They live
in the core because each adapter imports its framework, and the Keras adapter
must not load torch just to share a constant. So does Horovod's rule for
``op=`` and the deprecated ``average=`` (``resolve_op``).
"""

from __future__ import annotations

import warnings

from dp_plugin.agree.edge import caller
from dp_plugin.engines.base import ReduceOp
from dp_plugin.reduce.compression import BF16Compressor, FP16Compressor, NoneCompressor

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


def parse_op(op: object, *, prefix: str, instead: str) -> ReduceOp:
    """A user's ``op=`` as a ``ReduceOp`` (``None``: Average). ``Adasum`` is
    refused with a NotImplementedError naming ``instead``; ``prefix`` is how
    the adapter's users spell the module (``hvd.``, ``dp.``)."""
    if op is Adasum:
        raise NotImplementedError(
            f"{caller()}: op={prefix}Adasum is not supported by dp_plugin; use {instead}")
    return ReduceOp.AVERAGE if op is None else ReduceOp.parse(op)  # type: ignore[arg-type]


def resolve_op(op: object, average: bool | None, *, prefix: str, instead: str) -> ReduceOp:
    """Horovod's ``op`` with its deprecated ``average`` flag (True: Average,
    False: Sum, with a DeprecationWarning, as Horovod's); then ``parse_op``.
    Call it from a ``@public`` function (the warning points at its caller,
    past the decorator)."""
    if op is not None and average is not None:
        raise ValueError(
            f"{caller()}: the op parameter supersedes average; pass only one of them "
            f"(got op={op!r}, average={average!r})"
        )
    if average is not None:
        warnings.warn(
            f"Parameter `average` has been replaced with `op` and will be removed in v1.0; "
            f"pass op={prefix}Average or op={prefix}Sum",
            DeprecationWarning, stacklevel=4,
        )
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    return parse_op(op, prefix=prefix, instead=instead)


def require_sum_or_average(op: ReduceOp, refusal: str, *, prefix: str, otherwise: str = "",
                           error: type[Exception] = ValueError) -> None:
    """Horovod's rule wherever values are gathered rather than reduced (sparse
    tensors, ``tf.IndexedSlices``) or must make a descent step (gradients):
    only Sum and Average. Otherwise ``error``: the public call, ``op``, the
    ``refusal`` ("is not supported for sparse tensors"), the two ops to use
    (spelled with ``prefix``) and ``otherwise`` (", or sparse_as_dense=True")."""
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise error(f"{caller()}: op={op.name.capitalize()} {refusal}; use op={prefix}Average "
                    f"or op={prefix}Sum{otherwise}")
