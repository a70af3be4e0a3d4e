"""Worker: DistributedOptimizer training equals single-process training.

Run under any launcher (see tests/multiproc/harness.py); the engine comes
from DP_PLUGIN_ENGINE. One launch runs one case (``--case NAME``,
``--list-cases``) and prints ``rank R OK`` when it passed.

``optimizers``: for each optimizer set-up, every rank builds the model from its *own* seed, then
``broadcast_parameters`` + ``broadcast_optimizer_state`` (the other ranks
also start with other hyper-parameters, which the broadcast must fix) make
them agree; the ranks train several steps on their shard of each global
batch with a ``DistributedOptimizer``. At the end the flat parameters must
be bitwise identical on all ranks (compared through ``allgather_object``)
and within 1e-5 of a single-process run: the same initial weights (rank 0's,
after the broadcast) trained on the concatenated global batch with the plain
optimizer. The model has an unused parameter, which must get a zero gradient
on every rank and stay unchanged.

``join_process_set``: rank r trains 3 + r steps, then calls ``hvd.join()``;
the joined ranks contribute zero gradients to the remaining steps. Every
rank replays the expected run locally (all ranks' data is deterministic) and
the last rank's parameters must match it; ``join()`` must return the last
rank everywhere.

At 3 ranks, an optimizer over the process set {0, last} must average over
its members only, while the other rank steps on its own gradients.

``groups``: Horovod's ``groups=`` (a count, and lists of parameters) reduce
each group as one bucket of its own, and train to the same parameters,
bitwise, as the run without groups.

Any failure prints a traceback and exits 1 at once (``os._exit``), so the
other ranks fail by their collective timeout instead of waiting.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from _fail_fast import run_cases
from torch import nn

import dp_plugin.torch as hvd

PER_RANK = 4
"""Samples per rank per backward pass."""
STEPS = 5
TOLERANCE = 1e-5


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)
        self.unused = nn.Linear(3, 3)  # requires grad, never in the graph

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[Any, int], torch.optim.Optimizer]
    """(params, rank) -> optimizer; rank 0's hyper-parameters are the real ones."""
    dtype: torch.dtype = torch.float64
    passes: int = 1
    kwargs: dict[str, Any] = field(default_factory=dict)


def sgd(params: Any, rank: int) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1 * (rank + 1), momentum=0.9 - 0.1 * rank)


def adam(params: Any, rank: int) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01 * (rank + 1), betas=(0.9, 0.999 - 0.001 * rank))


OPTIMIZERS = [
    Case("sgd-momentum", sgd),
    Case("adam", adam),
    Case("sgd-accumulate", sgd, passes=2),
    Case("adam-float32", adam, dtype=torch.float32),
]


