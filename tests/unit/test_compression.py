"""Wire compression: which dtypes narrow, and cast round trips on both backends."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from dp_plugin.reduce.arrays import ArrayOps, NumpyOps, TorchOps, as_numpy, numpy_dtype
from dp_plugin.reduce.compression import (
    BF16Compressor,
    Compressor,
    FP16Compressor,
    NoneCompressor,
    TensorCompressor,
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
    if wire is not flat:  # what compression_wrapper does around the reduction
        ops.cast_into(wire, flat)
    np.testing.assert_array_equal(as_numpy(wire).astype(np.float64), values.astype(np.float64))
    as_numpy(flat)[:] = 0
    if wire is flat:
        as_numpy(flat)[:] = values  # nothing to decompress: the reduction ran in flat
    else:
        ops.cast_into(flat, wire)
    # These values are exact in every wire type, so the round trip is exact.
    np.testing.assert_array_equal(as_numpy(flat), values)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_fp16_loses_precision_bf16_keeps_range() -> None:
    ops = NumpyOps()
    flat = np.array([1.0 + 2**-12, 1e6], dtype=np.float32)
    out = flat.copy()
    for comp, expect in [(FP16Compressor(), [1.0, np.inf]), (BF16Compressor(), [1.0, 999424.0])]:
        wire = ops.empty(2, comp.wire_dtype("float32"), "cpu")
        ops.cast_into(wire, flat)
        ops.cast_into(out, wire)
        np.testing.assert_array_equal(out, np.array(expect, dtype=np.float32))


# -- Horovod's public interface: compress(tensor) -> (tensor, ctx), decompress(tensor, ctx) --


def test_horovod_interface_on_numpy_and_torch() -> None:
    x = np.array([1.5, -2.0], dtype=np.float32)
    wire, ctx = FP16Compressor.compress(x)
    assert wire.dtype == np.float16
    back = FP16Compressor.decompress(wire, ctx)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, x)
    ints = np.arange(3, dtype=np.int32)
    same, ctx = FP16Compressor.compress(ints)
    assert same is ints and FP16Compressor.decompress(same, ctx) is ints
    assert NoneCompressor.compress(x) == (x, None)
    torch = pytest.importorskip("torch")
    t = torch.tensor([1.5, -2.0], dtype=torch.float64)
    wire, ctx = BF16Compressor.compress(t)
    assert wire.dtype == torch.bfloat16
    assert BF16Compressor.decompress(wire, ctx).dtype == torch.float64


def test_user_compressors_are_wrapped_built_ins_are_not() -> None:
    class Scaled(Compressor):
        @staticmethod
        def compress(tensor):  # type: ignore[no-untyped-def]
            return tensor * 2, None

        @staticmethod
        def decompress(tensor, ctx):  # type: ignore[no-untyped-def]
            return tensor / 2

    class PlainSubclass(FP16Compressor):
        pass

    class OverridingSubclass(FP16Compressor):
        @staticmethod
        def compress(tensor):  # type: ignore[no-untyped-def]
            return tensor, None

    wrapped = get_compressor(Scaled)
    assert isinstance(wrapped, TensorCompressor) and wrapped.user is Scaled
    assert wrapped.name.endswith("Scaled")
    assert isinstance(get_compressor(PlainSubclass), PlainSubclass)
    assert isinstance(get_compressor(OverridingSubclass), TensorCompressor)
    with pytest.raises(NotImplementedError, match="override it"):
        Compressor.compress(np.zeros(1))


def test_tensor_compressor_runs_through_the_comm_hook() -> None:
    from dp_plugin.engines.handle import DoneHandle
    from dp_plugin.reduce.hooks import GradBucket, HookState, compression_wrapper

    seen: list[np.ndarray] = []

    def fake_allreduce(state: HookState, bucket: GradBucket) -> DoneHandle:
        seen.append(np.array(bucket.buffer()))
        bucket.buffer()[:] = bucket.buffer() * 3  # as if three ranks sent the same
        return DoneHandle("fake", 0, 1.0)

    class Halve(Compressor):
        @staticmethod
        def compress(tensor):  # type: ignore[no-untyped-def]
            return (tensor / 2).astype(np.float16), tensor.dtype

        @staticmethod
        def decompress(tensor, ctx):  # type: ignore[no-untyped-def]
            return (tensor * 2).astype(ctx)

    hook = compression_wrapper(fake_allreduce, Halve)  # type: ignore[arg-type]
    flat = np.array([2.0, 4.0], dtype=np.float32)
    bucket = GradBucket(0, "float32", "cpu", ("a",), NumpyOps(), flat, "b0")
    hook(HookState(engine=None), bucket).wait()
    assert seen[0].dtype == np.float16
    np.testing.assert_array_equal(seen[0], [1.0, 2.0])
    np.testing.assert_array_equal(flat, [6.0, 12.0])
