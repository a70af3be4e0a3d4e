"""Worker: sparse embedding gradients, reduced sparse and as dense, equal a single process.

    python sparse_optimizer.py --case sparse_vs_dense   # prints "rank R OK"

Each rank trains the same model (two sparse ``nn.Embedding`` tables, one
dense layer) from the same initial weights twice: with
``DistributedOptimizer(sparse_as_dense=False)`` (all-gather of indices and
values, outside the fusion buckets) and ``sparse_as_dense=True``. Rank r's
batch of step s is slice r of global batch s, and the ranks look up
overlapping rows (duplicates across ranks must add up). Checks, on every
rank: the two runs' parameters agree within 1e-5, and both agree within 1e-5
with one process (plain optimizer, no dp_plugin) trained on the whole global
batches. Also checks that the tables are never in the dense buckets (nothing
but the dense layer and the flags travels there, from the first step on).
"""

from __future__ import annotations

import os

import torch
from _fail_fast import run_cases
from torch import nn

import dp_plugin.torch as hvd

ROWS, DIM, LOCAL_BATCH, STEPS, TOL = 50, 4, 6, 5, 1e-5


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.users = nn.Embedding(ROWS, DIM, sparse=True)
        self.items = nn.Embedding(ROWS // 2, DIM, sparse=True)
        self.out = nn.Linear(DIM, 1)

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return self.out(self.users(u) * self.items(i)).squeeze(-1)


def global_batches(size: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    n = LOCAL_BATCH * size
    # Few distinct rows: the ranks' lookups overlap.
    return [(torch.randint(0, 10, (n,), generator=g), torch.randint(0, ROWS // 2, (n,),
                                                                     generator=g),
             torch.randn(n, generator=g)) for _ in range(STEPS)]


def train(opt_factory, model: Model, batches, rank: int, size: int) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    opt = opt_factory(model)
    for u, i, y in batches:
        mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH) if size else slice(None)
        opt.zero_grad()
        loss = ((model(u[mine], i[mine]) - y[mine]) ** 2).mean()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


def case_sparse_vs_dense(_: object) -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    batches = global_batches(size)

    def distributed(sparse_as_dense: bool):  # type: ignore[no-untyped-def]
        def make(model: Model):  # type: ignore[no-untyped-def]
            return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                            named_parameters=model.named_parameters(),
                                            sparse_as_dense=sparse_as_dense)
        return make

    sparse, opt = train(distributed(False), Model(), batches, rank, size)
    stats = opt.comm_stats()
    per_step = [s.bytes_reduced for s in stats]
    # The tables are known as sparse from the wrap: in every step only the
    # dense layer (DIM + 1 floats) and the flags travel in the buckets.
    if len(per_step) != STEPS or not max(per_step) <= (DIM + 1) * 4 + 64:
        raise AssertionError(f"bytes in the dense buckets per step: {per_step}")
    dense, _ = train(distributed(True), Model(), batches, rank, size)
    reference, _ = train(lambda m: torch.optim.SGD(m.parameters(), lr=0.5), Model(), batches,
                         0, 0)
    names = [n for n, _ in Model().named_parameters()]
    for name, a, b, ref in zip(names, sparse, dense, reference, strict=True):
        worst = max((a - b).abs().max().item(), (a - ref).abs().max().item())
        if not worst <= TOL:
            raise AssertionError(f"{name}: sparse/dense/reference differ by {worst:g}")
        if (ref - Model().state_dict()[name]).abs().max().item() == 0:
            raise AssertionError(f"{name} did not train")
    hvd.shutdown()


CASES = {"sparse_vs_dense": case_sparse_vs_dense}

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_cases(CASES)
