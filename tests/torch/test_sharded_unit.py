"""``DistributedOptimizer(shard_optimizer_state=True)`` without processes.

One process: the local engine (nothing to shard: the plain step). Several
ranks: a thread group of fake engines (``tests.unit.fakes``) handed to the
optimizer through a process set, one thread per rank; the real processes
and engines are ``tests/multiproc/test_torch_sharded.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import dp_plugin.torch as hvd
from dp_plugin.api import process_sets
from dp_plugin.config import Config
from dp_plugin.engines.base import Engine
from tests.torch.local_runtime import local_engine  # noqa: F401 - autouse fixture
from tests.unit.fakes import make_thread_group, run_ranks


class ThreadSet(process_sets.ProcessSet):
    """A process set whose engine is one thread-rank of a fake group."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(list(range(engine.size)))
        self.process_set_id = 98
        self._engine = engine


def on_ranks(n: int, fn: Callable[[int, ThreadSet], Any]) -> list[Any]:
    return run_ranks(make_thread_group(n), lambda e: fn(e.rank, ThreadSet(e)))


_MODEL = nn.Sequential(nn.Linear(3, 7), nn.Tanh(), nn.Linear(7, 2))


def model() -> nn.Module:
    """The same weights on every call and thread (the rank threads share torch's
    global generator, so none is seeded here)."""
    return copy.deepcopy(_MODEL)


def backward(m: nn.Module, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    m(torch.randn(5, 3, generator=g)).pow(2).sum().backward()


def flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=0.01),
    lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
], ids=["sgd-momentum", "adam", "adamw"])
def test_sharded_steps_bitwise_like_unsharded_and_keeps_a_slice_of_the_state(
        n: int, make: Callable[[Any], torch.optim.Optimizer]) -> None:
    def body(rank: int, ps: ThreadSet) -> tuple[torch.Tensor, int, int]:
        plain, sharded = model(), model()
        opts = [hvd.DistributedOptimizer(make(m.parameters()), process_set=ps,
                                         shard_optimizer_state=shard)
                for m, shard in ((plain, False), (sharded, True))]
        for step in range(4):
            for m, opt in zip((plain, sharded), opts, strict=True):
                opt.zero_grad()
                backward(m, rank, step)
                opt.step()
            assert torch.equal(flat(plain), flat(sharded)), step
        counts = [sum(v.numel() for s in o.state.values() for v in s.values()
                      if torch.is_tensor(v) and v.dim() > 0) for o in opts]
        return flat(sharded), counts[0], counts[1]

    results = on_ranks(n, body)
    assert all(torch.equal(r[0], results[0][0]) for r in results)
    whole = results[0][1]
    assert sum(r[2] for r in results) == whole  # every element's state, once
    assert all(r[2] <= whole // n + 2 for r in results)


def test_state_dict_is_whole_and_loads_both_ways() -> None:
    def body(rank: int, ps: ThreadSet) -> None:
        plain, sharded = model(), model()
        make = lambda m, shard: hvd.DistributedOptimizer(  # noqa: E731
            torch.optim.Adam(m.parameters(), lr=0.01), process_set=ps,
            shard_optimizer_state=shard)
        opts = [make(plain, False), make(sharded, True)]
        for step in range(2):
            for m, opt in zip((plain, sharded), opts, strict=True):
                opt.zero_grad()
                backward(m, rank, step)
                opt.step()
        whole, gathered = opts[0].state_dict(), opts[1].state_dict()
        assert whole["param_groups"] == gathered["param_groups"]
        assert whole["state"].keys() == gathered["state"].keys()
        for i, entry in whole["state"].items():
            assert all(torch.equal(v, gathered["state"][i][k]) for k, v in entry.items())
        opts[0].load_state_dict(copy.deepcopy(gathered))
        opts[1].load_state_dict(copy.deepcopy(whole))
        for step in range(2, 4):
            for m, opt in zip((plain, sharded), opts, strict=True):
                opt.zero_grad()
                backward(m, rank, step)
                opt.step()
            assert torch.equal(flat(plain), flat(sharded))

    on_ranks(2, body)


def test_one_rank_steps_like_the_plain_optimizer() -> None:
    m, ref = model(), model()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.01),
                                   shard_optimizer_state=True)
    plain = torch.optim.Adam(ref.parameters(), lr=0.01)
    for step in range(3):
        for mod, o in ((m, opt), (ref, plain)):
            o.zero_grad()
            backward(mod, 0, step)
            o.step()
    assert opt.shard_optimizer_state
    assert torch.equal(flat(m), flat(ref))
    assert opt.state_dict()["state"].keys() == plain.state_dict()["state"].keys()


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.LBFGS(ps),
    lambda ps: torch.optim.Adafactor(ps),
    lambda ps: torch.optim.SparseAdam(ps),
], ids=["lbfgs", "adafactor", "sparse-adam"])
def test_optimizers_that_are_not_element_wise_are_refused(
        make: Callable[[Any], torch.optim.Optimizer]) -> None:
    with pytest.raises(ValueError, match=r"cannot shard .*Fix: pass shard_optimizer_state=False"):
        hvd.DistributedOptimizer(make(model().parameters()), shard_optimizer_state=True)


