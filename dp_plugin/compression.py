"""Wire compression of packed buffers: none, fp16, bf16.

Horovod's shape (``compress`` before the all-reduce, ``decompress`` after), but
on whole fusion buffers and without allocation: the scheduler owns a
persistent wire buffer per bucket of dtype ``wire_dtype(bucket dtype)`` and a
compressor only casts between the two (``ArrayOps.cast_into``). When the wire
dtype equals the bucket dtype no wire buffer exists and nothing is copied.

Like Horovod's ``Compression.fp16``, only floating buffers wider than the
wire type are narrowed; integer and already-narrow buffers pass through
unchanged (bf16 does not "compress" fp16, which has the same width).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from dp_plugin.arrays import ArrayOps
from dp_plugin.dtypes import SUPPORTED_DTYPES, canonical_dtype, is_floating


@runtime_checkable
class Compressor(Protocol):
    """A wire format for fusion buffers."""

    name: str

    def wire_dtype(self, dtype: str) -> str:
        """Dtype the all-reduce runs in for a bucket of ``dtype``."""
        ...

    def compress(self, ops: ArrayOps, wire: Any, flat: Any) -> None:
        """Fill ``wire`` from the packed buffer ``flat`` (same length)."""
        ...

    def decompress(self, ops: ArrayOps, flat: Any, wire: Any) -> None:
        """Fill ``flat`` from the reduced ``wire`` buffer (same length)."""
        ...


class _CastCompressor:
    """Narrow floating buffers to ``_wire`` by a plain cast."""

    name = "cast"
    _wire: str | None = None

    def wire_dtype(self, dtype: str) -> str:
        dtype = canonical_dtype(dtype)
        wire = self._wire
        if wire is None or not is_floating(dtype):
            return dtype
        return wire if SUPPORTED_DTYPES[dtype] > SUPPORTED_DTYPES[wire] else dtype

    def compress(self, ops: ArrayOps, wire: Any, flat: Any) -> None:
        if wire is not flat:
            ops.cast_into(wire, flat)

    def decompress(self, ops: ArrayOps, flat: Any, wire: Any) -> None:
        if wire is not flat:
            ops.cast_into(flat, wire)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoneCompressor(_CastCompressor):
    """No compression: the all-reduce runs in the gradients' own dtype (the default)."""

    name = "none"


class FP16Compressor(_CastCompressor):
    """float32/float64 buckets travel as float16 (halves the bytes; loses range)."""

    name = "fp16"
    _wire = "float16"


class BF16Compressor(_CastCompressor):
    """float32/float64 buckets travel as bfloat16 (float32's range, 8 bits of mantissa)."""

    name = "bf16"
    _wire = "bfloat16"


COMPRESSORS: dict[str, type[_CastCompressor]] = {
    c.name: c for c in (NoneCompressor, FP16Compressor, BF16Compressor)
}


def get_compressor(name_or_obj: str | Compressor | None) -> Compressor:
    """A compressor by name ('none', 'fp16', 'bf16'), or the object itself.

    ``None`` means 'none'. Anything else raises ``ValueError`` listing the
    valid names.
    """
    if name_or_obj is None:
        return NoneCompressor()
    if isinstance(name_or_obj, str):
        cls = COMPRESSORS.get(name_or_obj.strip().lower())
        if cls is None:
            raise ValueError(
                f"compression {name_or_obj!r} is not known; valid values: "
                f"{', '.join(COMPRESSORS)} (or a Compressor object)"
            )
        return cls()
    if isinstance(name_or_obj, type) and issubclass(name_or_obj, _CastCompressor):
        return name_or_obj()  # Horovod passes classes (Compression.fp16); accept them too
    if isinstance(name_or_obj, Compressor):
        return name_or_obj
    raise ValueError(
        f"compression {name_or_obj!r} is neither a name ({', '.join(COMPRESSORS)}) nor an "
        "object with name, wire_dtype, compress and decompress"
    )
