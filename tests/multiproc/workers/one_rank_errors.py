"""Worker: a mistake found on one rank only, before a collective.

Each case makes one rank's call wrong (a root_rank no other rank passes, an
object the root cannot pickle, a parameter unfrozen after wrapping) and
expects the same kind of error on EVERY rank, at once: well before
DP_PLUGIN_TIMEOUT (the test sets it long), so nobody waited for the others.
Prints ``rank R raised after S s: <error>``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from _fail_fast import run_cases

import dp_plugin.torch as hvd
from dp_plugin.errors import DPPluginError

FAST_S = 10.0


def _expect(fn: Callable[[], Any], needle: str,
            kinds: tuple[type[Exception], ...] = (TypeError, ValueError)) -> None:
    start = time.monotonic()
    try:
        fn()
    except kinds as exc:
        took = time.monotonic() - start
        print(f"rank {hvd.rank()} raised after {took:.1f} s: {exc}", flush=True)
        if needle not in str(exc):
            raise AssertionError(f"the error does not say {needle!r}: {exc}") from exc
        if took > FAST_S:
            raise AssertionError(f"the error took {took:.1f} s") from exc
        return
    raise AssertionError("no error")


def _root(good: int = 0, bad: int = 7) -> int:
    return bad if hvd.rank() == hvd.size() - 1 else good


def case_object_root_out_of_range(_: Any) -> None:
    _expect(lambda: hvd.broadcast_object({"a": 1}, root_rank=_root()),
            "different root_rank values")


def case_object_roots_differ(_: Any) -> None:
    _expect(lambda: hvd.broadcast_object({"a": 1}, root_rank=_root(0, 1)),
            "different root_rank values")


def case_parameters_root_differs(_: Any) -> None:
    model = torch.nn.Linear(3, 2)
    _expect(lambda: hvd.broadcast_parameters(model.state_dict(), root_rank=_root()),
            "different root_rank values")


def case_optimizer_state_root_differs(_: Any) -> None:
    opt = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    _expect(lambda: hvd.broadcast_optimizer_state(opt, root_rank=_root()),
            "different root_rank values")


def case_root_cannot_pickle(_: Any) -> None:
    obj = threading.Lock() if hvd.rank() == 0 else None
    _expect(lambda: hvd.broadcast_object(obj, root_rank=0), "rank(s) [0] could not pickle")


def case_one_rank_cannot_pickle_for_allgather(_: Any) -> None:
    obj = threading.Lock() if hvd.rank() == hvd.size() - 1 else 1
    _expect(lambda: hvd.allgather_object(obj),
            f"rank(s) [{hvd.size() - 1}] could not pickle")


def case_unfrozen_on_one_rank(_: Any) -> None:
    """The last rank alone unfreezes a parameter after wrapping: every rank
    raises at that step's synchronize(), naming the rank."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(5, 3)).sum().backward()
        opt.step()

    step()
    last = hvd.size() - 1
    if hvd.rank() == last:
        model[0].weight.requires_grad_(True)
    _expect(step, f"on rank {last} requires a gradient", (DPPluginError,))


def case_checkpoint_unwritable(_: Any) -> None:
    """Rank 0 alone writes, and cannot (the directory is under a file):
    every rank raises, not rank 0 alone while the others go on."""
    import tempfile
    from pathlib import Path

    blocker = Path(tempfile.gettempdir()) / f"dp_plugin-test-blocker-{os.getppid()}"
    if hvd.rank() == 0:
        blocker.write_text("a file, not a directory")
    try:
        _expect(lambda: hvd.save_checkpoint(blocker / "ckpt" / "last.pt", step=1),
                "rank 0 could not write the checkpoint", (hvd.CheckpointError,))
    finally:
        if hvd.rank() == 0:
            blocker.unlink()


CASES = {
    "checkpoint_unwritable": case_checkpoint_unwritable,
    "object_root_out_of_range": case_object_root_out_of_range,
    "object_roots_differ": case_object_roots_differ,
    "parameters_root_differs": case_parameters_root_differs,
    "optimizer_state_root_differs": case_optimizer_state_root_differs,
    "root_cannot_pickle": case_root_cannot_pickle,
    "one_rank_cannot_pickle_for_allgather": case_one_rank_cannot_pickle_for_allgather,
    "unfrozen_on_one_rank": case_unfrozen_on_one_rank,
}


def _setup(_: Any) -> None:
    hvd.init()


if __name__ == "__main__":
    run_cases(CASES, setup=_setup, teardown=lambda _: hvd.shutdown())
