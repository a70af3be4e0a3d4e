"""Element types the core can reduce, named by canonical strings.

Frameworks spell dtypes differently (``torch.float32``, ``np.float32``,
``tf.float32``); the core only ever sees these names.
"""

from __future__ import annotations

import contextlib

SUPPORTED_DTYPES: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
}
"""Canonical dtype name -> item size in bytes."""

FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})


_KNOWN: dict[object, str] = {}
"""dtype object -> canonical name, for the ones seen before (this runs on
every gradient of every step)."""


def canonical_dtype(dtype: object) -> str:
    """Return the canonical name of a numpy, torch or tensorflow dtype (or a name).

    Raises ``TypeError`` naming the dtype and the supported ones.
    """
    try:
        return _KNOWN[dtype]
    except (KeyError, TypeError):  # not seen yet, or unhashable
        pass
    name = str(dtype).removeprefix("torch.").removeprefix("<dtype: '").rstrip("'>")
    aliases = {"half": "float16", "float": "float32", "double": "float64",
               "long": "int64", "int": "int32", "short": "int16"}
    name = aliases.get(name, name)
    if name not in SUPPORTED_DTYPES:
        raise TypeError(
            f"dtype {dtype} cannot be all-reduced; supported dtypes: "
            f"{', '.join(SUPPORTED_DTYPES)}. Cast the tensor (e.g. bool -> uint8, "
            "complex -> two float tensors) or leave it out of the reduction"
        )
    with contextlib.suppress(TypeError):
        _KNOWN[dtype] = name
    return name


def itemsize(dtype: str) -> int:
    """Bytes per element of a canonical dtype."""
    return SUPPORTED_DTYPES[canonical_dtype(dtype)]


def is_floating(dtype: str) -> bool:
    return canonical_dtype(dtype) in FLOATING
