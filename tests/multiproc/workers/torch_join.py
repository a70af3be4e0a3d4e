"""Worker: ``hvd.join()`` answers the other ranks' collectives.

    python torch_join.py --case NAME     # prints "rank R OK"

- ``collectives``: rank 0 joins after one optimizer step; the others then run
  allreduce (Average, Sum, Min, Max, grouped, in place), barrier, an
  optimizer step and (at 3+ ranks) an allreduce on a process set that
  contains rank 0, and check each result against Horovod's rule (the joined
  rank contributes nothing: zeros). Then they join too; ``join()`` returns
  the last rank everywhere.
- ``refused``: rank 0 joins; the others' allgather, broadcast,
  reducescatter, alltoall and broadcast_object raise ``JoinedRankError``
  (Horovod's rule), rank 0 keeps waiting; then everyone joins.
- ``last_joiner``, ``sync_batch_norm``, ``sparse_first``, ``slow_steps``:
  the fault matrix's join rows (see each case's docstring).
- ``different_rates``: two optimizers stepping at different
  rates (a GAN's discriminator 3x per generator step); rank 0 joins after one
  round, rank 1 trains two more: each gradient is its own half, every time.
- ``outside_set``: an optimizer over the process set [1, 2] of 3 ranks;
  rank 0, outside it, joins at once and must not take part in its steps.
- ``before_the_first_step``: two fresh optimizers, joined before their first
  step (which agrees on rank 0's bucket order): every rank joins at once, as
  Lightning's barrier does; then rank 0 joins while rank 1 steps the
  optimizers in the reverse of their creation order.
- ``blamed_ranks``: mismatch messages name job ranks, in a process set and
  beside a joined rank (3 ranks).
"""

from __future__ import annotations

import os
import time

import torch
from _fail_fast import run_cases
from torch import nn

import dp_plugin.torch as hvd
from dp_plugin.errors import JoinedRankError, MismatchError


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
    """What a joined rank answers: the all-reduce family and barrier."""
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
    """Horovod's rule (its test_horovod_join_allgather/broadcast): rank 0
    joins; every collective a joined rank does not answer raises on the
    ranks that call it, naming the joined rank, and rank 0 keeps waiting;
    then they join too and every rank gets the same last-joined rank, not 0."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if rank > 0:
        x = torch.ones(size, 2)
        for kind, call in [
            ("allgather", lambda: hvd.allgather(x)),
            ("allgather", lambda: hvd.grouped_allgather([x, x])),
            ("broadcast", lambda: hvd.broadcast(x, root_rank=0)),
            ("broadcast", lambda: hvd.broadcast(x, root_rank=size - 1)),
            ("reducescatter", lambda: hvd.reducescatter(x, op=hvd.Sum)),
            ("alltoall", lambda: hvd.alltoall(x)),
            ("broadcast_object", lambda: hvd.broadcast_object({"a": 1}, root_rank=1)),
        ]:
            expect_refusal(call, "rank(s) 0 have called hvd.join()")
            print(f"rank {rank}: {kind} refused", flush=True)
        # The all-reduce family still runs, with rank 0 contributing nothing.
        same(hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), float(size - 1)),
             "allreduce after the refusals")
    last = hvd.join()
    check(last != 0, f"join() returned {last}, the rank that joined first")
    rets = hvd.allgather(torch.tensor([last]))
    check(bool((rets == last).all()), f"join() returned different ranks: {rets.tolist()}")
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


def wrapped(*names: str) -> list[tuple[nn.Linear, torch.optim.Optimizer]]:
    """One bias-free float64 ``Linear(2, 1)`` and its ``DistributedOptimizer``
    (SGD) per name, the weight registered under that name, in order."""
    pairs = []
    for name in names:
        model = nn.Linear(2, 1, bias=False).double()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=[(name, model.weight)])
        pairs.append((model, opt))
    return pairs


def case_different_rates(_: object) -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    pairs = wrapped("disc.w", "gen.w")
    gan_round(rank, pairs[0], pairs[1], size, range(size))  # everyone trains
    if rank > 0:
        for _ in range(2):
            gan_round(rank, pairs[0], pairs[1], size, range(1, size))  # rank 0 adds zeros
    last = hvd.join()
    check(last == size - 1, f"join() returned {last}, expected {size - 1}")
    hvd.shutdown()


def case_before_the_first_step(_: object) -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    pairs = wrapped("barrier.a.w", "barrier.b.w")
    check(hvd.join() == size - 1, "join() as a barrier returned the wrong rank")
    gan_round(rank, pairs[0], pairs[1], size, range(size))  # the first real steps
    pairs = wrapped("uneven.a.w", "uneven.b.w")
    if rank == 1:  # one backward into both, then the later optimizer first
        for _, opt in pairs:
            opt.zero_grad()
        sum(m(torch.tensor([[1.0, 1.0]], dtype=torch.float64)).sum() for m, _ in pairs).backward()
        for model, opt in reversed(pairs):
            opt.step()
            grad = model.weight.grad
            assert grad is not None
            want = torch.tensor([[1.0, 1.0]], dtype=torch.float64) / size
            check(torch.equal(grad, want), f"grad {grad} != {want}")
    if rank > 1:
        for _, opt in reversed(pairs):
            opt.zero_grad()
            opt.step()  # no gradient: zeros, in rank 1's order
    last = hvd.join()
    check(last == (1 if size == 2 else size - 1), f"join() returned {last}")
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


def case_last_joiner(_: object) -> None:
    """Rank ``size - 2`` trains 3 steps, every other rank 1: it joins last, and
    ``join()`` says so on every rank (not the tie-break, ``size - 1``)."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    last = size - 2
    model = nn.Linear(2, 1, bias=False).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for _ in range(3 if rank == last else 1):
        one_step(opt, model, rank)
    got = hvd.join()
    check(got == last, f"join() returned {got}, expected {last} (it trained the longest)")
    hvd.shutdown()


