"""Worker: ``hvd.elastic`` under ``torchrun --max-restarts 1``, 3 workers.

A tiny model with dropout (each rank's RNG matters), SGD with momentum (the
optimizer state matters) and a StepLR scheduler trains for ``STEPS`` steps;
the batch of step ``s`` on rank ``r`` is drawn from a generator seeded with
``(s, r)``, so the data order does not depend on the process's history.
``state.commit()`` runs every ``COMMIT_EVERY`` steps.

``uninterrupted``: the run as it is. ``killed``: on the first attempt rank 1
SIGKILLs itself right after step ``KILL_AFTER``; torchrun restarts all three
workers and ``run`` resumes them from the commit of step 5. ``killed`` gives
no ``commit_path`` (as Horovod's own elastic example): the commits go to the
per-job default under torchrun. ``rank0_dies``: the same, but rank 0 is
killed (so nothing removes the commit of step 5); ``fresh``: the default
commit path, nobody killed (a new job after ``rank0_dies``). ``held``: the
default commit path; on the first attempt the ranks of the second host
(``cross_rank`` 1) print ``rank R holds at step 7`` and wait there for
someone outside to kill them (the Kubernetes rehearsal kills one pod's
workers), while the others block in step 8's all-reduce.

At the end rank 0 writes the raw bytes of every weight to ``--out``/weights.bin
(the test compares both runs' files) and every rank checks that the ranks
hold the same weights. Each attempt prints ``rank R attempt A starts at step S``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time
from pathlib import Path

import torch
from _fail_fast import run_cases
from torch import nn

import dp_plugin.torch as hvd

STEPS = 12
COMMIT_EVERY = 5
KILL_AFTER = 7
HOLD_S = 30


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + hvd.rank())
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _train(out: Path, kill: int | None, default_path: bool = True, hold: bool = False) -> None:
    """Train; rank ``kill`` (None: nobody) kills itself on the first attempt;
    with ``hold``, the second host's ranks wait to be killed instead."""
    hvd.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 4))
    torch.manual_seed(100 + hvd.rank())  # dropout masks differ between ranks
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(base, step_size=3, gamma=0.5)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    # ``killed`` is Horovod's elastic example as written: no commit_path,
    # torchrun's run id gives the default one (elastic.default_commit_path).
    where = {} if default_path else {"commit_path": out / "commit.pt"}
    state = hvd.elastic.TorchState(model, opt, scheduler=scheduler, batch=0, **where)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        print(f"rank {hvd.rank()} attempt {attempt} starts at step {state.batch}", flush=True)
        for step in range(state.batch, STEPS):
            x, y = _batch(step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            scheduler.step()
            state.batch = step + 1
            if state.batch % COMMIT_EVERY == 0:
                state.commit()
            if attempt == 0 and state.batch == KILL_AFTER and hvd.rank() == kill:
                os.kill(os.getpid(), signal.SIGKILL)
            if hold and attempt == 0 and state.batch == KILL_AFTER and hvd.cross_rank() == 1:
                print(f"rank {hvd.rank()} holds at step {KILL_AFTER}", flush=True)
                time.sleep(HOLD_S)  # killed long before; if not, the test sees no resume

    train(state)
    weights = b"".join(t.detach().contiguous().numpy().tobytes()
                       for t in model.state_dict().values())
    digests = hvd.allgather_object(hashlib.sha256(weights).hexdigest())
    if len(set(digests)) != 1:
        raise AssertionError(f"the ranks' final weights differ: {digests}")
    if hvd.rank() == 0:
        (out / "weights.bin").write_bytes(weights)
    hvd.shutdown()


CASES = {
    "uninterrupted": lambda args: _train(Path(args.out), kill=None, default_path=False),
    "killed": lambda args: _train(Path(args.out), kill=1),
    "rank0_dies": lambda args: _train(Path(args.out), kill=0),
    "fresh": lambda args: _train(Path(args.out), kill=None),
    "held": lambda args: _train(Path(args.out), kill=None, hold=True),
}

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="directory for the commit and weights")
    run_cases(CASES, parser=parser)
