"""Worker: parameters unused on some ranks, with collectives inside backward.

Run under any launcher (see tests/multiproc/harness.py)::

    python torch_unused.py --case one_optimizer     # prints "rank R OK"
    python torch_unused.py --list-cases

The model is ``Linear -> SyncBatchNorm -> [extra1] -> [extra2] -> ReLU ->
Linear``, where rank r applies ``extra1`` / ``extra2`` (residual layers)
only on some steps, differently on every rank. So a parameter gets a
gradient on one rank and none on another in the same step; its bucket is
ready mid-backward on the first and only at ``step()`` on the second, while
SyncBatchNorm's backward issues its own all-reduce in between. Run with
``HOROVOD_FUSION_THRESHOLD=0`` (one tensor per bucket) this used to cross
collectives between ranks: a size error, a timeout, or data silently
swapped. Cases: ``one_optimizer`` (one DistributedOptimizer over
everything) and ``two_optimizers`` (two DistributedOptimizers over disjoint
parameters, both reducing during the same backward, as in a GAN or a model
with a separate optimizer for embeddings).

Checked after every step, within 1e-5: the parameters and momentum buffers
equal those of the same model trained in this process on the global batch
with ``nn.BatchNorm1d`` (the per-rank branches applied to each rank's rows;
a parameter no rank used gets a zero gradient, as Horovod gives it).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from _fail_fast import run_cases
from torch import nn

import dp_plugin.torch as hvd

STEPS = 4
TOL = 1e-5


class Net(nn.Module):
    def __init__(self, bn: type[nn.Module]) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.bn = bn(6)
        self.extra1 = nn.Linear(6, 6)
        self.extra2 = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def tail(self, h: torch.Tensor, use1: bool, use2: bool) -> torch.Tensor:
        if use1:
            h = h + self.extra1(h)
        if use2:
            h = h + self.extra2(h)
        return self.head(torch.relu(h))


def uses(rank: int, step: int) -> tuple[bool, bool]:
    """Which extra layers rank ``rank`` applies in ``step`` (some steps: none anywhere)."""
    return (rank + step) % 2 == 0, (rank * 2 + step) % 3 == 0


def optimizers(model: Net, two: bool, wrap: bool) -> list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    groups = ([named[:6], named[6:]] if two else [named])
    out: list[torch.optim.Optimizer] = []
    for group in groups:
        opt = torch.optim.SGD([p for _, p in group], lr=0.1, momentum=0.9)
        out.append(hvd.DistributedOptimizer(opt, named_parameters=group) if wrap else opt)
    return out


def train(two: bool) -> None:
    rank, size = hvd.rank(), hvd.size()
    rows = [(3, 5, 2)[r % 3] for r in range(size)]
    offsets = [sum(rows[:r]) for r in range(size)]
    total = sum(rows)
    torch.manual_seed(11)
    model = Net(hvd.SyncBatchNorm)
    torch.manual_seed(11)
    reference = Net(nn.BatchNorm1d)
    opts, ref_opts = optimizers(model, two, True), optimizers(reference, two, False)
    gen = torch.Generator().manual_seed(3)
    for step in range(STEPS):
        x, y = torch.randn(total, 5, generator=gen), torch.randn(total, 2, generator=gen)
        mine = slice(offsets[rank], offsets[rank] + rows[rank])
        for opt in opts:
            opt.zero_grad()
        out = model.tail(model.bn(model.lin(x[mine])), *uses(rank, step))
        # Scaled so that the average over ranks is the gradient of the global mean.
        (nn.functional.mse_loss(out, y[mine], reduction="sum") * size / y.numel()).backward()
        for opt in opts:
            opt.step()

        for opt in ref_opts:
            opt.zero_grad()
        h = reference.bn(reference.lin(x))
        loss = sum(
            nn.functional.mse_loss(
                reference.tail(h[offsets[r]:offsets[r] + rows[r]], *uses(r, step)),
                y[offsets[r]:offsets[r] + rows[r]], reduction="sum")
            for r in range(size)
        )
        (loss / y.numel()).backward()
        for p in reference.parameters():
            if p.grad is None:  # no rank used it: Horovod reduces zeros for it
                p.grad = torch.zeros_like(p)
        for opt in ref_opts:
            opt.step()
        compare(step, model, reference, opts, ref_opts)


def compare(step: int, model: Net, reference: Net, opts: list[Any], ref_opts: list[Any]) -> None:
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values(),
                                 strict=True):
        check_close(f"step {step}: {name}", got, want)
    for opt, ref in zip(opts, ref_opts, strict=True):
        for group, ref_group in zip(opt.param_groups, ref.param_groups, strict=True):
            for p, q in zip(group["params"], ref_group["params"], strict=True):
                check_close(f"step {step}: momentum", opt.state[p]["momentum_buffer"],
                            ref.state[q]["momentum_buffer"])


def check_close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    if not err <= TOL * (1 + want.double().abs().max().item()):
        raise AssertionError(f"rank {hvd.rank()}: {what}: max abs error {err:.3g} > {TOL:g}")


CASES = {
    "one_optimizer": lambda _: train(two=False),
    "two_optimizers": lambda _: train(two=True),
}


def start(_: object) -> None:
    torch.set_num_threads(1)
    assert os.environ.get("HOROVOD_FUSION_THRESHOLD") == "0", "run with one tensor per bucket"
    hvd.init()


if __name__ == "__main__":
    run_cases(CASES, setup=start, teardown=lambda _: hvd.shutdown())
