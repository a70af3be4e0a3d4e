"""Worker: ``hvd.join()`` answers the other ranks' collectives (issue 8, item 5).

    python torch_join.py --case NAME     # prints "rank R OK"

- ``collectives``: rank 0 joins after one optimizer step; the others then run
  allreduce (Average, Sum, Min, Max, grouped, in place), allgather (and
  grouped), broadcast, reducescatter, barrier, an optimizer step and (at 3+
  ranks) an allreduce on a process set that contains rank 0, and check each
  result against Horovod's rule (the joined rank contributes nothing: zeros,
  no rows). Then they join too; ``join()`` returns the last rank everywhere.
- ``refused``: rank 0 joins, rank 1 calls ``alltoall``, which a joined rank
  cannot answer: both raise ``JoinedRankError`` at once.
- ``joined_root``: rank 0 joins, rank 1 broadcasts from root 0: both raise.
- ``different_rates`` (issue 9 item 6): two optimizers stepping at different
  rates (a GAN's discriminator 3x per generator step); rank 0 joins after one
  round, rank 1 trains two more: each gradient is its own half, every time.
- ``outside_set``: an optimizer over the process set [1, 2] of 3 ranks;
  rank 0, outside it, joins at once and must not take part in its steps.
"""

from __future__ import annotations

import os

import torch
from _fail_fast import run_cases
from torch import nn

import dp_plugin.torch as hvd
from dp_plugin.errors import JoinedRankError


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    check(got.dtype == want.dtype and torch.equal(got, want), f"{what}: got {got}, want {want}")


def one_step(opt: torch.optim.Optimizer, model: nn.Linear, rank: int) -> None:
    """loss = w . [rank, 1]: this rank's gradient is [rank, 1]."""
    opt.zero_grad()
    model(torch.tensor([[float(rank), 1.0]], dtype=torch.float64)).sum().backward()
    opt.step()


def training_rank(rank: int, size: int, opt: torch.optim.Optimizer, model: nn.Linear,
                  ps: object) -> None:
    others = range(1, size)  # the ranks still training; rank 0 has joined
    f64 = torch.float64
    out = hvd.allreduce(torch.full((3,), float(rank + 1), dtype=f64), name="avg")
    want = torch.full((3,), sum(r + 1.0 for r in others) / size, dtype=f64)
    check(torch.allclose(out, want, rtol=1e-15, atol=0), f"Average: got {out}, want {want}")
    a, b = hvd.grouped_allreduce([torch.full((2,), float(rank)),
                                  torch.full((3,), rank, dtype=torch.int64)], op=hvd.Sum)
    same(a, torch.full((2,), float(sum(others))), "grouped Sum float32")
    same(b, torch.full((3,), sum(others), dtype=torch.int64), "grouped Sum int64")
    same(hvd.allreduce(torch.tensor([-5.0 - rank]), op=hvd.Max), torch.tensor([-6.0]), "Max")
    same(hvd.allreduce(torch.tensor([5 + rank]), op=hvd.Min), torch.tensor([6]), "Min")
    inplace = torch.ones(4)
    hvd.allreduce_(inplace, op=hvd.Sum)
    same(inplace, torch.full((4,), float(size - 1)), "allreduce_ Sum")
    rows = hvd.allgather(torch.full((rank, 2), rank, dtype=torch.int32), name="rows")
    same(rows, torch.cat([torch.full((r, 2), r, dtype=torch.int32) for r in others]),
         "allgather")
    g1, g2 = hvd.grouped_allgather([torch.full((1,), float(rank)), torch.full((2, 2), rank)])
    same(g1, torch.tensor([float(r) for r in others]), "grouped allgather 0")
    check(g2.shape == (2 * (size - 1), 2), f"grouped allgather 1 shape {tuple(g2.shape)}")
    same(hvd.broadcast(torch.arange(4.0) * rank, root_rank=size - 1),
         torch.arange(4.0) * (size - 1), "broadcast")
    block = hvd.reducescatter(torch.ones(2 * size, 1), op=hvd.Sum)
    same(block, torch.full((2, 1), float(size - 1)), "reducescatter Sum")
    hvd.barrier()
    one_step(opt, model, rank)  # rank 0 contributes a zero gradient
    grad = model.weight.grad
    assert grad is not None
    want = torch.tensor([[sum(others) / size, (size - 1) / size]], dtype=f64)
    check(torch.allclose(grad, want, rtol=0, atol=1e-12), f"optimizer grad {grad} != {want}")
    if ps is not None and rank == size - 1:
        same(hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=ps), torch.ones(2),
             "allreduce on the process set [0, last]")


