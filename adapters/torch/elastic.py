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

The shape is Horovod 0.28.1's ``horovod.torch.elastic``; the recovery is not:
Horovod rolls the surviving processes back in memory, dp_plugin restarts
them all and resumes from the commit on disk (``dp_plugin.api.elastic``). Here
the commit file is a checkpoint (``save_checkpoint``/``load_checkpoint``:
rank 0 writes and reads it atomically, every rank's RNG states are kept).

horovodrun's elastic mode is refused with an explanation: Horovod hands new
ranks to running workers through its rendezvous server at ``hvd.init()``,
while dp_plugin reads a worker's rank once from the environment.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import os
import re
import stat
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from dp_plugin.api import elastic as _core
from dp_plugin.api.elastic import State
from dp_plugin.errors import LaunchError
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


class ObjectState(_core.ObjectState):
    """Plain Python values, each keyword argument an attribute (Horovod's ``ObjectState``).

    ``commit_path``: where commits go (see ``TorchState``); reserved, not tracked.
    """

    commit_error = CheckpointError

    @staticmethod
    def default_commit_path() -> Path | None:
        return default_commit_path()

    _rng_state = staticmethod(rng_state)
    _set_rng_state = staticmethod(set_rng_state)

    def _write(self, path: Path, record: dict[str, Any]) -> None:
        save_checkpoint(path, **record)  # every rank's RNG states with it

    def _read(self, path: Path) -> Any:
        return load_checkpoint(path, missing_ok=True)  # restores the RNG states

    def _remove_stale(self, path: Path) -> None:
        remove_stale_commits(path)


class TorchState(ObjectState):
    """The state of a PyTorch training run (Horovod's ``TorchState``).

    ``model`` and ``optimizer`` (both optional) and every keyword argument
    become attributes. Values with ``state_dict``/``load_state_dict`` (models,
    optimizers, LR schedulers, ``ElasticSampler``, ``GradScaler``) are tracked
    through them, any other (epoch, batch, ...) as it is, with the torch,
    numpy and ``random`` generator states of every rank; ``sync`` broadcasts
    models with ``broadcast_parameters`` and optimizers with
    ``broadcast_optimizer_state``.

    ``commit_path`` (keyword only, not an attribute name Horovod scripts
    use): the file each ``commit()`` replaces atomically and ``run`` resumes
    from. Under torchrun it defaults to a per-job file private to the user
    (``default_commit_path``: only a restart of the same job resumes it,
    removed when the job is over), so that Horovod's own examples
    (``TorchState(model, optimizer, batch=0, epoch=0)``) recover a killed
    worker unchanged; elsewhere (no restarts) commits stay in memory.
    Multi-host: rank 0 writes and reads it, so it must be where the next
    attempt's rank 0 can read it (shared storage, or a fixed first node: the
    default is on rank 0's local disk).
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, *,
                 commit_path: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        self._objects = sorted(n for n, v in kwargs.items()
                               if callable(getattr(v, "state_dict", None))
                               and callable(getattr(v, "load_state_dict", None)))
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
                                                     name=f"dp_plugin.api.elastic.{name}"))
        super()._apply_synced()


run = _core.runner(init)
"""Horovod's ``run``: see ``dp_plugin.api.elastic.runner``."""


STALE_AFTER_S = 7 * 24 * 3600
"""A default commit not written for a week is removed by the next start of
any job of this user on the host: its job ended without removing it (its
rank 0 was killed on the last attempt), since a live job commits far more
often than that."""

log = logging.getLogger("dp_plugin")


def default_commit_path(env: Mapping[str, str] | None = None) -> Path | None:
    """Where commits go without ``commit_path``: under torchrun,
    ``<temp dir>/dp_plugin-<uid>/elastic-<run id>-<job>.pt``; None elsewhere
    (no launcher restarts the workers, memory is enough).

    Per job, not per run id: torchrun keeps its run id (a UUID under
    ``--standalone``, the name given with ``--rdzv-id``, ``none`` for the
    static rendezvous) across a job's restarts, but a job script that fixes
    ``--rdzv-id`` gives every job the same one, and a new job would resume
    the commit of the last one that failed. ``<job>`` names the launch
    itself: torchrun makes one log directory per launch (``_launch_id``),
    kept across that launch's restarts. So only a restart of the same job
    resumes (also after a restart for a membership change, which keeps
    ``TORCHELASTIC_RESTART_COUNT`` at 0), and a new job's first attempt never
    finds an earlier job's commit. When torchrun's log directory is unknown
    (``--log-dir /dev/null``), restarts are refused (``LaunchError``) and,
    without restarts, commits stay in memory.

    Private: the directory is created 0700 and refused unless this user owns
    it and no one else may enter it (a commit is unpickled, with
    ``weights_only=True``, by the next attempt). When files are removed:
    ``ObjectState.discard`` and ``remove_stale_commits``."""
    env = os.environ if env is None else env
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return None
    launch = _launch_id(env)
    if launch is None:
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
    safe_id = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:128]  # a file name
    return folder / f"elastic-{safe_id}-{launch}.pt"


