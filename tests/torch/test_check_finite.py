"""DP_PLUGIN_CHECK_FINITE on thread-ranks (the fake engine group): every rank
decides alike after the all-reduce; the multi-process version is in
tests/multiproc/test_check_finite_mp.py."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import pytest
import torch
from torch import nn

import dp_plugin.torch as hvd
from dp_plugin.config import Config
from dp_plugin.errors import LayoutMismatchError, NonFiniteGradientError
from tests.torch.local_runtime import local_engine  # noqa: F401 - autouse fixture
from tests.torch.test_optimizer_unit import ThreadSet
from tests.unit.fakes import make_thread_group, run_ranks_outcomes


def _params() -> nn.ParameterDict:
    return nn.ParameterDict({"w": nn.Parameter(torch.ones(3)), "b": nn.Parameter(torch.ones(2))})


def _loss(params: nn.ParameterDict, bad: bool) -> torch.Tensor:
    """The gradient of b is inf where ``bad``; w's is always finite."""
    scale = math.inf if bad else 1.0
    return (params["w"] * 2.0).sum() + (params["b"] * scale).sum()


def _run(mode: str, body: Any, n: int = 2, modes: list[str] | None = None) -> list[Any]:
    engines = make_thread_group(n, config=Config(timeout_s=20.0, check_finite=mode))
    for r, m in enumerate(modes or []):
        engines[r].config = dataclasses.replace(engines[r].config, check_finite=m)
    return run_ranks_outcomes(engines, lambda e: body(e.rank, ThreadSet(e)), timeout=30)


def _train(rank: int, ps: ThreadSet, bad_step: int, closure: bool = False) -> list[float]:
    params = _params()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params.parameters(), lr=0.5),
                                   named_parameters=params.named_parameters(), process_set=ps)
    seen = []
    for step in range(3):
        opt.zero_grad()
        bad = step == bad_step and rank == 1
        if closure:
            def closure_fn(bad: bool = bad) -> torch.Tensor:
                opt.zero_grad()
                loss = _loss(params, bad)
                loss.backward()
                return loss
            opt.step(closure_fn)
        else:
            _loss(params, bad).backward()
            opt.step()
        seen.append(float(params["w"][0].detach()))
    assert all(torch.isfinite(p).all() for p in params.values())
    return seen


@pytest.mark.parametrize("closure", [False, True])
def test_skip_skips_the_step_on_every_rank(closure: bool,
                                           caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dp_plugin"):
        outcomes = _run("skip", lambda r, ps: _train(r, ps, bad_step=1, closure=closure))
    # Step 0 and 2 update w by -0.5*2 each; step 1 is skipped on both ranks.
    assert outcomes == [[0.0, 0.0, -1.0]] * 2, outcomes
    warnings = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per step, not per rank or parameter
    assert "'b'" in warnings[0] and "rank 1" in warnings[0] and "step 1" in warnings[0]


def test_raise_names_the_parameter_and_the_rank_on_every_rank() -> None:
    outcomes = _run("raise", lambda r, ps: _train(r, ps, bad_step=1), n=3)
    for out in outcomes:
        assert isinstance(out, NonFiniteGradientError), outcomes
        text = str(out)
        assert "parameter 'b'" in text and "'w'" not in text, text
        assert "first appeared on rank 1 " in text, text
        assert "DP_PLUGIN_CHECK_FINITE=skip" in text, text


def test_off_lets_inf_through_as_before() -> None:
    def body(rank: int, ps: ThreadSet) -> bool:
        params = _params()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params.parameters(), lr=0.5),
                                       named_parameters=params.named_parameters(),
                                       process_set=ps)
        _loss(params, rank == 1).backward()
        opt.step()
        return bool(torch.isfinite(params["b"]).all())

    assert _run("off", body) == [False, False]


def test_different_modes_across_ranks_are_a_clear_error() -> None:
    outcomes = _run("off", lambda r, ps: _train(r, ps, bad_step=-1), modes=["off", "skip"])
    for out in outcomes:
        assert isinstance(out, LayoutMismatchError), outcomes
        assert "DP_PLUGIN_CHECK_FINITE" in str(out), out


def test_config_reads_the_mode() -> None:
    assert Config.from_env({}).check_finite == "off"
    assert Config.from_env({"DP_PLUGIN_CHECK_FINITE": " Skip "}).check_finite == "skip"
    with pytest.raises(ValueError, match=r"DP_PLUGIN_CHECK_FINITE='yes' is not a known mode; "
                                         r"valid values: off, skip, raise"):
        Config.from_env({"DP_PLUGIN_CHECK_FINITE": "yes"})
