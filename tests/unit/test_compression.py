"""Wire compression: which dtypes narrow, and cast round trips on both backends."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from dp_plugin.arrays import ArrayOps, NumpyOps, TorchOps, as_numpy, numpy_dtype
from dp_plugin.compression import (
    BF16Compressor,
    Compressor,
    FP16Compressor,
    NoneCompressor,
    get_compressor,
)


@pytest.mark.parametrize(
    ("name", "dtype", "wire"),
    [
        ("none", "float32", "float32"),
        ("none", "bfloat16", "bfloat16"),
        ("fp16", "float32", "float16"),
        ("fp16", "float64", "float16"),
        ("fp16", "float16", "float16"),
        ("fp16", "bfloat16", "bfloat16"),  # same width: not narrowed
        ("fp16", "int32", "int32"),
        ("fp16", "int8", "int8"),
        ("bf16", "float32", "bfloat16"),
        ("bf16", "float64", "bfloat16"),
        ("bf16", "float16", "float16"),
        ("bf16", "int64", "int64"),
    ],
)
def test_wire_dtype(name: str, dtype: str, wire: str) -> None:
    assert get_compressor(name).wire_dtype(dtype) == wire


def test_get_compressor_accepts_names_objects_and_classes() -> None:
    assert isinstance(get_compressor("FP16"), FP16Compressor)
    assert isinstance(get_compressor(None), NoneCompressor)
    obj = BF16Compressor()
    assert get_compressor(obj) is obj
    assert isinstance(get_compressor(FP16Compressor), FP16Compressor)  # type: ignore[arg-type]
    assert isinstance(obj, Compressor)


def test_unknown_compression_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"'int8' is not known; valid values: none, fp16, bf16"):
        get_compressor("int8")
    with pytest.raises(ValueError, match=r"neither a name"):
        get_compressor(3)  # type: ignore[arg-type]


def _backends() -> list[ArrayOps]:
    out: list[ArrayOps] = [NumpyOps()]
    with contextlib.suppress(ImportError):
        out.append(TorchOps())
    return out


@pytest.mark.parametrize("ops", _backends(), ids=lambda o: o.kind)
@pytest.mark.parametrize("name", ["none", "fp16", "bf16"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32"])
def test_round_trip(ops: ArrayOps, name: str, dtype: str) -> None:
    comp = get_compressor(name)
    values = np.array([0.0, 1.0, -2.5, 3.0, 1024.0, 7.0], dtype=numpy_dtype(dtype))
    flat = ops.empty(values.size, dtype, "cpu")
    as_numpy(flat)[:] = values
    wire_dtype = comp.wire_dtype(dtype)
    wire = flat if wire_dtype == dtype else ops.empty(values.size, wire_dtype, "cpu")
    comp.compress(ops, wire, flat)
    np.testing.assert_array_equal(as_numpy(wire).astype(np.float64), values.astype(np.float64))
    as_numpy(flat)[:] = 0
    if wire is flat:
        as_numpy(flat)[:] = values  # nothing to decompress: the reduction ran in flat
    comp.decompress(ops, flat, wire)
    # These values are exact in every wire type, so the round trip is exact.
    np.testing.assert_array_equal(as_numpy(flat), values)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_fp16_loses_precision_bf16_keeps_range() -> None:
    ops = NumpyOps()
    flat = np.array([1.0 + 2**-12, 1e6], dtype=np.float32)
    out = flat.copy()
    for comp, expect in [(FP16Compressor(), [1.0, np.inf]), (BF16Compressor(), [1.0, 999424.0])]:
        wire = ops.empty(2, comp.wire_dtype("float32"), "cpu")
        comp.compress(ops, wire, flat)
        comp.decompress(ops, out, wire)
        np.testing.assert_array_equal(out, np.array(expect, dtype=np.float32))
