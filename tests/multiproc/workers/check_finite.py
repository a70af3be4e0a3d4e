"""Worker: DP_PLUGIN_CHECK_FINITE with an inf on one rank (the last).

``skip``: the step with the inf is skipped on every rank: the parameters
are the same on every rank and equal to two clean SGD steps. ``raise``:
every rank raises NonFiniteGradientError naming the parameter and the rank.
``raise_joined``: rank 0 has joined (``hvd.join()``) when the last rank's
gradient is inf: the joined rank raises too instead of waiting.
Each rank prints ``rank R OK`` when its expectation held.
"""

from __future__ import annotations

import math

import torch
from _fail_fast import run_cases
from torch import nn

import dp_plugin.torch as hvd
from dp_plugin.errors import NonFiniteGradientError


def _setup() -> tuple[nn.ParameterDict, torch.optim.Optimizer]:
    params = nn.ParameterDict({"w": nn.Parameter(torch.ones(3)),
                               "b": nn.Parameter(torch.ones(2))})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params.parameters(), lr=0.5),
                                   named_parameters=params.named_parameters())
    return params, opt


def _step(params: nn.ParameterDict, opt: torch.optim.Optimizer, bad: bool) -> None:
    opt.zero_grad()
    scale = math.inf if bad else 1.0
    ((params["w"] * 2.0).sum() + (params["b"] * scale).sum()).backward()
    opt.step()


def _bad(step: int) -> bool:
    return step == 1 and hvd.rank() == hvd.size() - 1


def case_skip(_: object) -> None:
    params, opt = _setup()
    for step in range(3):
        _step(params, opt, _bad(step))
    w = params["w"].detach()
    if not torch.equal(w, torch.full((3,), -1.0)):  # 1 - 2 * (0.5 * 2): inf step skipped
        raise AssertionError(f"w is {w.tolist()}, expected two clean steps (-1)")
    if not torch.isfinite(params["b"]).all():
        raise AssertionError(f"b is {params['b'].tolist()}: the inf step was applied")
    everyone = hvd.allgather_object(torch.cat([p.detach() for p in params.values()]))
    if any(not torch.equal(x, everyone[0]) for x in everyone):
        raise AssertionError(f"ranks differ: {everyone}")


def _expect_raise(fn: object) -> None:
    try:
        fn()  # type: ignore[operator]
    except NonFiniteGradientError as exc:
        text = str(exc)
        expected = f"first appeared on rank {hvd.size() - 1} "
        if "parameter 'b'" not in text or expected not in text:
            raise AssertionError(f"message lacks the parameter or rank: {text}") from exc
        print(f"rank {hvd.rank()} raised: {text}", flush=True)
        return
    raise AssertionError("no NonFiniteGradientError")


def case_raise(_: object) -> None:
    params, opt = _setup()

    def train() -> None:
        for step in range(3):
            _step(params, opt, _bad(step))

    _expect_raise(train)


def case_raise_joined(_: object) -> None:
    params, opt = _setup()

    def train() -> None:
        steps = 1 if hvd.rank() == 0 else 3
        for step in range(steps):
            _step(params, opt, _bad(step))
        hvd.join()

    _expect_raise(train)


CASES = {"skip": case_skip, "raise": case_raise, "raise_joined": case_raise_joined}


def start(_: object) -> None:
    torch.set_num_threads(1)
    hvd.init()


if __name__ == "__main__":
    run_cases(CASES, setup=start, teardown=lambda _: hvd.shutdown())
