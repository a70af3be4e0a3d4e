"""Elastic restart without a framework: the ``State`` protocol, ``ObjectState`` and ``run``.

dp_plugin recovers by restarting processes (docs/elastic.md): torchrun
(``--max-restarts``) restarts every worker when one fails, so a commit must
outlive the process. ``commit()`` is ``save()`` (in memory) plus
``persist()`` (to ``commit_path``, atomically, from rank 0), and ``run``
starts each attempt by loading the last commit (rank 0 reads it, every rank
receives the same bytes) or, on a first start, by broadcasting rank 0's
state, as Horovod's ``run`` does.

An adapter subclasses ``ObjectState`` (``dp_plugin.torch.elastic``,
``dp_plugin.tensorflow.elastic``) and builds its ``run`` with ``runner``.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from dp_plugin.agree.check import agreed_root
from dp_plugin.api import objects
from dp_plugin.errors import DPPluginError, LaunchError
from dp_plugin.launch import runtime

MARK = "dp_plugin.api.elastic"
"""Key of the record of what a commit tracks (tells a commit from other files)."""

R = TypeVar("R")


class CommitError(DPPluginError):
    """A commit file cannot be used by this state (another script's, or not a commit)."""


class State:
    """What ``run`` needs from a state: ``sync``, ``save``, ``restore``, ``load``, ``discard``."""

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
        disk, atomically: a process killed during a commit leaves the previous
        commit loadable. A commit copies the tracked state and costs a file
        write: commit every few hundred steps, not every step."""
        self.save()
        self.persist()

    def check_host_updates(self) -> None:
        """Horovod's host-change check; a no-op (hosts change only through a restart)."""

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

    def discard(self) -> None:
        """The job is over: remove what only its restarts would read (nothing here)."""


class ObjectState(State):
    """Plain Python values, each keyword argument an attribute (Horovod's ``ObjectState``).

    ``commit_path``: the file each ``commit()`` replaces and ``run`` resumes
    from (keyword only; without one, ``default_commit_path()``). Multi-host:
    rank 0 writes and reads it, so it must be where the next attempt's rank 0
    finds it. An adapter supplies the generator states
    (``_rng_state``/``_set_rng_state``) and the commit file (``_write``/``_read``).
    """

    commit_error: type[Exception] = CommitError
    """What a commit this state cannot use raises."""

    default_path: bool = False
    """``commit_path`` is ``default_commit_path()``: ``run`` removes it when the
    job is over (``discard``), and a start removes other jobs' (``_remove_stale``)."""

    _objects: list[str] = []
    """Keyword names a subclass tracks itself (through ``state_dict``, ...)."""

    def __init__(self, *, commit_path: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.commit_path = self.default_commit_path() if commit_path is None else Path(commit_path)
        self.default_path = commit_path is None and self.commit_path is not None
        self._values = [n for n in kwargs if n not in self._objects]
        for name, value in kwargs.items():
            setattr(self, name, value)
        self.save()  # sets _saved and _saved_rng

    @staticmethod
    def default_commit_path() -> Path | None:
        """Where commits go without ``commit_path``: nowhere (they stay in memory)."""
        return None

    # -- what an adapter supplies ----------------------------------------------------

    def _rng_state(self) -> Any:
        raise NotImplementedError

    def _set_rng_state(self, state: Any) -> None:
        raise NotImplementedError

    def _write(self, path: Path, record: dict[str, Any]) -> None:
        """Write ``record`` (with every rank's generator states) to ``path``
        atomically. Collective."""
        raise NotImplementedError

    def _read(self, path: Path) -> Any:
        """The record at ``path`` (None if there is no file), this rank's
        generator states restored from it. Collective."""
        raise NotImplementedError

    def _remove_stale(self, path: Path) -> None:
        """Remove the default commits beside ``path`` that no job will resume
        (rank 0, before it reads ``path``). Nothing without a default path."""

    # -- what subclasses extend ------------------------------------------------------

    def _snapshot(self) -> dict[str, Any]:
        return {"values": {n: copy.deepcopy(getattr(self, n)) for n in self._values}}

    def _apply(self, snapshot: dict[str, Any]) -> None:
        self._set_values(snapshot["values"])

    def _set_values(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            setattr(self, name, copy.deepcopy(value))

    def _tracked(self) -> dict[str, Any]:
        return {"values": sorted(self._values)}

    def _apply_synced(self) -> None:
        engine = runtime.engine()
        values = {n: getattr(self, n) for n in self._values}
        self._set_values(objects.broadcast_object(engine, values, agreed_root(engine, 0),
                                                  "dp_plugin.api.elastic.values"))

    # -- the State protocol ----------------------------------------------------------

    def save(self) -> None:
        """Copy the tracked state (and this rank's generator states) into memory."""
        self._saved = self._snapshot()
        self._saved_rng = self._rng_state()

    def persist(self) -> None:
        """Write the last ``save()`` to ``commit_path`` (nothing without one). Collective."""
        if self.commit_path is not None:
            self._write(self.commit_path, {MARK: self._tracked(), "commit": self._saved})

    def restore(self) -> None:
        """Return to the last ``save()``/``commit()``, generator states included."""
        self._apply(self._saved)
        self._set_rng_state(self._saved_rng)

    def sync(self) -> None:
        """Make every rank's state rank 0's (a first start). Collective."""
        if runtime.is_initialized() and runtime.size() > 1:
            self._apply_synced()
        self.save()

    def load(self) -> bool:
        """Resume from the commit at ``commit_path``: True if there was one
        (state and this rank's generator states are restored), False on a
        first start or without ``commit_path``. Collective."""
        if self.commit_path is None:
            return False
        if self.default_path and _is_rank_0():
            self._remove_stale(self.commit_path)
        record = self._read(self.commit_path)
        if record is None:
            return False
        if not isinstance(record, dict) or MARK not in record:
            raise self.commit_error(
                f"{str(self.commit_path)!r} is not an elastic commit (not written by "
                f"{type(self).__name__}.commit); give commit_path a file of its own, or "
                "delete it to start afresh"
            )
        if record[MARK] != self._tracked():
            raise self.commit_error(
                f"the commit at {str(self.commit_path)!r} tracks {record[MARK]}, this state "
                f"tracks {self._tracked()}: it was written by another script or another "
                "version of it; delete the file to start afresh, or track the same names"
            )
        self._apply(record["commit"])
        self.save()  # the generator states are the restored ones now
        self.on_reset()
        return True

    def discard(self) -> None:
        """Remove the default commit file (rank 0; nothing for an explicit
        ``commit_path``, which is the user's): ``run`` calls it when the job
        is over."""
        if self.default_path and self.commit_path is not None and _is_rank_0():
            self.commit_path.unlink(missing_ok=True)


def _is_rank_0() -> bool:
    return not runtime.is_initialized() or runtime.rank() == 0


def runner(init: Callable[[], None]) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """The adapter's ``run`` (Horovod's), starting the engine with the adapter's
    ``init``: decorate the training function ``func(state, *args, **kwargs)``.

    Each call: refuse launchers it cannot serve (``check_launcher``),
    ``init()`` if needed, then resume from the last commit on disk
    (``state.load()``) or, on a first start, broadcast rank 0's state
    (``state.sync()``), then run ``func``. A failure (a worker died, a
    collective timed out) propagates and ends the process; the launcher
    restarts every worker and the next attempt resumes from the commit.
    ``func`` must not begin with a collective that the resume could meet
    (as in Horovod). A default commit file is removed when the job is over:
    when ``func`` returns, or raises on the last attempt the launcher grants
    (``last_attempt``)."""

    def run(func: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(func)
        def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
            check_launcher(state)
            if not runtime.is_initialized():
                init()
            if not state.load():
                state.sync()
            try:
                result = func(state, *args, **kwargs)
            except BaseException:
                if last_attempt():  # nothing will resume from the commit
                    state.discard()
                raise
            state.discard()
            return result

        return wrapper

    return run


def last_attempt(env: Mapping[str, str] | None = None) -> bool:
    """Whether no launcher restart follows this attempt's failure: under
    torchrun, when this agent has used its ``--max-restarts``
    (``TORCHELASTIC_RESTART_COUNT`` reached ``TORCHELASTIC_MAX_RESTARTS``);
    elsewhere always (nothing restarts the workers)."""
    env = os.environ if env is None else env
    count = env.get("TORCHELASTIC_RESTART_COUNT", "")
    most = env.get("TORCHELASTIC_MAX_RESTARTS", "")
    return not (count.isdigit() and most.isdigit()) or int(count) >= int(most)


def check_launcher(state: State) -> None:
    """Refuse horovodrun's elastic mode, and torchrun restarts that would
    find no commit to resume from."""
    example = f"{type(state).__name__}(..., commit_path='some/dir/elastic.commit')"
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        raise LaunchError(
            "horovodrun's elastic mode (--min-np/--max-np/--host-discovery-script) is not "
            "supported: Horovod gives running workers new ranks through its rendezvous server "
            "inside hvd.init(), dp_plugin reads each worker's rank once from its environment. "
            "Launch with `torchrun --max-restarts N --nproc_per_node M train.py` and "
            f"{example}, or horovodrun without the elastic flags"
        )
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if state.commit_path is None and restarts.isdigit() and int(restarts) > 0:
        raise LaunchError(
            f"torchrun restarts failed workers (TORCHELASTIC_MAX_RESTARTS={restarts}), but "
            f"this {type(state).__name__} has no commit_path: its commits live in the memory "
            "of the processes torchrun replaces, and the restarted job would begin from "
            f"scratch. Pass {example} (a file rank 0 can write)"
        )