def batch(step: int, micro: int, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The global batch of (step, micro): identical on every rank."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(rows, 6, generator=g, dtype=torch.float64)
    y = torch.randn(rows, 3, generator=g, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run_case(case: Case, rank: int, size: int) -> None:
    torch.manual_seed(100 + rank)  # different on purpose: the broadcast fixes it
    model = Net().to(case.dtype)
    opt = case.make(model.parameters(), rank)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    reference = copy.deepcopy(model)
    ref_opt = case.make(reference.parameters(), 0)
    if opt.state_dict()["param_groups"] != ref_opt.state_dict()["param_groups"]:
        raise AssertionError(f"{case.name}: hyper-parameters differ from rank 0's after "
                             f"broadcast_optimizer_state: {opt.state_dict()['param_groups']}")

    dist = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                    backward_passes_per_step=case.passes, **case.kwargs)
    if not isinstance(dist, type(opt)):
        raise AssertionError(f"{type(dist)} is not an instance of {type(opt)}")
    rows = PER_RANK * size
    for step in range(STEPS):
        dist.zero_grad()
        for micro in range(case.passes):
            x, y = batch(step, micro, rows, case.dtype)
            mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            loss = nn.functional.mse_loss(model(x[mine]), y[mine]) / case.passes
            loss.backward()
        dist.step()
        if model.unused.weight.grad is None or model.unused.weight.grad.abs().sum() != 0:
            raise AssertionError(f"{case.name}: the unused parameter did not get a zero gradient")

        ref_opt.zero_grad()
        xs, ys = zip(*(batch(step, m, rows, case.dtype) for m in range(case.passes)),
                     strict=True)
        nn.functional.mse_loss(reference(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()

    mine_flat = flat(model)
    everyone = hvd.allgather_object(mine_flat, name=f"{case.name}.final")
    for r, theirs in enumerate(everyone):
        if not torch.equal(theirs, everyone[0]):
            raise AssertionError(f"{case.name}: rank {r}'s parameters differ bitwise from rank "
                                 f"0's (max diff {(theirs - everyone[0]).abs().max():.3g})")
    diff = (mine_flat - flat(reference)).abs().max().item()
    if diff > TOLERANCE:
        raise AssertionError(f"{case.name}: max |distributed - single process| = {diff:.3g} "
                             f"> {TOLERANCE}")
    if not torch.equal(model.unused.weight, reference.unused.weight):
        raise AssertionError(f"{case.name}: the unused parameter changed")
    print(f"rank {rank} case {case.name}: max diff to single process {diff:.2e}; "
          f"{fusion(dist)}", flush=True)


def fusion(opt: Any) -> str:
    """How the optimizer's gradients were fused (the copies test reads it)."""
    reducer = opt._dp.reducer
    return f"{len(reducer.plan)} buckets, slabs {reducer.slab_bytes()} bytes"


def run_join(rank: int, size: int) -> None:
    """Uneven data: rank r has 3 + r steps; the joined ranks answer with zeros."""
    torch.manual_seed(7)
    model = Net().double()
    expected = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(expected.parameters(), lr=0.1)
    steps = [3 + r for r in range(size)]
    for step in range(max(steps)):
        x, y = batch(step, 0, PER_RANK * size, torch.float64)
        if step < steps[rank]:
            opt.zero_grad()
            mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            opt.step()
        # Expected: the average over all ranks, with zeros from the joined ones.
        ref_opt.zero_grad()
        total = sum(
            nn.functional.mse_loss(expected(x[r * PER_RANK:(r + 1) * PER_RANK]),
                                   y[r * PER_RANK:(r + 1) * PER_RANK])
            for r in range(size) if step < steps[r]
        )
        (total / size).backward()
        ref_opt.step()
    print(f"rank {rank} join: {fusion(opt)}", flush=True)
    last = hvd.join()
    if last != size - 1:
        raise AssertionError(f"join() returned {last}, expected the last rank {size - 1}")
    if rank == size - 1:
        diff = (flat(model) - flat(expected)).abs().max().item()
        if diff > 1e-12:
            raise AssertionError(f"join: the last rank's parameters differ from the "
                                 f"expected run by {diff:.3g}")
    # A second round in which everyone joins at once still agrees.
    again = hvd.join()
    if again != size - 1:
        raise AssertionError(f"second join() returned {again}, expected {size - 1}")


def run_process_set(rank: int, size: int) -> None:
    """At 3+ ranks: an optimizer over the set {0, last} averages over its members only;
    the other ranks step on their own gradients, as in Horovod."""
    members = [0, size - 1]
    ps = hvd.add_process_set(members)
    torch.manual_seed(3)
    model = Net().double()
    reference = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), process_set=ps)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = batch(step, 0, PER_RANK * size, torch.float64)
        opt.zero_grad()
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        group = members if rank in members else [rank]
        total = sum(nn.functional.mse_loss(reference(x[r * PER_RANK:(r + 1) * PER_RANK]),
                                           y[r * PER_RANK:(r + 1) * PER_RANK]) for r in group)
        (total / len(group)).backward()
        ref_opt.step()
    diff = (flat(model) - flat(reference)).abs().max().item()
    if diff > 1e-12:
        raise AssertionError(f"process set {members}: rank {rank} is {diff:.3g} away from "
                             "the expected run")
    del opt
    hvd.remove_process_set(ps)


def case_optimizers(_: object) -> None:
    for case in OPTIMIZERS:
        run_case(case, hvd.rank(), hvd.size())


def case_join_process_set(_: object) -> None:
    rank, size = hvd.rank(), hvd.size()
    run_join(rank, size)
    if size >= 3:
        run_process_set(rank, size)
    # No DistributedOptimizer left: join() is a barrier that agrees on a rank.
    last = hvd.join()
    if hvd.allgather_object(last) != [last] * size or not 0 <= last < size:
        raise AssertionError(f"join() without optimizers returned {last}")


def train_grouped(rank: int, size: int, groups: Callable[[Net], Any]) -> tuple[torch.Tensor, Any]:
    """Parameters after STEPS steps of SGD with ``groups(model)``, and the plan."""
    torch.manual_seed(11)
    model = Net().double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   groups=groups(model))
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, 0, PER_RANK * size, torch.float64)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
    return flat(model), [b.members for b in opt._dp.reducer.plan]


def case_groups(_: object) -> None:
    rank, size = hvd.rank(), hvd.size()
    plain, plan = train_grouped(rank, size, lambda m: None)
    listed = lambda m: [[m.head.weight, m.body[0].bias], [m.body[2].weight]]  # noqa: E731
    for label, groups, expected in [
        # Net's 8 parameters in registration order: body 0-3, head 4-5, unused 6-7.
        ("groups=3", lambda m: 3, [{0, 1, 2}, {3, 4, 5}, {6, 7}]),
        ("listed", listed, [{4, 1}, {2}]),
    ]:
        grouped, plan = train_grouped(rank, size, groups)
        if not all(group in [set(b) for b in plan] for group in expected):
            raise AssertionError(f"{label}: the plan {plan} lacks the groups' buckets {expected}")
        if not torch.equal(grouped, plain):
            raise AssertionError(f"{label}: parameters differ from the run without groups "
                                 f"(max diff {(grouped - plain).abs().max():.3g})")
        print(f"rank {rank} {label}: plan {plan}", flush=True)


CASES = {
    "optimizers": case_optimizers,
    "join_process_set": case_join_process_set,
    "groups": case_groups,
}


def start(args: object) -> None:
    torch.set_num_threads(1)
    hvd.init()


if __name__ == "__main__":
    run_cases(CASES, setup=start, teardown=lambda _: hvd.shutdown())