def remove_stale_commits(path: Path, now: float | None = None) -> list[Path]:
    """Remove the default commits beside ``path`` (a default commit path)
    that no job will resume, saying so in a warning; return them.

    Those are: another launch's commit with the same run id (an earlier job
    with the same ``--rdzv-id`` on this host; only its own restarts could
    have resumed it, and its launch is over, or two jobs run at once with one
    ``--rdzv-id``, which the default path does not support), and any default
    commit not written for ``STALE_AFTER_S``. ``run`` calls this on rank 0 at
    every start, before it looks for the job's own commit. The job's own
    commit is removed by ``ObjectState.discard`` when the job is over."""
    now = time.time() if now is None else now
    same_run = re.compile(re.escape(path.name.rsplit("-", 1)[0]) + r"-[0-9a-f]{16}\.pt")
    removed = []
    for other in sorted(path.parent.glob("elastic-*.pt")):
        if other == path:
            continue
        try:
            age = now - other.stat().st_mtime
        except FileNotFoundError:
            continue
        if same_run.fullmatch(other.name):
            why = "an earlier torchrun job with the same run id left it; a new job never resumes it"
        elif age > STALE_AFTER_S:
            why = f"not written for {age / 86400:.0f} days: its job is over"
        else:
            continue
        with contextlib.suppress(FileNotFoundError):
            other.unlink()
            removed.append(other)
            log.warning("dp_plugin: removed the default elastic commit %s (%s)", other, why)
    return removed


def _launch_id(env: Mapping[str, str]) -> str | None:
    """A name for this torchrun launch, the same for all its local ranks and
    restarts and never the same for two launches; None when nothing
    restarts the workers and none can be derived.

    torchrun makes one log directory per launch (``mkdtemp``, under
    ``--log-dir`` or the temporary directory) and gives each worker
    ``TORCHELASTIC_ERROR_FILE=<that directory>/attempt_<restart>/<local rank>/error.json``.
    Only rank 0 writes and reads the commit, so ranks on other hosts
    (another agent, another directory) never use theirs."""
    error_file = Path(env.get("TORCHELASTIC_ERROR_FILE") or "error.json")
    rank_dir = error_file.parent
    if (error_file.name == "error.json" and rank_dir.name.isdigit()
            and re.fullmatch(r"attempt_\d+", rank_dir.parent.name) and error_file.is_absolute()):
        job_dir = str(rank_dir.parent.parent)
        return hashlib.sha256(job_dir.encode()).hexdigest()[:16]
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if not (restarts.isdigit() and int(restarts) > 0):
        return None  # nothing restarts the workers: commits stay in memory
    raise LaunchError(
        "this torchrun job's log directory is unknown (TORCHELASTIC_ERROR_FILE="
        f"{env.get('TORCHELASTIC_ERROR_FILE', '')!r}, expected "
        "<log dir>/attempt_<n>/<local rank>/error.json; --log-dir /dev/null leaves it empty), "
        "and the default elastic commit file is named after it: the run id alone "
        f"(TORCHELASTIC_RUN_ID={env.get('TORCHELASTIC_RUN_ID', '')!r}) is shared by every "
        "job given the same --rdzv-id, or by every job of the static rendezvous ('none'), "
        f"and a restart (TORCHELASTIC_MAX_RESTARTS={restarts}) could resume another job's "
        "commit. Pass TorchState(..., commit_path='some/dir/elastic.pt'), a file of this "
        "job's own, or give torchrun a --log-dir"
    )
