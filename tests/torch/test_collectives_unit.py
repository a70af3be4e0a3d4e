"""Tensor collectives of dp_plugin.torch in one process (no launcher).

Two set-ups:
- the ``local`` engine (world size 1): semantics, in-place variants,
  non-contiguous / 0-dim / empty inputs, scale factors, compression,
  autograd, the handle API, duplicate names and argument errors;
- a thread group of fake engines (``tests/unit/fakes.py``: N ranks as N
  threads) passed as process sets: real multi-rank results, rank-dependent
  mistakes that must raise the same error on every rank, and no hang.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dp_plugin.agree.agreement import AGREE_NAME
from dp_plugin.api.process_sets import ProcessSet
from dp_plugin.config import Config
from dp_plugin.engines.base import Engine
from dp_plugin.errors import MismatchError, NotInitializedError
from dp_plugin.launch import runtime
from dp_plugin.reduce import collective
from dp_plugin.torch import handles
from dp_plugin.torch.autograd_ops import (
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    reducescatter,
)
from dp_plugin.torch.collectives import (
    allgather_async,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    reducescatter_async,
)
from dp_plugin.torch.handles import poll, synchronize
from dp_plugin.torch.ops import Adasum, Average, Compression, Max, Min, Product, Sum
from dp_plugin.torch.sparse import sparse_allreduce_async
from dp_plugin.torch.submit import DuplicateNameError
from tests.unit.fakes import make_thread_group, run_ranks, run_ranks_outcomes


@pytest.fixture(autouse=True)
def local_engine() -> Any:
    runtime.shutdown()
    handles.reset()
    engine = runtime.init(Config(engine="local"), env={})
    yield engine
    handles.reset()
    runtime.shutdown()


# -- allreduce semantics (world size 1) ---------------------------------------------


@pytest.mark.parametrize("op", [Average, Sum, Min, Max, Product])
def test_allreduce_applies_scales_and_leaves_input_alone(op: Any) -> None:
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    before = x.clone()
    out = allreduce(x, op=op, prescale_factor=0.5, postscale_factor=3.0)
    assert torch.equal(out, before * 1.5)
    assert torch.equal(x, before)
    assert out.dtype == x.dtype and out.shape == x.shape


def test_integer_average_truncates_like_horovod() -> None:
    x = torch.tensor([-7, -1, 0, 5, 9], dtype=torch.int32)
    out = allreduce(x, op=Sum, postscale_factor=0.5)
    # Horovod scales ints in double and truncates toward zero.
    assert torch.equal(out, torch.tensor([-3, 0, 0, 2, 4], dtype=torch.int32))
    assert torch.equal(allreduce(x), x)  # Average over one rank


def test_inplace_variants_write_into_the_input() -> None:
    x = torch.arange(6, dtype=torch.float32)
    assert allreduce_(x, op=Sum, postscale_factor=2.0) is x
    assert torch.equal(x, torch.arange(6, dtype=torch.float32) * 2)
    handle = allreduce_async_(x, op=Sum, prescale_factor=0.5)
    assert synchronize(handle) is x
    assert torch.equal(x, torch.arange(6, dtype=torch.float32))


def test_non_contiguous_zero_dim_and_empty_inputs() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = base.t()  # non-contiguous
    assert not view.is_contiguous()
    assert torch.equal(allreduce(view, op=Sum, postscale_factor=2.0), view * 2)
    allreduce_(view, op=Sum, postscale_factor=2.0)  # copied back into the strided view
    assert torch.equal(base, torch.arange(12, dtype=torch.float32).reshape(3, 4) * 2)
    scalar = torch.tensor(3.5)
    assert allreduce(scalar, op=Sum).shape == ()
    assert torch.equal(broadcast(scalar, 0), scalar)
    empty = torch.zeros(0, 3)
    assert allreduce(empty).shape == (0, 3)
    assert broadcast(empty, 0).shape == (0, 3)
    assert allgather(empty).shape == (0, 3)


def test_grouped_allreduce_mixed_dtypes() -> None:
    xs = [torch.ones(3), torch.arange(4, dtype=torch.int64), torch.full((2, 2), 2.0),
          torch.tensor(1.5, dtype=torch.float64)]
    outs = grouped_allreduce(xs, op=Sum, postscale_factor=2.0)
    assert isinstance(outs, list) and len(outs) == 4
    for x, out in zip(xs, outs, strict=True):
        assert out.dtype == x.dtype and out.shape == x.shape
        assert torch.equal(out, x * 2)
    assert outs[0].data_ptr() != outs[2].data_ptr()
    result = synchronize(grouped_allreduce_async(xs, op=Max))
    assert isinstance(result, tuple) and torch.equal(result[1], xs[1])
    inplace = [x.clone() for x in xs]
    returned = grouped_allreduce_(inplace, op=Sum, prescale_factor=3.0)
    assert all(a is b for a, b in zip(returned, inplace, strict=True))
    assert torch.equal(inplace[2], xs[2] * 3)
    assert synchronize(grouped_allreduce_async_(inplace, op=Sum))[0] is inplace[0]


def test_average_argument_is_deprecated_and_exclusive_with_op() -> None:
    x = torch.ones(2)
    with pytest.warns(DeprecationWarning, match="replaced with `op`"):
        allreduce(x, average=False)
    with pytest.raises(ValueError, match="supersedes average"):
        allreduce(x, average=True, op=Sum)
    with pytest.raises(NotImplementedError, match="Adasum"):
        allreduce(x, op=Adasum)
    with pytest.raises(ValueError, match="not known"):
        allreduce(x, op="median")


def test_fp16_compression_rounds_through_half() -> None:
    x = torch.tensor([1.0001, 3.14159265, -2.5e-4], dtype=torch.float32)
    out = allreduce(x, compression=Compression.fp16, op=Sum)
    assert out.dtype == torch.float32
    assert torch.equal(out, x.half().float())
    ints = torch.arange(3)
    assert torch.equal(allreduce(ints, compression=Compression.fp16, op=Sum), ints)
    bf = allreduce(x, compression=Compression.bf16, op=Sum)
    assert torch.equal(bf, x.bfloat16().float())


def test_horovod_style_compressor_class_is_accepted() -> None:
    calls: list[str] = []

    class Halve:
        @staticmethod
        def compress(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
            calls.append("compress")
            return t * 0.5, t.dtype

        @staticmethod
        def decompress(t: torch.Tensor, ctx: Any) -> torch.Tensor:
            calls.append("decompress")
            return (t * 2).to(ctx)

    x = torch.arange(4.0)
    assert torch.equal(allreduce(x, compression=Halve, op=Sum), x)
    assert calls == ["compress", "decompress"]
    with pytest.raises(TypeError, match="not a compressor"):
        allreduce(x, compression=object())


# -- other collectives (world size 1) ----------------------------------------------


def test_allgather_broadcast_alltoall_reducescatter_on_one_rank() -> None:
    x = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    assert torch.equal(allgather(x), x)
    outs = grouped_allgather([x, x[:1]])
    assert [o.shape for o in outs] == [(3, 2), (1, 2)]
    assert torch.equal(synchronize(allgather_async(x)), x)
    assert isinstance(synchronize(grouped_allgather_async([x])), tuple)
    assert torch.equal(broadcast(x, 0), x)
    y = x.clone()
    assert broadcast_(y, 0) is y
    assert synchronize(broadcast_async(x, 0)).data_ptr() != x.data_ptr()
    assert synchronize(broadcast_async_(y, 0)) is y
    assert torch.equal(alltoall(x), x)
    out, received = alltoall(x, splits=[3])
    assert torch.equal(out, x) and received.dtype == torch.int32 and received.tolist() == [3]
    out, received = alltoall(x, splits=torch.tensor([3], dtype=torch.int64))
    assert received.dtype == torch.int64
    out, received = synchronize(alltoall_async(x))
    assert received.tolist() == [3]
    assert torch.equal(reducescatter(x, op=Sum, prescale_factor=2.0), x * 2)
    assert torch.equal(synchronize(reducescatter_async(x)), x)
    assert len(grouped_reducescatter([x, x])) == 2
    assert len(synchronize(grouped_reducescatter_async([x, x], op=Sum))) == 2
    barrier()


def test_sparse_allreduce_coalesces_and_averages() -> None:
    indices = torch.tensor([[0, 2, 0], [1, 0, 1]])
    values = torch.tensor([1.0, 2.0, 3.0])
    sparse = torch.sparse_coo_tensor(indices, values, (3, 2), check_invariants=True)
    handle = sparse_allreduce_async(sparse, "emb", Sum)
    assert poll(handle)
    out = handle()
    assert out.is_coalesced() and out.shape == (3, 2)
    assert torch.equal(out.to_dense(), sparse.to_dense())
    assert torch.equal(synchronize(sparse_allreduce_async(sparse, None, Average)).to_dense(),
                       sparse.to_dense())
    with pytest.raises(ValueError, match="not supported for sparse"):
        sparse_allreduce_async(sparse, "x", Max)
    with pytest.raises(TypeError, match="sparse COO"):
        sparse_allreduce_async(torch.ones(2), "x", Sum)


# -- autograd ------------------------------------------------------------------------


def test_allreduce_gradient_is_the_scaled_allreduce_of_the_gradient() -> None:
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    for op in (Average, Sum):
        assert torch.autograd.gradcheck(
            lambda t, op=op: allreduce(t, op=op, prescale_factor=0.5, postscale_factor=3.0),
            (x,))
    xs = [torch.randn(2, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    assert torch.autograd.gradcheck(lambda a, b: tuple(grouped_allreduce([a, b], op=Sum,
                                                                        postscale_factor=2.0)),
                                    tuple(xs))


def test_gradients_of_gather_broadcast_alltoall_reducescatter() -> None:
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    checks: list[Callable[[torch.Tensor], Any]] = [
        allgather,
        lambda t: tuple(grouped_allgather([t, t * 2])),
        lambda t: broadcast(t, 0),
        alltoall,
        lambda t: alltoall(t, splits=[4])[0],
        lambda t: reducescatter(t, op=Sum, prescale_factor=2.0),
        lambda t: reducescatter(t, op=Average, postscale_factor=0.5),
        lambda t: tuple(grouped_reducescatter([t, t], op=Sum)),
    ]
    for fn in checks:
        assert torch.autograd.gradcheck(fn, (x,))


def test_compression_keeps_gradients_flowing() -> None:
    x = torch.randn(5, requires_grad=True)
    allreduce(x, compression=Compression.fp16, op=Sum).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.ones(5))


# -- handles and names ---------------------------------------------------------------


def test_handles_are_ints_and_synchronize_once() -> None:
    handle = allreduce_async(torch.ones(3), op=Sum)
    assert isinstance(handle, int) and handle > 0
    assert poll(handle) is True
    assert torch.equal(synchronize(handle), torch.ones(3))
    with pytest.raises(ValueError, match="can be synchronized once"):
        synchronize(handle)
    for bad in (123456, True, "1"):
        with pytest.raises(ValueError, match="no collective in flight"):
            poll(bad)  # type: ignore[arg-type]


def test_duplicate_name_in_flight_raises_until_synchronized() -> None:
    first = allreduce_async(torch.ones(2), name="grad.w")
    with pytest.raises(DuplicateNameError, match=r"Duplicate name 'grad.w'") as info:
        allreduce_async(torch.ones(2), name="grad.w")
    assert isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match="Duplicate name"):
        allgather(torch.ones(2), name="grad.w")  # names are shared by every collective
    other = allreduce_async(torch.ones(2), name="grad.b")  # another name is fine
    synchronize(first)
    synchronize(allreduce_async(torch.ones(2), name="grad.w"))  # released by synchronize
    synchronize(other)


def test_argument_errors_are_clear() -> None:
    with pytest.raises(TypeError, match="dtype bool, which collectives do not support"):
        allreduce(torch.ones(2, dtype=torch.bool))
    with pytest.raises(TypeError, match="dtype complex64"):
        allgather(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="0-dim"):
        allgather(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"root_rank 1 is not a rank of the process set "
                       r"\(its job-wide ranks are \[0\]\)"):
        broadcast(torch.ones(2), root_rank=1)
    with pytest.raises(TypeError, match="root_rank"):
        broadcast(torch.ones(2), root_rank=0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sums to 2"):
        alltoall(torch.ones(3), splits=[2])
    with pytest.raises(ValueError, match="has 2 entries but there are 1 ranks"):
        alltoall(torch.ones(3), splits=[2, 1])
    with pytest.raises(ValueError, match=r"supports op=hvd.Average and op=hvd.Sum"):
        reducescatter(torch.ones(3), op=Max)
    with pytest.raises(TypeError, match=r"not a torch.Tensor"):
        allreduce([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sparse_allreduce_async"):
        allreduce(torch.ones(2).to_sparse())
    with pytest.raises(ValueError, match="empty"):
        grouped_allreduce([])
    with pytest.raises(TypeError, match="prescale_factor"):
        allreduce(torch.ones(2), prescale_factor="2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"process_set must be an hvd.ProcessSet, got int"):
        allreduce(torch.ones(2), process_set=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_take_the_same_path() -> None:
    x = torch.arange(6.0, device="cuda").reshape(2, 3)
    assert torch.equal(allreduce(x, op=Sum, postscale_factor=2.0), x * 2)
    assert allgather(x).device.type == "cuda"
    assert torch.equal(broadcast(x, 0), x)
    assert torch.equal(reducescatter(x, op=Sum), x)
    assert torch.equal(alltoall(x), x)
    assert torch.equal(allreduce(x, compression=Compression.fp16).float(), x.half().float())


def test_use_before_init_raises() -> None:
    runtime.shutdown()
    with pytest.raises(NotInitializedError):
        allreduce(torch.ones(2))


# -- several ranks: a thread group of fake engines -------------------------------------


class _Set(ProcessSet):
    """A stand-in process set: each thread-rank hands its own engine."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(list(range(engine.size)))
        self.process_set_id = 1
        self._engine = engine

    def included(self) -> bool:
        return True

    def engine(self, what: str = "") -> Engine:
        assert self._engine is not None
        return self._engine


