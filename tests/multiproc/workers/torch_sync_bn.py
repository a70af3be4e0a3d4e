"""Worker: SyncBatchNorm on each rank's shard vs nn.BatchNorm on the global batch.

Run under any launcher (see tests/multiproc/harness.py)::

    python torch_sync_bn.py --case batch_norm     # prints "rank R OK"
    python torch_sync_bn.py --list-cases

Every rank builds the same global batch (a fixed seed), takes its own rows
(per-rank sizes are uneven, one rank may hold none) and runs forward and
backward through ``SyncBatchNorm``; it also runs ``nn.BatchNorm{1,2,3}d`` on
the whole global batch in this process as the reference. The loss is
``sum(out * R)`` for a fixed random ``R``, so the global loss is the sum of
the ranks' losses and the parameter gradients of the reference equal the
sum over ranks of the local ones. Checked, within 1e-5, over several steps:
outputs, input gradients, weight/bias gradients, running statistics and
``num_batches_tracked``; then eval mode (no communication) on the shard.
At 3 ranks the first case runs again over a process set of the first and
last rank (the middle rank must get a ValueError). Then a small model with a
SyncBatchNorm layer trains for a few steps with
``DistributedOptimizer`` on uneven shards (the layer's backward all-reduce
interleaves with the optimizer's bucket all-reduces) and must match the
same model with ``nn.BatchNorm1d`` trained on the global batch in one
process. Finally a global batch of one sample must raise ``ValueError`` on
every rank. Cases (one per launch): ``batch_norm`` (the shardings, the
process set, the one-sample error) and ``training``.

Any failure prints a traceback and exits 1 at once (``os._exit``): the other
ranks then fail their next collective (``DP_PLUGIN_TIMEOUT``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from _fail_fast import run_cases
from torch import nn

import dp_plugin.torch as hvd

STEPS = 3
TOL = 1e-5


@dataclass(frozen=True)
class Case:
    name: str
    trailing: tuple[int, ...]
    """Dimensions after (N, C): () -> BatchNorm1d on (N, C), (L,) -> 1d, (H, W) -> 2d ..."""
    channels: int
    rows: tuple[int, ...]
    """Per-rank batch sizes (indexed by rank; cycled if shorter than the world)."""
    affine: bool = True
    momentum: float | None = 0.1
    dtype: torch.dtype = torch.float32


SHARDINGS = [
    Case("2d-uneven", (5, 4), 3, rows=(3, 5, 2)),
    Case("1d-features", (), 6, rows=(7, 2, 4)),
    Case("1d-sequence-cma", (9,), 4, rows=(2, 3, 1), momentum=None),
    Case("3d-no-affine", (3, 2, 4), 2, rows=(1, 4, 3), affine=False),
    Case("empty-shard", (4, 4), 3, rows=(4, 0, 5)),
    Case("float64", (6, 6), 5, rows=(4, 1, 6), dtype=torch.float64),
]

_BN = {0: nn.BatchNorm1d, 1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def check_close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    if not err <= TOL * (1 + want.double().abs().max().item() if want.numel() else 1):
        raise AssertionError(f"{what}: max abs error {err:.3g} > {TOL:g}")


def sum_over_ranks(t: torch.Tensor, process_set: Any = None) -> torch.Tensor:
    kwargs = {} if process_set is None else {"process_set": process_set}
    parts: list[torch.Tensor] = hvd.allgather_object(t.detach().clone(), **kwargs)
    return torch.stack(parts).sum(0)


def run_case(case: Case, rank: int, size: int, process_set: Any = None) -> None:
    """``rank``/``size``: within ``process_set`` (default: the whole job)."""
    rows = [case.rows[r % len(case.rows)] for r in range(size)]
    start, total = sum(rows[:rank]), sum(rows)
    gen = torch.Generator().manual_seed(1234)
    kwargs = {"affine": case.affine, "momentum": case.momentum}
    sync = hvd.SyncBatchNorm(case.channels, **kwargs, process_set=process_set).to(case.dtype)
    ref = _BN[len(case.trailing)](case.channels, **kwargs).to(case.dtype)
    if case.affine:
        with torch.no_grad():
            for mod in (sync, ref):  # same non-trivial affine parameters on both
                g = torch.Generator().manual_seed(99)
                mod.weight.copy_(torch.rand(case.channels, generator=g) + 0.5)
                mod.bias.copy_(torch.randn(case.channels, generator=g))

    for step in range(STEPS):
        shape = (total, case.channels, *case.trailing)
        x_all = (torch.randn(shape, generator=gen) * (step + 1) + 3.0).to(case.dtype)
        r_all = torch.randn(shape, generator=gen).to(case.dtype)
        where = f"{case.name} step {step}"

        x_ref = x_all.clone().requires_grad_(True)
        out_ref = ref(x_ref)
        (out_ref * r_all).sum().backward()
        mine = slice(start, start + rows[rank])

        x = x_all[mine].clone().requires_grad_(True)
        out = sync(x)
        (out * r_all[mine]).sum().backward()

        check_close(f"{where} output", out.detach(), out_ref.detach()[mine])
        check_close(f"{where} input grad", x.grad, x_ref.grad[mine])
        if case.affine:
            check_close(f"{where} weight grad (sum over ranks)",
                        sum_over_ranks(sync.weight.grad, process_set), ref.weight.grad)
            check_close(f"{where} bias grad (sum over ranks)",
                        sum_over_ranks(sync.bias.grad, process_set), ref.bias.grad)
            sync.zero_grad()
            ref.zero_grad()
        check_close(f"{where} running_mean", sync.running_mean, ref.running_mean)
        check_close(f"{where} running_var", sync.running_var, ref.running_var)
        if int(sync.num_batches_tracked) != step + 1:
            raise AssertionError(f"{where}: num_batches_tracked {int(sync.num_batches_tracked)}")

    # Eval mode: running statistics only, no collective (rank 0 alone runs an
    # extra eval batch; a collective there would hang the test).
    sync.eval()
    ref.eval()
    extra = 2 if rank == 0 else 1
    for i in range(extra):
        x = torch.randn((3, case.channels, *case.trailing), generator=gen).to(case.dtype)
        with torch.no_grad():
            check_close(f"{case.name} eval {i}", sync(x), ref(x))


def check_process_set(rank: int, size: int) -> None:
    """At 3+ ranks: statistics shared by the first and last rank only; a
    rank outside the set gets a ValueError instead of a hang."""
    if size < 3:
        return
    members = [0, size - 1]
    ps = hvd.add_process_set(members)
    if rank in members:
        run_case(SHARDINGS[0], members.index(rank), len(members), process_set=ps)
    else:
        try:
            hvd.SyncBatchNorm(3, process_set=ps)(torch.randn(4, 3))
        except ValueError as exc:
            if "not in its process set" not in str(exc):
                raise AssertionError(f"unexpected message: {exc}") from exc
        else:
            raise AssertionError("no ValueError on a rank outside the process set")
    hvd.remove_process_set(ps)


def run_training(rank: int, size: int) -> None:
    rows = [(3, 6, 1)[r % 3] for r in range(size)]
    start, total = sum(rows[:rank]), sum(rows)
    mine = slice(start, start + rows[rank])

    def build(seed: int, bn: type[nn.Module]) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 8), bn(8), nn.ReLU(), nn.Linear(8, 2))

    model = build(7 + rank, hvd.SyncBatchNorm)  # other seeds on purpose: broadcast fixes it
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    reference = build(7, nn.BatchNorm1d)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        x, y = torch.randn(total, 5, generator=gen), torch.randn(total, 2, generator=gen)
        opt.zero_grad()
        # Each rank's sum, scaled so that the optimizer's average over ranks
        # is the gradient of the global mean (shards are uneven).
        loss = nn.functional.mse_loss(model(x[mine]), y[mine], reduction="sum")
        (loss * size / y.numel()).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values(),
                                 strict=True):
        check_close(f"training: {name}", got, want)


def check_too_few_values(rank: int) -> None:
    """One sample in the whole global batch: ValueError on every rank, no hang."""
    sync = hvd.SyncBatchNorm(2)
    x = torch.randn(1 if rank == 0 else 0, 2, requires_grad=True)
    try:
        sync(x)
    except ValueError as exc:
        if "more than 1 value per channel" not in str(exc):
            raise AssertionError(f"unexpected message: {exc}") from exc
    else:
        raise AssertionError("no ValueError for a global batch of one sample")
    hvd.allgather_object(None)  # every rank raised and is still in step


def case_batch_norm(_: object) -> None:
    for case in SHARDINGS:
        run_case(case, hvd.rank(), hvd.size())
    check_process_set(hvd.rank(), hvd.size())
    check_too_few_values(hvd.rank())


def case_training(_: object) -> None:
    run_training(hvd.rank(), hvd.size())


CASES = {
    "batch_norm": case_batch_norm,
    "training": case_training,
}


def start(args: object) -> None:
    torch.set_num_threads(1)
    hvd.init()


if __name__ == "__main__":
    run_cases(CASES, setup=start, teardown=lambda _: hvd.shutdown())
