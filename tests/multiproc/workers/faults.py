"""Worker: one rank fails in the middle of training; the others must end.

A tiny model trains with ``hvd.DistributedOptimizer`` for ``STEPS`` steps.
At step ``FAULT_STEP`` the last rank (the "faulty" one) does the case's
fault and prints ``FAULT at <unix time>`` first:

- ``kill``: SIGKILLs itself after the forward pass (its gradient buckets
  never start; the others wait in theirs);
- ``stall``: sleeps in the middle of backward's hooks, alive and holding its
  sockets, until the others have reported their error (each creates
  ``FAULT_RELEASE.<rank>``) or for DP_PLUGIN_TIMEOUT + ``STALL_EXTRA_S`` s,
  then goes on (and fails: the others are gone);
- ``mismatch``: skips ``optimizer.step()`` and all-reduces a metric instead,
  so the ranks issue different collectives;
- ``link_down``: takes its own network interface down (``FAULT_IFACE``), as
  a cut cable between two hosts; run it in a network namespace.

Every other rank must raise a dp_plugin error: it prints ``rank R error at
<unix time>: <message>``, shuts the engine down (what interpreter exit would
do) and prints ``rank R shut down at <unix time>``, then re-raises (exit 1
through ``run_cases``). The pytest side (test_faults.py) checks the times
and the message, and that no process is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

import torch
from _fail_fast import run_cases
from torch import nn

import dp_plugin.torch as hvd
from dp_plugin.errors import DPPluginError
from dp_plugin.launch import runtime

STEPS = 4
FAULT_STEP = 2
STALL_EXTRA_S = 2.0


def _fault_now() -> None:
    print(f"rank {hvd.rank()} FAULT at {time.time():.3f}", flush=True)


def _kill() -> None:
    _fault_now()
    os.kill(os.getpid(), signal.SIGKILL)


def _stall() -> None:
    _fault_now()
    others = [f"{os.environ['FAULT_RELEASE']}.{r}" for r in range(hvd.size() - 1)]
    deadline = time.monotonic() + runtime.engine().config.timeout_s + STALL_EXTRA_S
    while time.monotonic() < deadline and not all(os.path.exists(f) for f in others):
        time.sleep(0.05)


def _link_down() -> None:
    iface = os.environ["FAULT_IFACE"]
    _fault_now()
    subprocess.run(["ip", "link", "set", iface, "down"], check=True)


def train(case: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    faulty = rank == size - 1
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if faulty and case == "stall":
        # Mid-backward: the first layer's gradient is the last one ready.
        model[0].weight.register_hook(
            lambda g: (_stall() if step == FAULT_STEP else None, g)[1])
    for step in range(STEPS):
        x = torch.randn(4, 8)
        loss = model(x).pow(2).mean()
        if faulty and step == FAULT_STEP:
            if case == "kill":
                _kill()
            if case == "link_down":
                _link_down()
            if case == "mismatch":
                _fault_now()
                hvd.allreduce(loss.detach(), name="metric.loss")
                continue
        opt.zero_grad()
        loss.backward()
        opt.step()
    hvd.allreduce(torch.zeros(1), name="end")


def case(name: str) -> Any:
    def run(_: Any) -> None:
        hvd.init()
        try:
            train(name)
        except DPPluginError as exc:
            rank = hvd.rank()
            print(f"rank {rank} error at {time.time():.3f}: {type(exc).__name__}: {exc}",
                  flush=True)
            with open(f"{os.environ['FAULT_RELEASE']}.{rank}", "w"):
                pass  # a stalled rank may go on now
            runtime.shutdown()
            print(f"rank {rank} shut down at {time.time():.3f}", flush=True)
            raise
        raise AssertionError(f"rank {hvd.rank()}: training ended without an error")

    return run


CASES = {"kill": case("kill"), "stall": case("stall"), "mismatch": case("mismatch"),
         "link_down": case("link_down")}


if __name__ == "__main__":
    run_cases(CASES)