def _on_ranks(n: int, fn: Callable[[int, _Set], Any]) -> list[Any]:
    engines = make_thread_group(n)
    return run_ranks(engines, lambda e: fn(e.rank, _Set(e)))


def _errors_on_ranks(n: int, fn: Callable[[int, _Set], Any]) -> list[BaseException]:
    engines = make_thread_group(n)
    outcomes = run_ranks_outcomes(engines, lambda e: fn(e.rank, _Set(e)), timeout=30)
    assert all(isinstance(o, BaseException) for o in outcomes), outcomes
    return outcomes


def test_three_ranks_reduce_gather_broadcast_alltoall_reducescatter() -> None:
    def body(rank: int, ps: _Set) -> None:
        x = torch.arange(6, dtype=torch.float64).reshape(3, 2) + rank
        total = sum(torch.arange(6, dtype=torch.float64).reshape(3, 2) + r for r in range(3))
        assert torch.allclose(allreduce(x, process_set=ps), total / 3)
        assert torch.equal(allreduce(x, op=Max, process_set=ps), x - rank + 2)
        ints = torch.full((4,), 3 * rank + 1, dtype=torch.int32)  # 1, 4, 7: mean 4
        assert torch.equal(allreduce(ints, postscale_factor=0.5, process_set=ps),
                           torch.full((4,), 2, dtype=torch.int32))
        rows = torch.full((rank + 1, 2), float(rank))  # uneven first dimension
        gathered = allgather(rows, process_set=ps)
        assert gathered[:, 0].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 2.0]
        assert torch.equal(broadcast(x, 2, process_set=ps), x - rank + 2)
        out, received = alltoall(torch.arange(3.0) + 10 * rank, splits=[1, 1, 1],
                                 process_set=ps)
        assert out.tolist() == [rank, 10 + rank, 20 + rank] and received.tolist() == [1, 1, 1]
        mine = reducescatter(torch.ones(7, 2), op=Sum, process_set=ps)
        assert mine.shape == ((3 if rank == 0 else 2), 2) and bool((mine == 3).all())
        barrier(process_set=ps)

    _on_ranks(3, body)


