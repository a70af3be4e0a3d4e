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
them all and resumes from the commit on disk (``dp_plugin.elastic``). Here
the commit file is a checkpoint (``save_checkpoint``/``load_checkpoint``:
rank 0 writes and reads it atomically, every rank's RNG states are kept).

Tracked: every keyword value with ``state_dict``/``load_state_dict``
(models, optimizers, LR schedulers, ``ElasticSampler``, ``GradScaler``)
through those methods; any other value (epoch, batch, ...) as it is; and the
torch, numpy and ``random`` generator states of every rank.

horovodrun's elastic mode is refused with an explanation: Horovod hands new
ranks to running workers through its rendezvous server at ``hvd.init()``,
while dp_plugin reads a worker's rank once from the environment.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from dp_plugin import elastic as _core
from dp_plugin.elastic import State
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


class TorchState(ObjectState):
    """The state of a PyTorch training run (Horovod's ``TorchState``).

    ``model`` and ``optimizer`` (both optional) and every keyword argument
    become attributes. Values with ``state_dict``/``load_state_dict`` are
    tracked through them; ``sync`` broadcasts models with
    ``broadcast_parameters`` and optimizers with ``broadcast_optimizer_state``.

    ``commit_path`` (keyword only, not an attribute name Horovod scripts
    use): the file each ``commit()`` replaces atomically and ``run`` resumes
    from. Under torchrun it defaults to a per-job file private to the user
    (``default_commit_path``, removed when ``run``'s function returns), so
    that Horovod's own examples (``TorchState(model, optimizer, batch=0,
    epoch=0)``) recover a killed worker unchanged; elsewhere (no restarts)
    commits stay in memory. Multi-host: rank 0 writes and reads it, so it
    must be where the next attempt's rank 0 can read it (shared storage, or
    a fixed first node: the default is on rank 0's local disk).
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


run = _core.runner(init)
"""Horovod's ``run``: see ``dp_plugin.elastic.runner``."""


def default_commit_path(env: Mapping[str, str] | None = None) -> Path | None:
    """Where commits go without ``commit_path``: under torchrun,
    ``<temp dir>/dp_plugin-<uid>/elastic-<job id>.pt``; None elsewhere (no
    launcher restarts the workers, memory is enough).

    Per job: the job id is torchrun's run id (a UUID under ``--standalone``,
    the job's name with ``--rdzv-id``), which it keeps across its restarts.
    Without either, torchrun gives every job the run id ``none`` (its static
    rendezvous: any ``--master_port`` launch, multi-node ``--node_rank``
    launches); there the id is derived from the job's own log directory
    (``_static_job_id``), and without one restarts are refused (issue 32:
    every such job shared ``elastic-none.pt`` and a fresh job started from
    another job's commit). Private: the directory is created 0700 and refused
    unless this user owns it and no one else may enter it (a commit is
    unpickled, with ``weights_only=True``, by the next attempt)."""
    env = os.environ if env is None else env
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return None
    if run_id == "none":
        run_id = _static_job_id(env)
        if run_id is None:
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


def _static_job_id(env: Mapping[str, str]) -> str | None:
    """A job id for torchrun's static rendezvous (run id ``none``), or None when
    nothing restarts the workers and none can be derived.

    torchrun makes one log directory per job (``mkdtemp``, under ``--log-dir``
    or the temporary directory) and gives each worker
    ``TORCHELASTIC_ERROR_FILE=<that directory>/attempt_<restart>/<local rank>/error.json``:
    the directory is the same for every worker of the job's agent and for
    every restart, and never the same for two jobs. Only rank 0 writes and
    reads the commit, so ranks on other hosts (another agent, another
    directory) never use theirs."""
    error_file = Path(env.get("TORCHELASTIC_ERROR_FILE") or "error.json")
    rank_dir = error_file.parent
    if (error_file.name == "error.json" and rank_dir.name.isdigit()
            and re.fullmatch(r"attempt_\d+", rank_dir.parent.name) and error_file.is_absolute()):
        job_dir = str(rank_dir.parent.parent)
        return "none-" + hashlib.sha256(job_dir.encode()).hexdigest()[:16]
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if not (restarts.isdigit() and int(restarts) > 0):
        return None  # nothing restarts the workers: commits stay in memory
    raise LaunchError(
        "torchrun gives every job launched without --rdzv-id or --standalone (its static "
        "rendezvous: --master_port, --node_rank) the run id 'none' (TORCHELASTIC_RUN_ID=none), "
        "and this "
        "job's own torchrun log directory is unknown (TORCHELASTIC_ERROR_FILE="
        f"{env.get('TORCHELASTIC_ERROR_FILE', '')!r}, expected "
        "<log dir>/attempt_<n>/<local rank>/error.json; --log-dir /dev/null leaves it empty): "
        "a default commit file named after the run id would be shared by every such job, and "
        f"a restart (TORCHELASTIC_MAX_RESTARTS={restarts}) could resume another job's commit. "
        "Pass TorchState(..., commit_path='some/dir/elastic.pt'), a file of this job's own, "
        "or give torchrun --rdzv-id <a name unique to this job>"
    )


def _has_state_dict(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and \
        callable(getattr(value, "load_state_dict", None))
