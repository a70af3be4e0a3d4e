"""Worker: ``DistributedOptimizer(shard_optimizer_state=True)`` (ZeRO stage 1).

Run under any launcher (see tests/multiproc/harness.py); the engine comes
from DP_PLUGIN_ENGINE. One launch runs one case (``--case NAME``,
``--list-cases``) and prints ``rank R OK`` when it passed.

Every case trains two copies of the same model side by side, each with its
own ``DistributedOptimizer`` over the same data: one sharded, one not. After
every step their parameters must be bitwise equal (``BITWISE``, "1": the
engine's reduce-scatter sums as its all-reduce does; "0": within 1e-6, for
an engine whose library reduce-scatters in an order of its own), and equal
on every rank.

- ``optimizers``: SGD with momentum, Adam and AdamW; each rank keeps the
  state of at most 1/size of the elements (+ one element per bucket).
- ``options``: backward_passes_per_step=2, compression=fp16,
  gradient_predivide_factor=2, groups=3, op=Sum, a closure, an unused
  parameter, the backward_passes_per_step setter and add_param_group.
- ``checkpoint``: the sharded ``state_dict()`` equals the unsharded one;
  each loads into the other and training goes on bitwise alike; elastic's
  ``TorchState`` commits and restores the sharded state;
  ``broadcast_optimizer_state`` fixes other ranks' hyper-parameters.
- ``join``: rank r trains 3 + r steps, then ``hvd.join()``; the last rank's
  parameters equal the unsharded run's.
- ``process_set``: at 3 ranks, optimizers over the set {0, last} (run at 3).
- ``refused``: LBFGS, Adafactor, a sparse embedding: clear errors.
- ``from_env``: run under DP_PLUGIN_SHARD_OPTIMIZER_STATE=1.
- ``check_finite``: run under DP_PLUGIN_CHECK_FINITE=skip.

``DP_TEST_DEVICE=cuda`` puts the models and batches on the GPU (every rank
on ``cuda:0``: tests/torch/test_cuda_paths.py runs it on the gloo engine).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch
from _fail_fast import run_cases
from torch import nn

import dp_plugin.torch as hvd

PER_RANK = 4
STEPS = 5
BITWISE = os.environ.get("BITWISE", "1") == "1"
DEVICE = torch.device(os.environ.get("DP_TEST_DEVICE", "cpu"))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 33), nn.Tanh(), nn.Linear(33, 17), nn.Tanh())
        self.head = nn.Linear(17, 3)
        self.unused = nn.Linear(3, 3)  # requires grad, never in the graph

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def batch(step: int, micro: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return (torch.randn(rows, 6, generator=g).to(DEVICE),
            torch.randn(rows, 3, generator=g).to(DEVICE))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def pair(make: Callable[[Any], torch.optim.Optimizer], named: bool = True, **kwargs: Any
         ) -> list[tuple[nn.Module, Any]]:
    """[(model, unsharded optimizer), (its copy, sharded optimizer)]."""
    torch.manual_seed(3)
    model = Net().to(DEVICE)
    twin = copy.deepcopy(model)
    return [(m, hvd.DistributedOptimizer(make(m.parameters()),
                                         named_parameters=m.named_parameters() if named
                                         else None,
                                         shard_optimizer_state=shard, **kwargs))
            for m, shard in ((model, False), (twin, True))]


def train(pairs: list[tuple[nn.Module, Any]], steps: range, passes: int = 1,
          closure: bool = False) -> None:
    rank, size = hvd.rank(), hvd.size()
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for step in steps:
        for model, opt in pairs:
            opt.zero_grad()

            def loss_of(model: nn.Module = model, step: int = step) -> torch.Tensor:
                total = torch.zeros((), device=DEVICE)
                for micro in range(passes):
                    x, y = batch(step, micro, PER_RANK * size)
                    loss = nn.functional.mse_loss(model(x[mine]), y[mine]) / passes
                    loss.backward()
                    total += loss.detach()
                return total

            if closure:
                opt.step(loss_of)
            else:
                loss_of()
                opt.step()
        same(pairs, f"step {step}")


def same(pairs: list[tuple[nn.Module, Any]], what: str) -> None:
    (plain, _), (sharded, _) = pairs
    a, b = flat(plain), flat(sharded)
    ok = torch.equal(a, b) if BITWISE else torch.allclose(a, b, rtol=0, atol=1e-6)
    if not ok:
        raise AssertionError(f"{what}: sharded parameters differ from unsharded "
                             f"(max diff {(a - b).abs().max():.3g})")
    everyone = hvd.allgather_object(b, name=f"sharded.{what}")
    if not all(torch.equal(t, everyone[0]) for t in everyone):
        raise AssertionError(f"{what}: ranks' sharded parameters differ")


def state_numel(opt: Any) -> int:
    return sum(v.numel() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)


def case_optimizers(_: object) -> None:
    size = hvd.size()
    for name, make in [
        ("sgd-momentum", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
        ("adam", lambda ps: torch.optim.Adam(ps, lr=0.01)),
        ("adamw", lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)),
    ]:
        pairs = pair(make)
        train(pairs, range(STEPS))
        (plain, plain_opt), (_, opt) = pairs
        whole, mine = state_numel(plain_opt), state_numel(opt)
        buckets = len(opt._dp.reducer.plan)
        per_element = whole // sum(p.numel() for p in plain.parameters())
        if mine > per_element * (whole // per_element // size + buckets):
            raise AssertionError(f"{name}: this rank keeps {mine} state elements of {whole}")
        print(f"rank {hvd.rank()} {name}: state {mine} of {whole} elements, "
              f"{buckets} buckets", flush=True)


def case_options(_: object) -> None:
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    adam = lambda ps: torch.optim.Adam(ps, lr=0.01)  # noqa: E731
    train(pair(sgd, backward_passes_per_step=2), range(STEPS), passes=2)
    train(pair(adam, compression=hvd.Compression.fp16), range(STEPS))
    train(pair(adam, gradient_predivide_factor=2.0), range(STEPS))
    train(pair(sgd, groups=3), range(STEPS))
    train(pair(sgd, op=hvd.Sum), range(STEPS))
    train(pair(adam), range(STEPS), closure=True)
    for _, opt in pair(sgd):
        opt.backward_passes_per_step = 2  # re-plans, keeps the (empty) state
    pairs = pair(adam, named=False)
    train(pairs, range(2))
    for _, opt in pairs:  # a new group re-plans: the state moves with it
        opt.add_param_group({"params": [nn.Parameter(torch.ones(5, device=DEVICE))], "lr": 0.1})
    train(pairs, range(2, 4))


def case_checkpoint(_: object) -> None:
    adam = lambda ps: torch.optim.Adam(ps, lr=0.01)  # noqa: E731
    pairs = pair(adam)
    train(pairs, range(3))
    (plain, plain_opt), (sharded, opt) = pairs
    whole, from_shards = plain_opt.state_dict(), opt.state_dict()
    if whole["param_groups"] != from_shards["param_groups"] or \
            whole["state"].keys() != from_shards["state"].keys():
        raise AssertionError(f"the sharded state_dict's layout differs from the unsharded "
                             f"one: {whole['param_groups']} {list(whole['state'])} vs "
                             f"{from_shards['param_groups']} {list(from_shards['state'])}")
    for i, entry in whole["state"].items():
        for key, value in entry.items():
            if not torch.equal(value, from_shards["state"][i][key]):
                raise AssertionError(f"state_dict()['state'][{i}][{key!r}] differs")
    # Each into the other: training goes on alike.
    plain_opt.load_state_dict(copy.deepcopy(from_shards))
    opt.load_state_dict(copy.deepcopy(whole))
    train(pairs, range(3, 5))
    # Elastic: commit, train on, restore, train again: the same as before.
    state = hvd.elastic.TorchState(model=sharded, optimizer=opt)
    state.commit()
    before = flat(sharded)
    train(pairs, range(5, 6))
    state.restore()
    if not torch.equal(flat(sharded), before):
        raise AssertionError("elastic restore did not bring back the sharded model")
    for model, _ in pairs:
        with torch.no_grad():
            for p, q in zip(model.parameters(), sharded.parameters(), strict=True):
                p.copy_(q)
    plain_opt.load_state_dict(opt.state_dict())
    train(pairs, range(5, 7))
    # A resumed run: a fresh sharded optimizer from the unsharded checkpoint.
    resumed = copy.deepcopy(plain)
    fresh = hvd.DistributedOptimizer(adam(resumed.parameters()),
                                     named_parameters=resumed.named_parameters(),
                                     shard_optimizer_state=True)
    fresh.load_state_dict(plain_opt.state_dict())
    train([pairs[0], (resumed, fresh)], range(7, 9))
    # broadcast_optimizer_state fixes another rank's hyper-parameters.
    for group in fresh.param_groups:
        group["lr"] = 0.5 + hvd.rank()
    hvd.broadcast_optimizer_state(fresh, root_rank=0)
    if any(g["lr"] != 0.5 for g in fresh.param_groups):
        raise AssertionError("broadcast_optimizer_state left other learning rates")


def case_join(_: object) -> None:
    rank, size = hvd.rank(), hvd.size()
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    pairs = pair(sgd)
    for step in range(3 + rank):
        _one_step(pairs, step)
    last = hvd.join()
    if last != size - 1:
        raise AssertionError(f"join() returned {last}, expected {size - 1}")
    if rank == size - 1:
        (plain, _), (sharded, _) = pairs
        if not torch.equal(flat(plain), flat(sharded)):
            raise AssertionError("join: the last rank's sharded parameters differ")


def _one_step(pairs: list[tuple[nn.Module, Any]], step: int) -> None:
    rank, size = hvd.rank(), hvd.size()
    x, y = batch(step, 0, PER_RANK * size)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for model, opt in pairs:
        opt.zero_grad()
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()


def case_process_set(_: object) -> None:
    rank, size = hvd.rank(), hvd.size()
    members = hvd.add_process_set([0, size - 1])
    adam = lambda ps: torch.optim.Adam(ps, lr=0.01)  # noqa: E731
    pairs = pair(adam, process_set=members)
    if rank in (0, size - 1):
        for step in range(STEPS):
            _one_step(pairs, step)
        (plain, _), (sharded, _) = pairs
        if not torch.equal(flat(plain), flat(sharded)):
            raise AssertionError("process set: sharded parameters differ")
    hvd.remove_process_set(members)


def case_refused(_: object) -> None:
    model = Net()
    for make in (lambda ps: torch.optim.LBFGS(ps), lambda ps: torch.optim.Adafactor(ps)):
        try:
            hvd.DistributedOptimizer(make(model.parameters()), shard_optimizer_state=True)
        except ValueError as exc:
            if "cannot shard" not in str(exc) or "Fix:" not in str(exc):
                raise
        else:
            raise AssertionError("an optimizer that is not element-wise was sharded")
    emb = nn.Embedding(10, 4, sparse=True)
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                 shard_optimizer_state=True)
    except ValueError as exc:
        if "sparse_as_dense=True" not in str(exc):
            raise
    else:
        raise AssertionError("a sparse embedding was sharded")
    # sparse_as_dense: the gradient is dense, and sharded.
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                   sparse_as_dense=True, shard_optimizer_state=True)
    emb(torch.tensor([1, 2 + hvd.rank()])).sum().backward()
    opt.step()


def case_check_finite(_: object) -> None:
    """Under DP_PLUGIN_CHECK_FINITE=skip: a step whose gradient holds a nan on
    one rank is skipped alike by both optimizers, on every rank."""
    rank, size = hvd.rank(), hvd.size()
    pairs = pair(lambda ps: torch.optim.Adam(ps, lr=0.01))
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for step in range(4):
        before = flat(pairs[1][0])
        for model, opt in pairs:
            opt.zero_grad()
            x, y = batch(step, 0, PER_RANK * size)
            loss = nn.functional.mse_loss(model(x[mine]), y[mine])
            if step == 2 and rank == 0:  # in backward: the hooks see it
                loss = loss * float("nan")
            loss.backward()
            opt.step()
        same(pairs, f"step {step}")
        if (step == 2) != torch.equal(before, flat(pairs[1][0])):
            raise AssertionError(f"step {step}: skipped {step == 2}, but the parameters "
                                 f"{'did not change' if step != 2 else 'changed'}")


def case_from_env(_: object) -> None:
    """Under DP_PLUGIN_SHARD_OPTIMIZER_STATE=1: sharded unless the argument says no."""
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    plain = hvd.DistributedOptimizer(torch.optim.SGD(Net().parameters(), lr=0.1),
                                     shard_optimizer_state=False)
    if not opt.shard_optimizer_state or plain.shard_optimizer_state:
        raise AssertionError("DP_PLUGIN_SHARD_OPTIMIZER_STATE=1 was not honoured")
    try:
        hvd.DistributedOptimizer(torch.optim.LBFGS(Net().parameters()))
    except ValueError as exc:
        if "DP_PLUGIN_SHARD_OPTIMIZER_STATE" not in str(exc):
            raise
    else:
        raise AssertionError("LBFGS was sharded under DP_PLUGIN_SHARD_OPTIMIZER_STATE=1")


CASES = {
    "optimizers": case_optimizers,
    "options": case_options,
    "checkpoint": case_checkpoint,
    "join": case_join,
    "process_set": case_process_set,
    "refused": case_refused,
    "from_env": case_from_env,
    "check_finite": case_check_finite,
}


def start(args: object) -> None:
    torch.set_num_threads(1)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(0)
    hvd.init()


if __name__ == "__main__":
    run_cases(CASES, setup=start, teardown=lambda _: hvd.shutdown())