def test_tensor_collectives_agree_once() -> None:
    # The agreement check covers what the engine would check: one agreement
    # per collective, then the data (the fake engine's alltoall is an allgather).
    def body(rank: int, ps: _Set) -> list[tuple[str, str]]:
        allgather(torch.ones(rank + 1, 2), name="ag", process_set=ps)
        alltoall(torch.arange(3.0), splits=[1, 1, 1], name="a2a", process_set=ps)
        reducescatter(torch.ones(3, 2), op=Sum, name="rs", process_set=ps)
        assert ps._engine is not None
        return [(kind, name) for kind, name, _ in ps._engine.log]  # type: ignore[attr-defined]

    agreed = ("allreduce", AGREE_NAME)
    for calls in _on_ranks(3, body):
        assert calls == [agreed, ("allgather", "ag"), agreed, ("allgather", "a2a"),
                         agreed, ("allreduce", "rs")]


def test_three_rank_gradients_follow_horovod() -> None:
    def body(rank: int, ps: _Set) -> None:
        x = torch.ones(rank + 1, 2, requires_grad=True)
        gathered = allgather(x, process_set=ps)
        # Every rank weights the gathered rows by (rank + 1): the averaged
        # gradient of each row is 2, and each rank keeps its own rows.
        (gathered * (rank + 1)).sum().backward()
        assert x.grad is not None and torch.equal(x.grad, torch.full((rank + 1, 2), 2.0))
        y = torch.ones(2, requires_grad=True)
        broadcast(y, 1, process_set=ps).sum().backward()
        assert y.grad is not None
        assert torch.equal(y.grad, torch.ones(2) * (1.0 if rank == 1 else 0.0))
        z = torch.ones(3, requires_grad=True)
        (allreduce(z, op=Sum, process_set=ps) * (rank + 1)).sum().backward()
        assert z.grad is not None and torch.equal(z.grad, torch.full((3,), 6.0))
        w = torch.ones(3, requires_grad=True)
        out, _ = alltoall(w, splits=[1, 1, 1], process_set=ps)
        (out * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
        assert w.grad is not None and torch.equal(w.grad, torch.full((3,), rank + 1.0))
        v = torch.ones(3, 2, requires_grad=True)
        reducescatter(v, op=Sum, process_set=ps).sum().backward()
        assert v.grad is not None and torch.equal(v.grad, torch.full((3, 2), 3.0))

    _on_ranks(3, body)


@pytest.mark.parametrize(("case", "expected", "pattern"), [
    ("shape", MismatchError, r"Mismatched allreduce tensor shapes for 'g'.*rank\(s\) 0, 1 "
                             r"passed shape \(4,\); rank\(s\) 2 passed shape \(5,\)"),
    ("dtype", MismatchError, r"Mismatched allreduce tensor types.*float64"),
    ("op", MismatchError, r"Mismatched allreduce tensor reduce ops.*op=Sum"),
    ("scale", MismatchError, r"scale factors.*prescale_factor=2"),
    ("name", MismatchError, r"Mismatched names for allreduce: rank\(s\) 0, 1 passed 'g'; "
                            r"rank\(s\) 2 passed 'a-name-longer-than-24-bytes'\. "),
    ("kind", MismatchError, r"Mismatched collectives.*called broadcast"),
    ("group", MismatchError, r"Mismatched group sizes"),
    ("gather", MismatchError, r"Mismatched allgather tensor shapes.*\(\*, 3\)"),
    ("root", MismatchError, r"Mismatched broadcast tensor root ranks"),
    ("splits", ValueError, r"rank\(s\) \[2\] passed invalid splits"),
    ("dtype-bad", TypeError, r"rank\(s\) \[2\] passed a tensor of dtype bool, which "),
])
def test_rank_dependent_mistakes_raise_on_every_rank(case: str, expected: type,
                                                     pattern: str) -> None:
    def body(rank: int, ps: _Set) -> None:
        odd = rank == 2
        x = torch.ones(5 if odd and case == "shape" else 4,
                       dtype=torch.float64 if odd and case == "dtype" else torch.float32)
        if case in ("shape", "dtype"):
            allreduce(x, name="g", process_set=ps)
        elif case == "op":
            allreduce(x, op=Sum if odd else Average, process_set=ps)
        elif case == "scale":
            allreduce(x, prescale_factor=2.0 if odd else 1.0, process_set=ps)
        elif case == "name":
            allreduce(x, name="a-name-longer-than-24-bytes" if odd else "g", process_set=ps)
        elif case == "kind":
            broadcast(x, 0, process_set=ps) if odd else allreduce(x, process_set=ps)
        elif case == "group":
            grouped_allreduce([x] * (3 if odd else 2), process_set=ps)
        elif case == "gather":
            allgather(torch.ones(rank + 1, 3 if odd else 2), process_set=ps)
        elif case == "root":
            broadcast(x, 1 if odd else 0, process_set=ps)
        elif case == "splits":
            alltoall(torch.ones(3), splits=[3, 0, 1] if odd else [1, 1, 1], process_set=ps)
        elif case == "dtype-bad":
            allreduce(x.bool() if odd else x, process_set=ps)

    errors = _errors_on_ranks(3, body)
    for exc in errors:
        assert isinstance(exc, expected), repr(exc)
        assert re.search(pattern, str(exc), re.S), str(exc)


def test_duplicate_name_on_one_rank_raises_there_alone_and_the_job_goes_on() -> None:
    """Horovod's rule: the rank that reuses a name in flight gets ValueError at
    once, sends nothing; the others are not disturbed and the job stays usable."""
    def body(rank: int, ps: _Set) -> list[str]:
        seen = []
        first = allreduce_async(torch.full((2,), float(rank)), op=Sum, name="g", process_set=ps)
        if rank == 2:
            try:
                allreduce(torch.ones(1), name="g", process_set=ps)
            except DuplicateNameError as exc:
                seen.append(str(exc))
        assert torch.equal(synchronize(first), torch.full((2,), 3.0))
        again = allreduce(torch.ones(3), op=Sum, name="g", process_set=ps)  # name free again
        assert torch.equal(again, torch.full((3,), 3.0))
        return seen

    def own_names(e: Engine) -> _Set:
        ps = _Set(e)
        ps.process_set_id = 10 + e.rank  # thread-ranks share the handle table
        return ps

    outcomes = run_ranks_outcomes(make_thread_group(3), lambda e: body(e.rank, own_names(e)),
                                  timeout=30)
    assert outcomes[0] == outcomes[1] == [], outcomes
    (message,) = outcomes[2]
    assert "Duplicate name 'g'" in message and "Only this rank raises" in message


def test_grouped_mismatch_names_the_member() -> None:
    def body(rank: int, ps: _Set) -> None:
        xs = [torch.ones(2), torch.ones(3 if rank == 1 else 4)]
        grouped_allreduce(xs, name="grp", process_set=ps)

    for exc in _errors_on_ranks(2, body):
        assert "tensor 1 of the group of 2" in str(exc) and "'grp'" in str(exc)


def test_mismatch_leaves_no_rank_waiting_and_next_collective_works() -> None:
    def body(rank: int, ps: _Set) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(MismatchError):
                allreduce(torch.ones(2 + rank), process_set=ps)
        return allreduce(torch.full((2,), float(rank)), op=Sum, process_set=ps)

    for out in _on_ranks(2, body):
        assert torch.equal(out, torch.ones(2))


# -- the out-of-place grouped all-reduce --------------------------------------------


def test_out_of_place_copies_each_large_input_as_its_bucket_starts(
        local_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """``grouped_allreduce`` copies a tensor that travels alone into its new
    output when that tensor's bucket starts, while the buckets before it
    are on the wire, not in one pass over the whole list before the first
    byte moves: an input changed once the first bucket has started shows in
    its result. (A caller must not change inputs in flight; the test only
    observes when the copy runs.)"""
    n = collective.DIRECT_BYTES // 4 + 1  # travels alone
    xs = [torch.full((n,), 1.0), torch.ones(3), torch.full((n,), 2.0)]
    launched: list[int] = []
    launch = local_engine.allreduce_async

    def spy(buf: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not launched:
            xs[2].fill_(5.0)
        launched.append(buf.numel())
        return launch(buf, *args, **kwargs)

    monkeypatch.setattr(local_engine, "allreduce_async", spy)
    outs = grouped_allreduce(xs, op=Sum, postscale_factor=2.0)
    assert launched[0] == n, launched
    assert torch.equal(outs[0], torch.full((n,), 2.0))
    assert torch.equal(outs[1], torch.full((3,), 2.0))
    assert torch.equal(outs[2], torch.full((n,), 10.0)), "the input was copied before it started"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_out_of_place_group_of_cpu_and_cuda_tensors() -> None:
    n = collective.DIRECT_BYTES // 4 + 1  # travels alone
    xs = [torch.arange(n, dtype=torch.float32), torch.ones(3, device="cuda"),
          torch.arange(n, dtype=torch.float64, device="cuda"), torch.ones(2, dtype=torch.int32)]
    kept = [x.clone() for x in xs]
    outs = grouped_allreduce(xs, op=Sum, postscale_factor=2.0)
    inplace = [x.clone() for x in xs]
    grouped_allreduce_(inplace, op=Sum, postscale_factor=2.0)
    for x, k, out, same in zip(xs, kept, outs, inplace, strict=True):
        assert out.device == x.device and out.dtype == x.dtype
        assert torch.equal(out, same) and torch.equal(out, k * 2) and torch.equal(x, k)
        assert out.data_ptr() != x.data_ptr()
