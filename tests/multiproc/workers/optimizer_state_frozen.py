"""Worker: ``broadcast_optimizer_state`` for a model with a frozen parameter.

Issue 27: a parameter with ``requires_grad=False`` has no optimizer state,
and the broadcast raised ``TypeError: 'NoneType' object is not iterable``.
Broadcast before the first step (no state anywhere) and after one (the
root's moments differ from the others', each rank's data differs), with
``hvd.DistributedOptimizer`` over Adam; afterwards every rank must hold
the root's moments and no state for the frozen parameter. Prints
``rank R OK``.
"""

from __future__ import annotations

from typing import Any

import torch
from _fail_fast import run_cases

import dp_plugin.torch as hvd


def case_frozen(_: Any) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0, model=model)
    torch.manual_seed(1 + hvd.rank())
    opt.zero_grad()
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    for p in model.parameters():  # the others' moments differ from the root's now
        if p.requires_grad and hvd.rank() != 0:
            opt.state[p]["exp_avg"].add_(1.0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    moments = torch.cat([opt.state[p]["exp_avg"].flatten() for p in model.parameters()
                         if p.requires_grad])
    every = hvd.allgather(moments[None])
    if not all(torch.equal(every[0], row) for row in every):
        raise AssertionError(f"rank {hvd.rank()}: the ranks' Adam moments differ")
    if model[0].weight in opt.state:
        raise AssertionError(f"rank {hvd.rank()}: the frozen parameter got optimizer state")


CASES = {"frozen": case_frozen}

if __name__ == "__main__":
    run_cases(CASES, setup=lambda _: hvd.init(), teardown=lambda _: hvd.shutdown())
