"""Wire compression: Horovod's ``Compressor`` interface, and its use on fusion buffers.

Horovod's public interface is kept exactly: a compressor is a class (or an
object) with ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor,
ctx) -> tensor``; ``Compression.none`` / ``.fp16`` / ``.bf16`` are such
classes, callable on torch tensors, numpy arrays and TensorFlow tensors, and
users subclass ``Compressor`` (or one of them) with their own pair.

On the fused paths (``DistributedOptimizer``, the Keras bridge, grouped
collectives) two kinds of compressor are told apart by ``get_compressor``:

- the built-in casts (``Cast``): the bucket is cast into a persistent wire
  buffer and back (``hooks.compression_wrapper``), allocating nothing per
  step. Like Horovod's ``Compression.fp16``, only floating buffers wider than
  the wire type are narrowed;
- any other compressor (a user's, or a subclass of a built-in that overrides
  ``compress`` / ``decompress``) is wrapped in ``TensorCompressor``: its
  ``compress`` is called on the bucket's packed 1-D buffer, the returned
  tensor is reduced, and ``decompress``'s result is copied back into the
  bucket. Unlike Horovod, the compressor sees one fusion bucket (several
  gradients, flattened, already pre-scaled) rather than each gradient.
"""

from __future__ import annotations

from typing import Any, ClassVar

from dp_plugin.reduce.dtypes import SUPPORTED_DTYPES, canonical_dtype, is_floating


class Compressor:
    """Interface for compressing and decompressing a tensor (Horovod's).

    Subclass it and override both static methods. ``name`` (used by the
    cross-rank settings check) defaults to the class's qualified name.
    """

    name: ClassVar[str] = "compressor"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in vars(cls):
            cls.name = f"{cls.__module__}.{cls.__qualname__}"

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Compress a tensor; return it with the context needed to decompress it."""
        raise NotImplementedError(
            "Compressor.compress(tensor) -> (tensor, ctx) is abstract; override it (and "
            "decompress) in your subclass"
        )

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Decompress the tensor with the context ``compress`` returned."""
        raise NotImplementedError(
            "Compressor.decompress(tensor, ctx) is abstract; override it (and compress) in "
            "your subclass"
        )

    @classmethod
    def wire_dtype(cls, dtype: str) -> str:
        """Dtype the reduction runs in for a buffer of ``dtype`` (unknown: itself)."""
        return canonical_dtype(dtype)


def _cast(tensor: Any, dtype: Any) -> Any:
    """``tensor`` converted to ``dtype`` (a canonical name or the framework's dtype)."""
    module = type(tensor).__module__
    if module.startswith("torch"):
        import torch

        return tensor.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    if module.startswith(("tensorflow", "keras")):
        import tensorflow as tf

        return tf.cast(tensor, dtype)
    import numpy as np

    if isinstance(dtype, str) and dtype == "bfloat16":
        raise TypeError("numpy has no bfloat16; use Compression.fp16 for numpy arrays")
    return np.asarray(tensor).astype(dtype)


class Cast(Compressor):
    """A built-in compression: floating tensors wider than ``wire`` travel as
    ``wire``, by a plain cast (no ``wire``: no compression). Its three values
    are Horovod's classes below; their ``compress`` and ``decompress`` work on
    the class as on an instance, as Horovod's static methods do."""

    name: ClassVar[str] = "none"
    wire: ClassVar[str | None] = None

    @classmethod
    def wire_dtype(cls, dtype: str) -> str:
        dtype = canonical_dtype(dtype)
        wire = cls.wire
        if wire is None or not is_floating(dtype):
            return dtype
        return wire if SUPPORTED_DTYPES[dtype] > SUPPORTED_DTYPES[wire] else dtype

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        """The tensor in the wire dtype, and its own dtype as the context
        (``None`` when it was not narrowed)."""
        try:
            wire = cls.wire_dtype(tensor.dtype)
        except TypeError:  # a dtype the reduction rejects later, with its own message
            return tensor, None
        if wire == canonical_dtype(tensor.dtype):
            return tensor, None
        return _cast(tensor, wire), tensor.dtype

    @classmethod
    def decompress(cls, tensor: Any, ctx: Any) -> Any:
        """The tensor back in the dtype ``compress`` recorded."""
        return tensor if ctx is None else _cast(tensor, ctx)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoneCompressor(Cast):
    """No compression: the reduction runs in the tensors' own dtype (the default)."""

    name = "none"


class FP16Compressor(Cast):
    """float32/float64 tensors travel as float16 (halves the bytes; loses range)."""

    name = "fp16"
    wire = "float16"


class BF16Compressor(Cast):
    """float32/float64 tensors travel as bfloat16 (float32's range, 8 bits of mantissa)."""

    name = "bf16"
    wire = "bfloat16"


COMPRESSORS: dict[str, type[Cast]] = {
    c.name: c for c in (NoneCompressor, FP16Compressor, BF16Compressor)
}


class TensorCompressor(Compressor):
    """A Horovod-style compressor (class or object) applied to whole fusion buffers."""

    def __init__(self, user: Any) -> None:
        self.user = user
        owner = user if isinstance(user, type) else type(user)
        self.name = getattr(owner, "name", None) or f"{owner.__module__}.{owner.__qualname__}"  # type: ignore[misc]

    def compress(self, tensor: Any) -> tuple[Any, Any]:  # type: ignore[override]
        return self.user.compress(tensor)

    def decompress(self, tensor: Any, ctx: Any) -> Any:  # type: ignore[override]
        return self.user.decompress(tensor, ctx)

    def __repr__(self) -> str:
        return f"TensorCompressor({self.user!r})"


def get_compressor(name_or_obj: str | Compressor | type[Compressor] | None) -> Compressor:
    """A compressor from a name ('none', 'fp16', 'bf16'; None: 'none'), a
    compressor class (Horovod passes ``Compression.fp16``, a class) or object:
    a ``Cast`` or a ``TensorCompressor`` (see the module docstring)."""
    if name_or_obj is None:
        return NoneCompressor()
    if isinstance(name_or_obj, str):
        cls = COMPRESSORS.get(name_or_obj.strip().lower())
        if cls is None:
            raise ValueError(
                f"compression {name_or_obj!r} is not known; valid values: "
                f"{', '.join(COMPRESSORS)} (or a Compressor class with compress and decompress)"
            )
        return cls()
    if isinstance(name_or_obj, TensorCompressor):
        return name_or_obj
    klass = name_or_obj if isinstance(name_or_obj, type) else type(name_or_obj)
    methods = ("compress", "decompress")
    # A built-in cast, or a subclass of one that keeps its compress/decompress.
    if issubclass(klass, Cast) and all(getattr(getattr(klass, m), "__func__", None)
                                       is getattr(Cast, m).__func__ for m in methods):
        return klass() if isinstance(name_or_obj, type) else name_or_obj
    if all(callable(getattr(name_or_obj, m, None)) for m in methods):
        return TensorCompressor(name_or_obj)
    raise ValueError(
        f"compression {name_or_obj!r} is neither a name ({', '.join(COMPRESSORS)}) nor a "
        "compressor: pass hvd.Compression.none/fp16/bf16, or a class with static "
        "compress(tensor) -> (tensor, ctx) and decompress(tensor, ctx)"
    )