def case_collectives(_: object) -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    ps = hvd.add_process_set([0, size - 1]) if size >= 3 else None
    model = nn.Linear(2, 1, bias=False).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    one_step(opt, model, rank)
    if rank > 0:
        training_rank(rank, size, opt, model, ps)
    last = hvd.join()
    check(last == size - 1, f"join() returned {last}, expected the last rank {size - 1}")
    # Everyone is back: plain collectives work again.
    same(hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), float(size)), "after")
    hvd.shutdown()


def expect_refusal(call: object, words: str) -> None:
    try:
        call()  # type: ignore[operator]
    except JoinedRankError as exc:
        check(words in str(exc), f"message lacks {words!r}: {exc}")
        print(f"rank {hvd.rank()}: raised as meant: {exc}", flush=True)
    else:
        raise AssertionError("no JoinedRankError")


def case_refused(_: object) -> None:
    hvd.init()
    if hvd.rank() == 0:
        expect_refusal(hvd.join, "dp_plugin.check cannot run while a rank is joined")
    else:
        expect_refusal(lambda: hvd.alltoall(torch.ones(2, 3)), "rank(s) 0 have called join()")
    hvd.shutdown()


def case_joined_root(_: object) -> None:
    hvd.init()
    if hvd.rank() == 0:
        expect_refusal(hvd.join, "its root_rank 0 has called join()")
    else:
        expect_refusal(lambda: hvd.broadcast(torch.ones(2), root_rank=0),
                       "its root_rank 0 has called join()")
    hvd.shutdown()


def gan_round(rank: int, disc: tuple[nn.Linear, torch.optim.Optimizer],
              gen: tuple[nn.Linear, torch.optim.Optimizer], size: int,
              training: range) -> None:
    """3 discriminator steps, then 1 generator step; each grad is [rank, 1] / size
    summed over the ``training`` ranks (the joined ones add zeros)."""
    want = torch.tensor([[float(sum(training)) / size, len(training) / size]],
                        dtype=torch.float64)
    for model, opt in (disc, disc, disc, gen):
        one_step(opt, model, rank)
        grad = model.weight.grad
        assert grad is not None
        check(torch.allclose(grad, want, rtol=0, atol=1e-12), f"grad {grad} != {want}")


def case_different_rates(_: object) -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    pairs = []
    for label in ("disc", "gen"):
        model = nn.Linear(2, 1, bias=False).double()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=[(f"{label}.w", model.weight)])
        pairs.append((model, opt))
    gan_round(rank, pairs[0], pairs[1], size, range(size))  # everyone trains
    if rank > 0:
        for _ in range(2):
            gan_round(rank, pairs[0], pairs[1], size, range(1, size))  # rank 0 adds zeros
    last = hvd.join()
    check(last == size - 1, f"join() returned {last}, expected {size - 1}")
    hvd.shutdown()


def case_outside_set(_: object) -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    ps = hvd.add_process_set([1, 2])
    model = nn.Linear(2, 1, bias=False).double()
    torch.nn.init.ones_(model.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=ps)
    if rank > 0:
        for _ in range(2):
            one_step(opt, model, rank)
            grad = model.weight.grad
            want = torch.tensor([[1.5, 1.0]], dtype=torch.float64)  # ([1,1] + [2,1]) / 2
            check(grad is not None and torch.equal(grad, want), f"set grad {grad} != {want}")
    last = hvd.join()
    check(last == size - 1, f"join() returned {last}, expected {size - 1}")
    weights = hvd.allgather(model.weight.detach())
    check(torch.equal(weights[1], weights[2]), f"the set's ranks differ: {weights}")
    hvd.shutdown()


CASES = {"collectives": case_collectives, "refused": case_refused,
         "joined_root": case_joined_root, "different_rates": case_different_rates,
         "outside_set": case_outside_set}

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_cases(CASES)
