"""Misuse of DistributedOptimizer that would let replicas silently diverge:
requires_grad changed after wrapping, a model already in DDP, a wrapper kept
across hvd.shutdown()/hvd.init(). Ranks are fake-engine threads
(``tests.unit.fakes``) or the local engine."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import dp_plugin.torch as hvd
from dp_plugin.api import process_sets
from dp_plugin.config import Config
from dp_plugin.errors import DPPluginError
from dp_plugin.launch import runtime
from tests.torch.local_runtime import local_engine  # noqa: F401 - autouse fixture
from tests.torch.test_optimizer_unit import ThreadSet, errors_on_ranks, on_ranks


def _model(rank: int) -> nn.Module:
    del rank  # same weights on every rank (a generator: threads share the global one)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def _train_step(model: nn.Module, opt: object, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)  # different data per rank
    opt.zero_grad()  # type: ignore[attr-defined]
    model(torch.randn(5, 3, generator=g)).pow(2).sum().backward()
    opt.step()  # type: ignore[attr-defined]


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("frozen_on", [(0,), (0, 1)])
def test_freezing_after_wrapping_keeps_ranks_identical(frozen_on: tuple[int, ...]) -> None:
    def body(rank: int, ps: ThreadSet) -> torch.Tensor:
        model = _model(rank)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                       momentum=0.9), process_set=ps)
        _train_step(model, opt, rank, 0)
        if rank in frozen_on:
            model[0].weight.requires_grad_(False)
        for step in range(1, 4):
            _train_step(model, opt, rank, step)
        return _flat(model)

    first, second = on_ranks(2, body)
    assert torch.equal(first, second)


def test_unfreezing_after_wrapping_raises_on_every_rank_until_refreshed() -> None:
    def body(rank: int, ps: ThreadSet) -> torch.Tensor:
        model = _model(rank)
        model[0].weight.requires_grad_(False)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       process_set=ps)
        _train_step(model, opt, rank, 0)
        model[0].weight.requires_grad_(True)
        before = _flat(model)
        with pytest.raises(DPPluginError, match=r"'0.weight'.*refresh_parameters"):
            _train_step(model, opt, rank, 1)
        assert torch.equal(_flat(model), before)  # nothing was updated with local gradients
        opt.refresh_parameters()
        for step in range(2, 4):
            _train_step(model, opt, rank, step)
        return _flat(model)

    first, second = on_ranks(2, body)
    assert torch.equal(first, second)


def test_unfreezing_on_one_rank_only_raises_on_every_rank() -> None:
    """Rank 1 alone unfreezes a parameter: both ranks raise at the same step
    (rank 0 learns it from the control slot instead of waiting for a
    collective rank 1 never issues), nothing is updated, and training goes
    on in step once rank 1 freezes it again."""
    def body(rank: int, ps: ThreadSet) -> tuple[str, torch.Tensor]:
        model = _model(rank)
        model[0].weight.requires_grad_(False)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       process_set=ps)
        _train_step(model, opt, rank, 0)
        if rank == 1:
            model[0].weight.requires_grad_(True)
        before = _flat(model)
        with pytest.raises(DPPluginError, match=r"on rank 1 requires a gradient") as err:
            _train_step(model, opt, rank, 1)
        assert torch.equal(_flat(model), before)
        model[0].weight.requires_grad_(False)
        model[0].weight.grad = None
        for step in range(2, 4):
            _train_step(model, opt, rank, step)
        return str(err.value), _flat(model)

    (first, w0), (second, w1) = on_ranks(2, body)
    assert "'0.weight'" not in first and "'0.weight'" in second
    assert torch.equal(w0, w1)


def test_unfreezing_is_caught_on_one_rank_too() -> None:
    """A single-process run fails the same way as the job it grows into."""
    model = _model(0)
    model[2].bias.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model[2].bias.requires_grad_(True)
    with pytest.raises(DPPluginError, match=r"allreduce\.noname\.0\.3.*requires a gradient"):
        _train_step(model, opt, 0, 0)
    opt.refresh_parameters()
    _train_step(model, opt, 0, 1)


def test_named_parameters_of_a_ddp_model_warn_once_per_wrap() -> None:
    model = _model(0)
    named = [(f"module.{name}", p) for name, p in model.named_parameters()]
    with pytest.warns(UserWarning, match="DistributedDataParallel.*model.module"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=iter(named))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters())


def _reinit() -> None:
    hvd.shutdown()
    runtime.init(Config(engine="local"), env={})
    process_sets.setup(None, "dp_plugin.torch")


def test_optimizer_kept_across_shutdown_and_init_raises_and_can_be_rewrapped() -> None:
    model = _model(0)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(plain)
    _train_step(model, opt, 0, 0)
    _reinit()
    with pytest.raises(DPPluginError, match=r"before hvd.shutdown\(\).*wrap again"):
        _train_step(model, opt, 0, 1)
    opt = hvd.DistributedOptimizer(opt)  # the stale wrapper itself may be wrapped anew
    assert type(opt).__name__ == "DistributedSGD"
    _train_step(model, opt, 0, 2)
    fresh = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        hvd.DistributedOptimizer(fresh)


def test_stale_optimizer_on_several_ranks_raises_instead_of_hanging() -> None:
    def body(rank: int, ps: ThreadSet) -> None:
        model = _model(rank)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       process_set=ps)
        _train_step(model, opt, rank, 0)
        ps._engine.shutdown()  # what hvd.shutdown() does to the set's engine
        _train_step(model, opt, rank, 1)

    errors = errors_on_ranks(2, body)
    assert all("before hvd.shutdown()" in str(e) for e in errors), errors