def test_bad_argument_is_refused() -> None:
    with pytest.raises(TypeError, match=r"shard_optimizer_state=\.\.\.\) must be True or False"):
        hvd.DistributedOptimizer(torch.optim.SGD(model().parameters(), lr=0.1),
                                 shard_optimizer_state="yes")


def test_a_re_plan_moves_the_state_one_old_bucket_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step's re-plan gathers the state bucket by bucket: no rank
    ever holds the whole model's state, which is what sharding saves."""
    from dp_plugin.torch import sharded as sharded_module

    gathered: list[tuple[int, str, set[int]]] = []
    real = sharded_module.allgather_object

    def spy(engine: Engine, obj: Any, name: str) -> list[Any]:
        gathered.append((engine.rank, name, set(obj)))
        return real(engine, obj, name)

    monkeypatch.setattr(sharded_module, "allgather_object", spy)
    wide = nn.Sequential(*(nn.Linear(40, 40) for _ in range(4)))

    def body(rank: int, ps: ThreadSet) -> tuple[torch.Tensor, list[list[int]], int]:
        plain, sharded = copy.deepcopy(wide), copy.deepcopy(wide)
        opts = [hvd.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.01),
                                         process_set=ps, shard_optimizer_state=shard)
                for m, shard in ((plain, False), (sharded, True))]
        before: list[list[int]] = []
        for step in range(3):
            if step == 1:  # a re-plan with the state in place, as autotune's
                shard = opts[1]._dp.shard
                before = [list(b.members) for b in shard.plan]
                shard.reducer.plan_version += 1
            for m, opt in zip((plain, sharded), opts, strict=True):
                opt.zero_grad()
                m(torch.randn(5, 40, generator=torch.Generator().manual_seed(
                    10 * step + rank))).pow(2).sum().backward()
                opt.step()
            assert torch.equal(flat(plain), flat(sharded)), step
        return flat(sharded), before, len(list(wide.parameters()))

    small = Config(timeout_s=30.0, fusion_threshold=4096)  # a few buckets
    results = run_ranks(make_thread_group(2, config=small), lambda e: body(e.rank, ThreadSet(e)))
    assert all(torch.equal(r[0], results[0][0]) for r in results)
    buckets, params = results[0][1], results[0][2]
    assert len(buckets) > 1, buckets
    moves = [(rank, name, held) for rank, name, held in gathered if ".state" in name]
    assert moves, gathered
    for _, name, held in moves:  # each gather: one old bucket's parameters at most
        assert any(held <= set(b) for b in buckets), (name, held, buckets)
        assert len(held) < params, (name, held)
