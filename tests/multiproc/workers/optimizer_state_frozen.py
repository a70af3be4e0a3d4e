"""Worker: ``broadcast_optimizer_state`` for a model with a frozen parameter.

``frozen``: a parameter with ``requires_grad=False`` has no optimizer
state (the broadcast once raised ``TypeError: 'NoneType' object is not
iterable``). Broadcast before the first step (no state anywhere) and after one (the
root's moments differ from the others', each rank's data differs), with
``hvd.DistributedOptimizer`` over Adam; afterwards every rank must hold
the root's moments and no state for the frozen parameter. ``no_grad``:
Horovod's ``test_broadcast_state_no_grad`` (see ``case_no_grad``). Prints
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


class _ModelNoGrad(torch.nn.Module):
    """Horovod's ``test_broadcast_state_no_grad`` model: an integer index
    parameter without gradient, and the values it selects."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(a.int(), requires_grad=False)
        self.b = torch.nn.Parameter(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.b, 0, self.a.long()) * x


def case_no_grad(_: Any) -> None:
    """Horovod's ``test_broadcast_state_no_grad``: after
    ``broadcast_optimizer_state`` of a fresh optimizer, the parameter that
    requires a gradient holds a zero one, which ``hvd.broadcast`` takes; the
    frozen one has none. ``hvd.broadcast(None)`` says what None is."""
    torch.manual_seed(hvd.rank())
    model = _ModelNoGrad(torch.tensor([1.0, 3.0]), torch.rand(4))
    base = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9,
                           nesterov=True)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grad = opt.param_groups[0]["params"][1].grad
    bgrad = hvd.broadcast(grad, root_rank=0)
    if opt.param_groups[0]["params"][0].grad is not None:
        raise AssertionError(f"rank {hvd.rank()}: the frozen parameter got a gradient")
    if not torch.equal(grad, bgrad) or not torch.equal(grad, torch.zeros(4)):
        raise AssertionError(f"rank {hvd.rank()}: gradient {grad}, broadcast {bgrad}")
    if not torch.equal(model.b, hvd.broadcast(model.b.detach(), root_rank=0)):
        raise AssertionError(f"rank {hvd.rank()}: the parameters are not rank 0's")
    opt.zero_grad()  # the model trains on from there
    model(torch.ones(2)).sum().backward()
    opt.step()
    try:
        hvd.broadcast(opt.param_groups[0]["params"][0].grad, root_rank=0)
    except TypeError as exc:
        if "input is None, not a torch.Tensor" not in str(exc) or "requires_grad" not in str(exc):
            raise AssertionError(f"rank {hvd.rank()}: unclear error for None: {exc}") from exc
    else:
        raise AssertionError(f"rank {hvd.rank()}: hvd.broadcast(None) did not raise")


CASES = {"frozen": case_frozen, "no_grad": case_no_grad}

if __name__ == "__main__":
    run_cases(CASES, setup=lambda _: hvd.init(), teardown=lambda _: hvd.shutdown())
