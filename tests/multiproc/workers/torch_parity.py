"""Worker: horovod.torch behaviours a drop-in must match, one case per launch.

    python torch_parity.py --case NAME     # prints "rank R OK"

- ``compressor``: Horovod's compressor interface; a user ``Compressor``
  subclass on ``hvd.allreduce`` and on ``DistributedOptimizer``;
- ``state_partial``: ``broadcast_optimizer_state`` with frozen parameters and
  parameters that never had a gradient (fresh and after root-only steps);
- ``state_every_optimizer``: every ``torch.optim`` optimizer, trained
  differently on each rank, ends with rank 0's state and parameters;
- ``async_gather``: ``allgather_async`` / ``reducescatter_async`` are in
  flight (``poll`` False) while the other rank has not sent its part;
- ``shutdown_after_failure``: ``shutdown()`` returns within the timeout after
  a failed grouped all-reduce with gradients, and ``init()`` works after it,
  also when rank 1 re-inits while rank 0 has not shut down yet;
- ``shutdown_after_failed_join``: the same after a ``join`` that a
  collective of the other rank left unanswered.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from _fail_fast import run_cases
from torch import nn

import dp_plugin.torch as hvd
from dp_plugin.api.process_sets import engine_of
from dp_plugin.torch.compression import Compressor

DEADLINE_S = 60.0  # a guard against hangs, not a timing assertion


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


# -- item 1: compressors ---------------------------------------------------------------


class HalfScaled(Compressor):
    """A user compressor: float16 on the wire, scaled by 1/2 and back."""

    calls: list[str] = []

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        HalfScaled.calls.append("compress")
        return (tensor * 0.5).half(), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        HalfScaled.calls.append("decompress")
        return (tensor * 2).to(ctx)


def case_compressor(_: object) -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x = torch.tensor([1.5, -2.25, 3.0])
    wire, ctx = hvd.Compression.fp16.compress(x)
    check(wire.dtype == torch.float16 and ctx == torch.float32, f"fp16.compress: {wire}, {ctx}")
    check(torch.equal(hvd.Compression.fp16.decompress(wire, ctx), x), "fp16 round trip")
    check(hvd.Compression.none.compress(x) == (x, None), "none.compress")
    out = hvd.allreduce(x * (rank + 1), compression=HalfScaled, op=hvd.Sum)
    check(torch.equal(out, x * sum(range(1, size + 1))), f"allreduce with HalfScaled: {out}")
    check(HalfScaled.calls == ["compress", "decompress"], f"calls {HalfScaled.calls}")
    HalfScaled.calls.clear()
    model = nn.Linear(4, 1, bias=False)
    nn.init.ones_(model.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(),
                                   compression=HalfScaled)
    model(torch.full((1, 4), float(rank + 1))).sum().backward()
    opt.step()
    mean = sum(range(1, size + 1)) / size
    check(torch.equal(model.weight.detach(), torch.full((1, 4), 1.0 - mean)),
          f"weights after a step with HalfScaled: {model.weight}")
    check(HalfScaled.calls == ["compress", "decompress"], f"optimizer calls {HalfScaled.calls}")
    hvd.shutdown()


# -- items 2 and 9: broadcast_optimizer_state ---------------------------------------------


def same(a: Any, b: Any, path: str = "state_dict") -> str | None:
    """Where ``a`` and ``b`` differ (tensors: dtype, shape and values), or None."""
    if isinstance(a, torch.Tensor):
        ok = (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
              and torch.equal(a, b))
        return None if ok else path
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return f"{path} keys"
        return next((d for k in a if (d := same(a[k], b[k], f"{path}[{k!r}]"))), None)
    if isinstance(a, list | tuple):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{path} length"
        return next((d for i, (x, y) in enumerate(zip(a, b, strict=True))
                     if (d := same(x, y, f"{path}[{i}]"))), None)
    return None if a == b else f"{path}: {a!r} != {b!r}"


def agrees_with_root(obj: Any, what: str) -> None:
    root = hvd.broadcast_object(obj, 0)
    diff = same(root, obj)
    check(diff is None, f"{what} differs from rank 0's at {diff}")


def case_state_partial(_: object) -> None:
    hvd.init()
    torch.manual_seed(hvd.rank())
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[0].bias.requires_grad_(False)  # frozen
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(opt, 0)  # nobody has state yet
    agrees_with_root(opt.state_dict(), "fresh SGD state")
    if hvd.rank() == 0:  # only the last layer gets gradients, on rank 0 only
        model[1](torch.randn(2, 3)).sum().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, 0)
    agrees_with_root(opt.state_dict(), "partial SGD state")
    dist = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    model[1](torch.randn(2, 3)).sum().backward()  # model[0].weight has no grad
    dist.step()
    hvd.broadcast_optimizer_state(dist, 0)
    agrees_with_root(dist.state_dict(), "DistributedOptimizer(Adam) state")
    hvd.shutdown()


def optimizer_classes() -> list[type[torch.optim.Optimizer]]:
    return [c for c in vars(torch.optim).values()
            if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
            and c is not torch.optim.Optimizer]


def train_differently(cls: type[torch.optim.Optimizer]) -> tuple[nn.Module, Any]:
    """A model (sparse embedding for SparseAdam, 2-D parameters only for
    optimizers that take only those) trained ``rank + 1`` steps on rank data."""
    torch.manual_seed(hvd.rank())
    sparse = cls is torch.optim.SparseAdam
    model = nn.Sequential(nn.Embedding(6, 4, sparse=sparse), nn.Linear(4, 3))
    model[1].bias.requires_grad_(False)
    params = list(model.parameters())
    try:
        opt = cls(params) if not sparse else cls([model[0].weight])
    except ValueError:  # e.g. Muon: 2-D parameters only
        opt = cls([p for p in params if p.dim() == 2])

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.tensor([1, 2, hvd.rank()])).pow(2).sum()
        loss.backward()
        return loss

    for _ in range(hvd.rank() + 1):
        opt.step(closure)
    return model, opt


def case_state_every_optimizer(_: object) -> None:
    hvd.init()
    failures = []
    classes = optimizer_classes()
    check(len(classes) >= 14, f"only {len(classes)} optimizers found")
    for cls in classes:
        model, opt = train_differently(cls)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        for what, obj in (("state", opt.state_dict()), ("parameters", model.state_dict())):
            root = hvd.broadcast_object(obj, 0)
            diff = same(root, obj)
            if diff is not None:
                failures.append(f"{cls.__name__} {what}: {diff}")
    check(not failures, "; ".join(failures))
    hvd.shutdown()


# -- item 3: asynchronous all-gather and reduce-scatter ---------------------------------


def delay_on_rank_1(method: str) -> None:
    """On rank 1, wait 2 s before sending the data of collectives named
    'delayed' (headers included): rank 0 then has them in flight."""
    eng = engine_of(hvd.global_process_set)
    if hvd.rank() != 1:
        return
    original = getattr(eng, method)

    def delayed(buf: Any, *args: Any) -> Any:
        if args[-1] == "delayed":
            time.sleep(2.0)
        return original(buf, *args)

    setattr(eng, method, delayed)


def wait_polling(handle: int, what: str) -> Any:
    saw_pending = not hvd.poll(handle)
    deadline = time.monotonic() + DEADLINE_S
    while not hvd.poll(handle):
        check(time.monotonic() < deadline, f"{what} never completed")
        time.sleep(0.01)
    return saw_pending, hvd.synchronize(handle)


def case_async_gather(_: object) -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    delay_on_rank_1("_allgather_start")
    delay_on_rank_1("_reducescatter_start")
    x = torch.full((rank + 1, 3), float(rank))
    pending, out = wait_polling(hvd.allgather_async(x, name="delayed"), "allgather_async")
    expect = torch.cat([torch.full((r + 1, 3), float(r)) for r in range(size)])
    check(torch.equal(out, expect), f"allgather result {out}")
    if rank == 0:
        check(pending, "allgather_async: poll() was True while rank 1 had not sent")
    y = torch.arange(4 * size, dtype=torch.float32).reshape(2 * size, 2) * (rank + 1)
    pending, out = wait_polling(
        hvd.reducescatter_async(y, name="delayed", op=hvd.Sum), "reducescatter_async")
    total = torch.arange(4 * size, dtype=torch.float32).reshape(2 * size, 2) * sum(
        range(1, size + 1))
    check(torch.equal(out, total[2 * rank:2 * rank + 2]), f"reducescatter result {out}")
    if rank == 0:
        check(pending, "reducescatter_async: poll() was True while rank 1 had not sent")
    hvd.shutdown()


# -- item 6: shutdown after a failed collective --------------------------------------------


def shutdown_returns() -> None:
    budget = float(os.environ["DP_PLUGIN_TIMEOUT"]) + 5.0
    start = time.monotonic()
    hvd.shutdown()
    took = time.monotonic() - start
    check(took < budget, f"shutdown() took {took:.1f} s (timeout {budget - 5:.0f} s)")


def init_and_check() -> None:
    hvd.init()
    out = hvd.allreduce(torch.ones(2), op=hvd.Sum)
    check(torch.equal(out, torch.full((2,), float(hvd.size()))), f"allreduce after init {out}")


def case_shutdown_after_failure(_: object) -> None:
    hvd.init()
    rank = hvd.rank()
    # A grouped all-reduce with gradients whose shapes differ between ranks.
    tensors = [torch.ones(3, requires_grad=True), torch.ones(2 + rank, requires_grad=True)]
    try:
        sum(t.sum() for t in hvd.grouped_allreduce(tensors)).backward()
    except Exception as exc:  # the mismatch is the point of the case
        print(f"rank {rank}: grouped allreduce failed as meant: {type(exc).__name__}")
    else:
        raise AssertionError("grouped allreduce of different shapes did not fail")
    if rank == 0:
        # Rank 1 re-inits first and meets the store that rank 0 still serves
        # for the first init: it must stay (it closed under rank 1 once).
        time.sleep(2.0)
    shutdown_returns()
    init_and_check()
    hvd.shutdown()


def case_shutdown_after_failed_join(_: object) -> None:
    """Rank 0 joins (with an optimizer) while rank 1 calls a collective join
    does not answer: both fail; shutdown returns in time and init works again."""
    hvd.init()
    rank = hvd.rank()
    model = nn.Linear(3, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    try:
        if rank == 0:
            hvd.join()
        else:
            hvd.alltoall(torch.ones(2, 3))  # a joined rank cannot answer it
    except Exception as exc:  # the failure is the point of the case
        print(f"rank {rank}: failed as meant: {type(exc).__name__}")
    del opt
    shutdown_returns()
    init_and_check()
    hvd.shutdown()


CASES = {
    "compressor": case_compressor,
    "state_partial": case_state_partial,
    "state_every_optimizer": case_state_every_optimizer,
    "async_gather": case_async_gather,
    "shutdown_after_failure": case_shutdown_after_failure,
    "shutdown_after_failed_join": case_shutdown_after_failed_join,
}

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_cases(CASES)