def case_sync_batch_norm(_: object) -> None:
    """A model with SyncBatchNorm; the last rank joins after one step, the
    others run one more: their SyncBatchNorm raises JoinedRankError at the
    call (its statistics would pair with the joined rank's standing answer),
    they join, and ``join()`` returns on every rank."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), hvd.SyncBatchNorm(4), nn.Linear(4, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())

    def step() -> None:
        opt.zero_grad()
        model(torch.full((2, 3), float(rank + 1)) + torch.arange(6.0).view(2, 3)).sum().backward()
        opt.step()

    step()
    bn = model[1]
    if rank < size - 1:
        before = bn.running_mean.clone()
        expect_refusal(step, "SyncBatchNorm")
        check(torch.equal(bn.running_mean, before), "the refused step changed running_mean")
    got = hvd.join()
    check(got == size - 2, f"join() returned {got}, expected {size - 2}")
    hvd.shutdown()


def case_sparse_first(_: object) -> None:
    """Sparse embedding gradients (sparse_as_dense=False); the last rank joins
    before its first step, the others train two: each gets their own sum."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    emb = nn.Embedding(4, 2, sparse=True)
    nn.init.zeros_(emb.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                   named_parameters=emb.named_parameters(), op=hvd.Sum)
    if rank < size - 1:
        for _ in range(2):
            opt.zero_grad()
            emb(torch.tensor([rank])).sum().backward()
            opt.step()
        grad = emb.weight.grad
        assert grad is not None
        want = torch.zeros(4, 2)
        want[: size - 1] = 1.0
        check(torch.equal(grad.to_dense(), want), f"sparse grad {grad.to_dense()} != {want}")
    got = hvd.join()
    check(got == size - 2, f"join() returned {got}, expected {size - 2}")
    hvd.shutdown()


def case_slow_steps(_: object) -> None:
    """The last rank joins at once; the others step every 0.5 s for longer than
    DP_PLUGIN_TIMEOUT (2 s longer; the test sets a short timeout): every
    step is progress, so the joined rank waits without an error."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model = nn.Linear(2, 1, bias=False).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    timeout = float(os.environ["DP_PLUGIN_TIMEOUT"])
    if rank < size - 1:
        start = time.monotonic()
        while time.monotonic() - start < timeout + 2:
            time.sleep(0.5)
            one_step(opt, model, rank)
    got = hvd.join()
    check(got == size - 2, f"join() returned {got}, expected {size - 2}")
    hvd.shutdown()


def case_blamed_ranks(_: object) -> None:
    """Errors name job ranks (3 ranks). In the process set [1, 2], ranks 1
    and 2 broadcast from different roots: the message names ranks 1 and 2
    (it used to say 'rank(s) 0', not a member). Then rank 1 joins and ranks
    0 and 2 all-reduce different shapes: the message names ranks 0 and 2,
    never the joined rank 1. Then they join too."""
    hvd.init()
    rank = hvd.rank()
    ps = hvd.add_process_set([1, 2])
    if rank in (1, 2):
        expect_mismatch(lambda: hvd.broadcast(torch.ones(3), root_rank=rank, process_set=ps),
                        "rank(s) 1 passed root_rank=1; rank(s) 2 passed root_rank=2")
    if rank != 1:
        expect_mismatch(lambda: hvd.allreduce(torch.ones(4 if rank == 0 else 5), name="g"),
                        "rank(s) 0 passed shape (4,); rank(s) 2 passed shape (5,)")
    last = hvd.join()
    check(last in (0, 2), f"join() returned {last}, the rank that joined first")
    hvd.shutdown()


def expect_mismatch(call: object, words: str) -> None:
    try:
        call()  # type: ignore[operator]
    except MismatchError as exc:
        check(words in str(exc), f"message lacks {words!r}: {exc}")
        print(f"rank {hvd.rank()}: raised as meant: {exc}", flush=True)
    else:
        raise AssertionError("no MismatchError")


CASES = {"collectives": case_collectives, "refused": case_refused,
         "different_rates": case_different_rates,
         "before_the_first_step": case_before_the_first_step,
         "outside_set": case_outside_set, "last_joiner": case_last_joiner,
         "sync_batch_norm": case_sync_batch_norm, "sparse_first": case_sparse_first,
         "slow_steps": case_slow_steps, "blamed_ranks": case_blamed_ranks}

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_cases(CASES)
