"""Elastic restart: ``hvd.elastic.TorchState`` and ``@hvd.elastic.run``.

    state = hvd.elastic.TorchState(model, optimizer, scheduler=sched, batch=0,
                                   commit_path="ckpt/elastic.pt")

    @hvd.elastic.run
    def train(state):
        while state.batch < steps:
            ...the training step of batch number state.batch...
            state.batch += 1            # the position after this step
            if state.batch % 500 == 0:
                state.commit()

    train(state)          # under `torchrun --max-restarts 3 --nproc_per_node N train.py`

The shape is Horovod 0.28.1's ``horovod.torch.elastic``; the recovery is not.
Horovod keeps the surviving processes alive, rolls them back to the last
commit in memory and re-forms the ring in place. dp_plugin recovers by
restarting processes: torchrun (``--max-restarts``) restarts every worker
when one fails, so a commit must outlive the process. ``commit()`` therefore
also writes the committed state through the atomic checkpoint writer
(``save_checkpoint``: rank 0 writes, every rank's RNG states are kept), and
``run`` starts each attempt by initialising the engine and loading the last
commit (``load_checkpoint``: rank 0 reads, every rank receives the same
bytes). A first start, with no commit on disk, broadcasts rank 0's state
instead, as Horovod's ``run`` does.

Tracked: every keyword value with ``state_dict``/``load_state_dict``
(models, optimizers, LR schedulers, ``ElasticSampler``, ``GradScaler``)
through those methods; any other value (epoch, batch, ...) as it is; and the
torch, numpy and ``random`` generator states of every rank.

Where commits go: ``commit_path`` if given; under torchrun without one, a
file private to the user and to this job (``default_commit_path``:
``$TMPDIR/dp_plugin-<uid>/elastic-<TORCHELASTIC_RUN_ID>.pt``, in a 0700
directory), so that Horovod's own elastic examples (``TorchState(model,
optimizer, batch=0, epoch=0)``) recover a killed worker unchanged. That
default file is removed when ``run``'s function returns.

horovodrun's elastic mode is refused with an explanation: Horovod hands new
ranks to running workers through its rendezvous server at ``hvd.init()``,
while dp_plugin reads a worker's rank once from the environment.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
import stat
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from dp_plugin.errors import LaunchError
from dp_plugin.torch import basics
from dp_plugin.torch.basics import init, shutdown
from dp_plugin.torch.checkpoint import (
    CheckpointError,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from dp_plugin.torch.elastic_sampler import ElasticSampler
from dp_plugin.torch.functions import (
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "init", "run", "shutdown"]

_MARK = "dp_plugin.elastic"
"""Key of the commit record inside the checkpoint (tells it from other checkpoints)."""

R = TypeVar("R")


class State:
    """What ``run`` needs from a state: ``sync``, ``save``, ``restore``, ``load``.

    ``commit()`` = ``save()`` (in memory) + ``persist()`` (to ``commit_path``).
    """

    commit_path: Path | None = None

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], Any]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], Any]]) -> None:
        """Functions to call after a reset (Horovod's API). dp_plugin resets by
        restarting processes, so they run when ``run`` resumes from a commit."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self) -> None:
        """Hook for subclasses: adjust to a new world size (e.g. the learning rate)."""

    def commit(self) -> None:
        """Keep the current state as the point to resume from. Collective.

        In memory (``restore()`` returns to it) and, with ``commit_path``, on
        disk through the atomic checkpoint writer: a process killed during a
        commit leaves the previous commit loadable. A commit copies every
        tracked state dict and costs a file write: commit every few hundred
        steps, not every step."""
        self.save()
        self.persist()

    def check_host_updates(self) -> None:
        """Horovod's host-change check; no-op (hosts change only through a restart)."""

    def save(self) -> None:
        raise NotImplementedError

    def persist(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def load(self) -> bool:
        raise NotImplementedError


class ObjectState(State):
    """Plain Python values, each keyword argument an attribute (Horovod's ``ObjectState``).

    ``commit_path``: where commits go (see ``TorchState``); reserved, not tracked.
    """

    default_path: bool = False
    """``commit_path`` is ``default_commit_path()`` (removed when ``run`` returns)."""

    _objects: list[str] = []
    """Names tracked through ``state_dict``/``load_state_dict`` (``TorchState``)."""

    def __init__(self, *, commit_path: str | os.PathLike[str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__()
        self.commit_path = default_commit_path() if commit_path is None else Path(commit_path)
        self.default_path = commit_path is None and self.commit_path is not None
        self._values = [n for n in kwargs if n not in self._objects]
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved: dict[str, Any] = {}
        self._saved_rng: dict[str, Any] = {}
        self.save()

    # -- what subclasses extend ------------------------------------------------

    def _snapshot(self) -> dict[str, Any]:
        return {"values": {n: copy.deepcopy(getattr(self, n)) for n in self._values}}

    def _apply(self, snapshot: dict[str, Any]) -> None:
        self._set_values(snapshot["values"])

    def _set_values(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            setattr(self, name, copy.deepcopy(value))

    def _tracked(self) -> dict[str, list[str]]:
        return {"values": sorted(self._values)}

    # -- the State protocol ------------------------------------------------------

    def save(self) -> None:
        """Copy the tracked state (and this rank's RNG states) into memory."""
        self._saved = self._snapshot()
        self._saved_rng = rng_state()

    def persist(self) -> None:
        """Write the last ``save()`` to ``commit_path`` (nothing without one). Collective."""
        if self.commit_path is not None:
            save_checkpoint(self.commit_path, **{_MARK: self._tracked(), "commit": self._saved})

    def restore(self) -> None:
        """Return to the last ``save()``/``commit()``, RNG states included."""
        self._apply(self._saved)
        set_rng_state(self._saved_rng)

    def sync(self) -> None:
        """Make every rank's state rank 0's (a first start). Collective."""
        if basics.is_initialized() and basics.size() > 1:
            self._apply_synced()
        self.save()

    def _apply_synced(self) -> None:
        values = {n: getattr(self, n) for n in self._values}
        self._set_values(broadcast_object(values, 0, name="dp_plugin.elastic.values"))

    def load(self) -> bool:
        """Resume from the commit at ``commit_path``: True if there was one
        (state and this rank's RNG states are restored), False on a first
        start or without ``commit_path``. Collective."""
        if self.commit_path is None:
            return False
        state = load_checkpoint(self.commit_path, missing_ok=True)
        if state is None:
            return False
        if _MARK not in state:
            raise CheckpointError(
                f"{str(self.commit_path)!r} is a dp_plugin checkpoint but not an elastic "
                "commit (written by save_checkpoint, not TorchState.commit); give "
                "commit_path a file of its own"
            )
        if state[_MARK] != self._tracked():
            raise CheckpointError(
                f"the commit at {str(self.commit_path)!r} tracks {state[_MARK]}, this state "
                f"tracks {self._tracked()}: it was written by another script or another "
                "version of it; delete the file to start afresh, or track the same names"
            )
        self._apply(state["commit"])
        self.save()  # the RNG states are the restored ones now
        self.on_reset()
        return True


class TorchState(ObjectState):
    """The state of a PyTorch training run (Horovod's ``TorchState``).

    ``model`` and ``optimizer`` (both optional) and every keyword argument
    become attributes. Values with ``state_dict``/``load_state_dict`` are
    tracked through them; ``sync`` broadcasts models with
    ``broadcast_parameters`` and optimizers with ``broadcast_optimizer_state``.

    ``commit_path`` (keyword only, not an attribute name Horovod scripts
    use): the file each ``commit()`` replaces atomically and ``run`` resumes
    from. Under torchrun it defaults to a per-job file in the temporary
    directory (``default_commit_path``); elsewhere (no restarts) commits
    stay in memory. Multi-host: rank 0 writes and reads it, so it must be
    where the next attempt's rank 0 can read it (shared storage, or a
    fixed first node: the default is on rank 0's local disk).
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, *,
                 commit_path: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        self._objects = sorted(n for n, v in kwargs.items() if _has_state_dict(v))
        super().__init__(commit_path=commit_path, **kwargs)

    def _snapshot(self) -> dict[str, Any]:
        snapshot = super()._snapshot()
        snapshot["objects"] = {n: copy.deepcopy(getattr(self, n).state_dict())
                               for n in self._objects}
        return snapshot

    def _apply(self, snapshot: dict[str, Any]) -> None:
        super()._apply(snapshot)
        for name, state_dict in snapshot["objects"].items():
            getattr(self, name).load_state_dict(copy.deepcopy(state_dict))

    def _tracked(self) -> dict[str, list[str]]:
        return {**super()._tracked(), "objects": list(self._objects)}

    def _apply_synced(self) -> None:
        for name in self._objects:
            obj = getattr(self, name)
            if isinstance(obj, torch.nn.Module):
                broadcast_parameters(obj.state_dict(), root_rank=0)
            elif isinstance(obj, torch.optim.Optimizer):
                broadcast_optimizer_state(obj, root_rank=0)
            else:
                obj.load_state_dict(broadcast_object(obj.state_dict(), 0,
                                                     name=f"dp_plugin.elastic.{name}"))
        super()._apply_synced()


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Decorate the training function ``func(state, *args, **kwargs)`` (Horovod's ``run``).

    Each call: refuse launchers it cannot serve (see the module docstring),
    ``init()`` if needed, then resume from the last commit on disk
    (``state.load()``) or, on a first start, broadcast rank 0's state
    (``state.sync()``), then run ``func``. A failure (a worker died, a
    collective timed out) propagates and ends the process; the launcher
    restarts every worker and the next attempt resumes from the commit.
    ``func`` must not begin with a collective that the resume could meet
    (as in Horovod).
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        _check_launcher(state)
        if not basics.is_initialized():
            init()
        if not state.load():
            state.sync()
        result = func(state, *args, **kwargs)
        _remove_default_commit(state)
        return result

    return wrapper


def default_commit_path(env: Mapping[str, str] | None = None) -> Path | None:
    """Where commits go without ``commit_path``: under torchrun,
    ``<temp dir>/dp_plugin-<uid>/elastic-<TORCHELASTIC_RUN_ID>.pt``; None
    elsewhere (no launcher restarts the workers, memory is enough).

    Per job: torchrun gives every job its own run id (a UUID unless
    ``--rdzv-id`` names the job) and keeps it across its restarts. Private:
    the directory is created 0700 and refused unless this user owns it and
    no one else may enter it (a commit is unpickled, with
    ``weights_only=True``, by the next attempt)."""
    env = os.environ if env is None else env
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return None
    folder = Path(tempfile.gettempdir()) / f"dp_plugin-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    info = folder.lstat()
    if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
            or stat.S_IMODE(info.st_mode) & 0o077):
        raise LaunchError(
            f"the default elastic commit directory {str(folder)!r} is not private to this user "
            f"(mode {stat.S_IMODE(info.st_mode):o}, owner uid {info.st_uid}, this user "
            f"{os.getuid()}, {'a directory' if stat.S_ISDIR(info.st_mode) else 'not a directory'}"
            "): another user could replace the commits a restart loads. Remove it, or pass "
            "TorchState(..., commit_path='some/dir/elastic.pt')"
        )
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:128]
    return folder / f"elastic-{safe}.pt"


def _remove_default_commit(state: State) -> None:
    """The job's function returned: its default commit file is not needed again."""
    path = state.commit_path
    if getattr(state, "default_path", False) and path is not None and (
            not basics.is_initialized() or basics.rank() == 0):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _check_launcher(state: State) -> None:
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        raise LaunchError(
            "horovodrun's elastic mode (--min-np/--max-np/--host-discovery-script) is not "
            "supported: Horovod gives running workers new ranks through its rendezvous server "
            "inside hvd.init(), dp_plugin reads each worker's rank once from its environment. "
            "Launch with `torchrun --max-restarts N --nproc_per_node M train.py` and "
            "TorchState(..., commit_path=...), or horovodrun without the elastic flags"
        )
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if state.commit_path is None and restarts.isdigit() and int(restarts) > 0:
        raise LaunchError(
            f"torchrun restarts failed workers (TORCHELASTIC_MAX_RESTARTS={restarts}), but "
            f"this {type(state).__name__} has no commit_path: its commits live in the memory "
            "of the processes torchrun replaces, and the restarted job would begin from "
            "scratch. Pass commit_path='some/dir/elastic.pt' (a file rank 0 can write); "
            "torchrun's workers get a default from TORCHELASTIC_RUN_ID, which is not set here"
        )


def _has_state_dict(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and \
        callable(getattr(value, "load_state_dict", None))
