"""Worker: ``DP_PLUGIN_AUTOTUNE=1`` with a ``DistributedOptimizer``.

Run with ``--case NAME --out DIR`` under any launcher (tests/multiproc/harness.py);
the engine comes from DP_PLUGIN_ENGINE, the autotune settings from the
environment the test sets. Every case trains the same model on the same
global batches (each rank its shard) and checks, across ranks (through
``allgather_object``), that the final parameters are bitwise identical and
within 1e-5 of a single-process run; rank 0 saves them to ``DIR/<case>.pt``
so that the test can compare a run with autotune to one without.

- ``fake_clock``: the test-only hook ``dp_plugin.reduce.autotune.clock`` gives each
  rank its own step times: rank 0 finds 1 KiB fastest, rank 1 finds 256
  bytes fastest. Every rank must adopt rank 0's choice, at the same step,
  and end with the same bucket plan.
- ``sleepy``: the real clock, and rank 1 sleeps after some steps (its
  measurements differ from rank 0's); whatever is chosen, every rank
  chooses it and the plans are identical.
- ``plain``: autotune off (the reference run).
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path
from typing import Any

import torch
from _fail_fast import run_cases
from torch import nn
from torch_equivalence import Net, flat  # the same model and flattening as the equivalence test

import dp_plugin.torch as hvd
from dp_plugin.reduce import autotune

PER_RANK = 4
STEPS = 16
"""Enough for the tuning (1 + 4 candidates x (1 warm-up + 2 timed) = 13) and 3 steps after."""
TOLERANCE = 1e-5
COSTS = [{256: 0.3, 1024: 0.1, 2048: 0.2}, {256: 0.05, 1024: 0.5, 2048: 0.2}]
"""Fake seconds per step for each rank and threshold (anything else: 0.4)."""


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return (torch.randn(rows, 6, generator=g, dtype=torch.float64),
            torch.randn(rows, 3, generator=g, dtype=torch.float64))


def train(case: str, out: Path) -> dict[str, Any]:
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(11)
    model = Net().double()
    reference = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    sched = opt._dp.reducer
    if case == "fake_clock":
        now = [0.0]

        def fake() -> float:  # this rank's cost of the threshold of the step that ended
            now[0] += COSTS[rank].get(sched.fusion_threshold, 0.4)
            return now[0]

        autotune.clock = fake
    thresholds = []
    for step in range(STEPS):
        x, y = batch(step, PER_RANK * size)
        opt.zero_grad()
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        thresholds.append(sched.fusion_threshold)
        if case == "sleepy" and rank == 1 and step % 3 == 0:
            time.sleep(0.05)
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    mine_flat = flat(model)
    everyone = hvd.allgather_object(mine_flat, name=f"{case}.final")
    for r, theirs in enumerate(everyone):
        if not torch.equal(theirs, everyone[0]):
            raise AssertionError(f"{case}: rank {r}'s parameters differ bitwise from rank 0's")
    diff = (mine_flat - flat(reference)).abs().max().item()
    if diff > TOLERANCE:
        raise AssertionError(f"{case}: max |distributed - single process| = {diff:.3g}")
    if rank == 0:
        torch.save(mine_flat, out / f"{case}.pt")
    tuner = sched.autotuner
    return {"thresholds": thresholds, "plan": [b.members for b in sched.plan],
            "decision": None if tuner is None else tuner.decision}


def check_agreed(case: str, mine: dict[str, Any]) -> dict[str, Any]:
    everyone = hvd.allgather_object(mine, name=f"{case}.tuning")
    for r, theirs in enumerate(everyone):
        for key in ("thresholds", "plan"):
            if theirs[key] != everyone[0][key]:
                raise AssertionError(f"{case}: rank {r}'s {key} {theirs[key]} differ from rank "
                                     f"0's {everyone[0][key]}")
        decision = theirs["decision"]
        if decision is None or decision.chosen != everyone[0]["decision"].chosen:
            raise AssertionError(f"{case}: rank {r} decided {decision}, rank 0 "
                                 f"{everyone[0]['decision']}")
        if decision.medians != everyone[0]["decision"].medians:
            raise AssertionError(f"{case}: rank {r} did not use rank 0's medians")
    print(f"rank {hvd.rank()} {case}: {mine['decision'].describe()}", flush=True)
    return everyone[0]


def case_fake_clock(args: argparse.Namespace) -> None:
    mine = train("fake_clock", args.out)
    check_agreed("fake_clock", mine)
    decision = mine["decision"]
    if decision.candidates != (256, 1024, 2048, 25 << 20):
        raise AssertionError(f"candidates {decision.candidates}")
    if decision.chosen != 1024 or mine["thresholds"][-1] != 1024:
        raise AssertionError(f"rank 0's choice (1024) was not adopted: {mine}")
    best_here = decision.candidates[decision.local_medians.index(min(decision.local_medians))]
    if best_here != (1024 if hvd.rank() == 0 else 256):
        raise AssertionError(f"rank {hvd.rank()}'s own measurements {decision.local_medians} "
                             "do not prefer what the fake clock says")


def case_sleepy(args: argparse.Namespace) -> None:
    check_agreed("sleepy", train("sleepy", args.out))


def case_plain(args: argparse.Namespace) -> None:
    mine = train("plain", args.out)
    if mine["decision"] is not None or set(mine["thresholds"]) != {25 << 20}:
        raise AssertionError(f"autotune ran although DP_PLUGIN_AUTOTUNE is off: {mine}")


CASES = {
    "fake_clock": case_fake_clock,
    "sleepy": case_sleepy,
    "plain": case_plain,
}


def start(args: argparse.Namespace) -> argparse.Namespace:
    torch.set_num_threads(1)
    hvd.init()
    return args


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    run_cases(CASES, parser=parser, setup=start, teardown=lambda _: hvd.shutdown())
