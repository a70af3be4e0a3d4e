"""Worker of the fault matrix (tests/multiproc/test_fault_matrix.py): one
rank of two dies by a signal at a named phase of a tiny training run.

``FAULT_PHASE`` names the phase, ``FAULT_SIGNAL`` the signal (``SIGKILL``
or ``SIGTERM``; dp_plugin installs no handler, so both end the process at
once, without ``atexit``: every rank prints ``rank R SIGTERM handler
default`` after its first step, or the handler it found),
``FAULT_CHECKPOINT`` the checkpoint path. The victim prints ``rank R pid P
FAULT at <unix time>`` and signals itself (``os.kill(os.getpid(), sig)``) at
exactly that point:

- ``init``: rank 1, just before ``hvd.init()`` (rank 0 is inside it);
- ``agreement``: rank 1, just before an ``hvd.allreduce`` (rank 0 waits in
  that call's agreement check, the first step of every collective);
- ``mid_bucket``: rank 1, inside backward after its first buckets were
  started (a gradient hook on the first layer's weight, the last gradient
  ready; one tensor per bucket);
- ``join``: rank 1, inside ``hvd.join()`` (a timer thread, 0.3 s after the
  call; ``join`` cannot return before rank 0, which never joins, keeps
  stepping);
- ``save``: rank 0, the writer, inside ``save_checkpoint`` after half of the
  new checkpoint's bytes reached its temporary file (rank 1 waits for the
  outcome);
- ``shutdown``: rank 1, inside ``hvd.shutdown()`` after its last collective
  (the engine's library teardown is next).

Before the fault, every rank has trained a step and rank 0 has saved the
"old" checkpoint (step 1; except ``init``) and printed ``rank 0 old
checkpoint sha256 <hex of the file>``. A rank that gets an error prints
``rank R error at <unix time>: <type>: <message>``, shuts down, prints
``rank R shut down at <unix time>`` and exits 1; a rank whose program ends
prints ``rank R finished at <unix time>`` and exits 0.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from pathlib import Path

import torch
from torch import nn

import dp_plugin.torch as hvd
from dp_plugin.launch import runtime

PHASE = os.environ["FAULT_PHASE"]
SIGNAL = getattr(signal, os.environ["FAULT_SIGNAL"])
CHECKPOINT = Path(os.environ["FAULT_CHECKPOINT"])
VICTIM = 0 if PHASE == "save" else 1
RANK = int(os.environ.get("RANK") or os.environ.get("PMI_RANK") or 0)
"""From the launcher: the ``init`` victim dies before dp_plugin knows it."""


def fault() -> None:
    print(f"rank {RANK} pid {os.getpid()} FAULT at {time.time():.3f}", flush=True)
    os.kill(os.getpid(), SIGNAL)


def victim(phase: str) -> bool:
    return phase == PHASE and RANK == VICTIM


def train() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()

    step()
    # Nothing dp_plugin set up (engine, transport threads, checkpoint) may
    # have installed a SIGTERM handler: with the default one, SIGTERM ends
    # the process as SIGKILL does, which is why the matrix runs SIGTERM in
    # one phase only (the test checks this line in every cell).
    handler = signal.getsignal(signal.SIGTERM)
    print(f"rank {RANK} SIGTERM handler {'default' if handler == signal.SIG_DFL else handler}",
          flush=True)
    hvd.save_checkpoint(CHECKPOINT, step=1, model=model.state_dict())
    if RANK == 0:
        digest = hashlib.sha256(CHECKPOINT.read_bytes()).hexdigest()
        print(f"rank 0 old checkpoint sha256 {digest}", flush=True)
    if PHASE == "agreement":
        if victim("agreement"):
            fault()
        hvd.allreduce(torch.ones(2), name="metric")
    if PHASE == "mid_bucket":
        if victim("mid_bucket"):
            model[0].weight.register_hook(lambda g: (fault(), g)[1])
        step()
    if PHASE == "join":
        if victim("join"):
            threading.Timer(0.3, fault).start()
            hvd.join()
        while True:  # rank 0: until rank 1's death reaches it
            step()
    if PHASE == "save":
        if victim("save"):
            _die_halfway_through_the_next_write()
        hvd.save_checkpoint(CHECKPOINT, step=2, model=model.state_dict())
    hvd.allreduce(torch.ones(1), name="last")
    if victim("shutdown"):
        engine = runtime.engine()
        teardown = engine._close  # the library teardown, after the channels
        engine._close = lambda: (fault(), teardown())  # type: ignore[method-assign]


def _die_halfway_through_the_next_write() -> None:
    real_fdopen = os.fdopen

    class Dying:
        def __init__(self, f: object) -> None:
            self.f = f

        def __enter__(self) -> Dying:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def write(self, data: bytes) -> int:
            if len(data) < 100:  # the header
                return self.f.write(data)  # type: ignore[attr-defined]
            self.f.write(data[: len(data) // 2])  # type: ignore[attr-defined]
            self.f.flush()  # type: ignore[attr-defined]
            fault()
            return 0

    os.fdopen = lambda fd, mode: Dying(real_fdopen(fd, mode))  # type: ignore[assignment]


def _meet() -> None:
    """Wait until every rank has imported torch (files beside the checkpoint):
    on a loaded machine the imports end seconds apart, longer than the
    short DP_PLUGIN_TIMEOUT of the matrix, and init() would time out."""
    size = int(os.environ.get("WORLD_SIZE") or os.environ.get("PMI_SIZE") or 1)
    (CHECKPOINT.parent / f"ready.{RANK}").touch()
    deadline = time.monotonic() + 180
    while not all((CHECKPOINT.parent / f"ready.{r}").exists() for r in range(size)):
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {RANK}: the other ranks did not start within 180 s")
        time.sleep(0.01)


def main() -> None:
    print(f"rank {RANK} pid {os.getpid()} starts", flush=True)
    _meet()
    if victim("init"):
        fault()
    try:
        hvd.init()
        train()
        hvd.shutdown()
    except Exception as exc:
        rank = RANK
        print(f"rank {rank} error at {time.time():.3f}: {type(exc).__name__}: {exc}", flush=True)
        try:
            runtime.shutdown()
        finally:
            print(f"rank {rank} shut down at {time.time():.3f}", flush=True)
        raise SystemExit(1) from exc
    print(f"rank {RANK} finished at {time.time():.3f}", flush=True)


if __name__ == "__main__":
    main()
