"""Elastic restart for TensorFlow / Keras: ``hvd.elastic`` on torchrun restarts.

    import dp_plugin.tensorflow as hvd          # or dp_plugin.keras

    state = hvd.elastic.KerasState(model, optimizer, batch=0, epoch=0,
                                   commit_path="ckpt/elastic.pkl")

    @hvd.elastic.run
    def train(state):
        while state.batch < steps:
            ...the training step of batch number state.batch...
            state.batch += 1
            if state.batch % 100 == 0:
                state.commit()

    train(state)          # under `torchrun --max-restarts 3 --nproc_per_node N train.py`

The shape is Horovod 0.28.1's ``horovod.tensorflow.elastic`` /
``horovod.tensorflow.keras.elastic`` (``TensorFlowKerasState``, alias
``KerasState``; ``TensorFlowState`` for a list of variables; ``ObjectState``;
``run``; the Keras callbacks ``CommitStateCallback``,
``UpdateBatchStateCallback``, ``UpdateEpochStateCallback``). The recovery is
``dp_plugin.torch.elastic``'s (docs/elastic.md): torchrun restarts every worker
when one fails, ``commit()`` also writes the committed state to
``commit_path`` (rank 0 writes a temporary file, fsyncs it, renames it; every
rank's ``random`` and numpy generator states are gathered into it), and
``run`` starts each attempt by loading the last commit (rank 0 reads it, every
rank receives the same bytes) or, on a first start, by broadcasting rank 0's
state.

Tracked: the model's weights and the optimizer's variables (as numpy arrays,
assigned back into the same variables), the variables of a
``TensorFlowState``, any other keyword value (epoch, batch, ...) as it is
(it must pickle), and each rank's ``random`` and numpy generator states.
TensorFlow's own global generator and Keras ``SeedGenerator`` states are not
(seed them from ``state.batch`` if a replay must be bitwise).
"""

from __future__ import annotations

import copy
import functools
import os
import pickle
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import keras
import numpy as np

from dp_plugin.atomic_file import write_atomic
from dp_plugin.errors import DPPluginError, LaunchError
from dp_plugin.errors import DPPluginError as HorovodInternalError
from dp_plugin.tensorflow import basics
from dp_plugin.tensorflow.basics import init, rank, shutdown
from dp_plugin.tensorflow.broadcast import broadcast_variables
from dp_plugin.tensorflow.functions import allgather_object, barrier, broadcast_object
from dp_plugin.tensorflow.graph_ops import broadcast_object_fn

__all__ = [
    "CommitStateCallback", "HorovodInternalError", "KerasState", "ObjectState", "State",
    "TensorFlowKerasState", "TensorFlowState", "UpdateBatchStateCallback",
    "UpdateEpochStateCallback", "broadcast_object_fn", "init", "rank", "run", "shutdown",
]

_MARK = "dp_plugin.tensorflow.elastic"
"""Key of the record of what a commit file tracks (tells it from other pickles)."""

R = TypeVar("R")


class CommitError(DPPluginError):
    """A commit file cannot be used by this state (another script's, or not a commit)."""


class State:
    """What ``run`` needs from a state: ``sync``, ``save``, ``restore``, ``load``.

    ``commit()`` = ``save()`` (in memory) + ``persist()`` (to ``commit_path``).
    """

    commit_path: Path | None = None

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], Any]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], Any]]) -> None:
        """Functions to call after a reset (Horovod's API); they run when ``run``
        resumes from a commit (dp_plugin resets by restarting processes)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Keep the current state as the point to resume from. Collective.

        In memory (``restore()`` returns to it) and, with ``commit_path``, on disk,
        atomically: a process killed during a commit leaves the previous one
        loadable. Commit every few hundred steps, not every step."""
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


class ObjectState(State):
    """Plain Python values, each keyword argument an attribute (Horovod's ``ObjectState``).

    ``commit_path``: the file each ``commit()`` replaces and ``run`` resumes from;
    required under ``torchrun --max-restarts N`` (N > 0). Multi-host: rank 0
    writes and reads it, so it must be where the next attempt's rank 0 finds it.
    """

    def __init__(self, *, commit_path: str | os.PathLike[str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__()
        self.commit_path = None if commit_path is None else Path(commit_path)
        self._values = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved: dict[str, Any] = {}
        self._saved_rng: Any = None
        self.save()

    # -- what subclasses extend ------------------------------------------------

    def _snapshot(self) -> dict[str, Any]:
        return {"values": {n: copy.deepcopy(getattr(self, n)) for n in self._values}}

    def _apply(self, snapshot: dict[str, Any]) -> None:
        for name, value in snapshot["values"].items():
            setattr(self, name, copy.deepcopy(value))

    def _tracked(self) -> dict[str, Any]:
        return {"values": sorted(self._values)}

    def _sync_tracked(self) -> None:
        values = {n: getattr(self, n) for n in self._values}
        for name, value in broadcast_object(values, 0, name="dp_plugin.elastic.values").items():
            setattr(self, name, value)

    # -- the State protocol ------------------------------------------------------

    def save(self) -> None:
        """Copy the tracked state (and this rank's generator states) into memory."""
        self._saved = self._snapshot()
        self._saved_rng = _rng_state()

    def persist(self) -> None:
        """Write the last ``save()`` to ``commit_path`` (nothing without one). Collective."""
        if self.commit_path is None:
            return
        rng = allgather_object(self._saved_rng, name="dp_plugin.elastic.rng")
        if basics.rank() == 0:
            write_atomic(self.commit_path, [pickle.dumps(
                {_MARK: self._tracked(), "commit": self._saved, "rng": rng})])
        barrier()  # the commit is on disk before any rank goes on

    def restore(self) -> None:
        """Return to the last ``save()``/``commit()``, generator states included."""
        self._apply(self._saved)
        _set_rng_state(self._saved_rng)

    def sync(self) -> None:
        """Make every rank's state rank 0's (a first start). Collective."""
        if basics.is_initialized() and basics.size() > 1:
            self._sync_tracked()
        self.save()

    def load(self) -> bool:
        """Resume from the commit at ``commit_path``: True if there was one, False on
        a first start or without ``commit_path``. Collective."""
        if self.commit_path is None:
            return False
        data = None
        if basics.rank() == 0 and self.commit_path.exists():
            data = self.commit_path.read_bytes()
        data = broadcast_object(data, 0, name="dp_plugin.elastic.load")
        if data is None:
            return False
        record = pickle.loads(data)
        if not isinstance(record, dict) or _MARK not in record:
            raise CommitError(
                f"{str(self.commit_path)!r} is not a dp_plugin.tensorflow elastic commit; "
                "give commit_path a file of its own (or delete it to start afresh)")
        if record[_MARK] != self._tracked():
            raise CommitError(
                f"the commit at {str(self.commit_path)!r} tracks {record[_MARK]}, this state "
                f"tracks {self._tracked()}: it was written by another script or another "
                "version of it; delete the file to start afresh, or track the same things")
        self._apply(record["commit"])
        rng = record["rng"]
        if len(rng) == basics.size():
            _set_rng_state(rng[basics.rank()])
        self.save()
        self.on_reset()
        return True


class TensorFlowKerasState(ObjectState):
    """The state of a Keras training run (Horovod's ``TensorFlowKerasState``, alias
    ``KerasState``): ``model``'s weights, ``optimizer``'s variables (default: the
    model's optimizer) and every keyword value. ``backend`` is accepted for
    Horovod compatibility. ``sync`` broadcasts the variables from rank 0.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, *,
                 commit_path: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__(commit_path=commit_path, **kwargs)

    def _variables(self) -> list[Any]:
        variables = list(self.model.weights)
        if self.optimizer is not None:
            if not self.optimizer.built:
                self.optimizer.build(self.model.trainable_variables)
            variables += list(self.optimizer.variables)
        return variables

    def _snapshot(self) -> dict[str, Any]:
        return {**super()._snapshot(), "variables": [np.array(v) for v in self._variables()]}

    def _apply(self, snapshot: dict[str, Any]) -> None:
        super()._apply(snapshot)
        _assign(self._variables(), snapshot["variables"])

    def _tracked(self) -> dict[str, Any]:
        return {**super()._tracked(), "variables": _layout(self._variables())}

    def _sync_tracked(self) -> None:
        broadcast_variables(self._variables(), root_rank=0)
        super()._sync_tracked()


KerasState = TensorFlowKerasState


class TensorFlowState(ObjectState):
    """Horovod's ``TensorFlowState``: a list of ``tf.Variable``s (default: none; TF2
    has no global-variable collection) and keyword values. ``session`` (TF1) is
    refused: TensorFlow 2 programs hold their state in variables."""

    def __init__(self, variables: Sequence[Any] | None = None, session: Any = None, *,
                 commit_path: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        if session is not None:
            raise ValueError(
                "TensorFlowState(session=...): TF1 sessions are not supported by "
                "dp_plugin.tensorflow.elastic; pass the variables of a TensorFlow 2 program")
        self.variables = list(variables or [])
        super().__init__(commit_path=commit_path, **kwargs)

    def _snapshot(self) -> dict[str, Any]:
        return {**super()._snapshot(), "variables": [np.array(v) for v in self.variables]}

    def _apply(self, snapshot: dict[str, Any]) -> None:
        super()._apply(snapshot)
        _assign(self.variables, snapshot["variables"])

    def _tracked(self) -> dict[str, Any]:
        return {**super()._tracked(), "variables": _layout(self.variables)}

    def _sync_tracked(self) -> None:
        if self.variables:
            broadcast_variables(self.variables, root_rank=0)
        super()._sync_tracked()


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Decorate the training function ``func(state, *args, **kwargs)`` (Horovod's ``run``).

    Each call: refuse launchers it cannot serve, ``init()`` if needed, then
    resume from the last commit on disk (``state.load()``) or, on a first
    start, broadcast rank 0's state (``state.sync()``), then run ``func``. A
    failure (a worker died, a collective timed out) propagates and ends the
    process; torchrun restarts every worker and the next attempt resumes.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        _check_launcher(state)
        if not basics.is_initialized():
            basics.init()
        if not state.load():
            state.sync()
        return func(state, *args, **kwargs)

    return wrapper


# -- Keras callbacks (horovod.tensorflow.keras.elastic) -------------------------


class CommitStateCallback(keras.callbacks.Callback):
    """``state.commit()`` every ``batches_per_commit`` batches and at each epoch's end."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be >= 1, got {batches_per_commit}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._left = batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self._left = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._left -= 1
        if self._left == 0:
            self.state.commit()
            self._left = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the batches done in the current epoch (0 at its end)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch + 1  # type: ignore[attr-defined]

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0  # type: ignore[attr-defined]


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the epochs done over every attempt (pass
    ``initial_epoch=state.epoch`` to ``fit``)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = epoch + 1  # type: ignore[attr-defined]


# -- helpers -------------------------------------------------------------------------


def _assign(variables: Sequence[Any], values: Sequence[Any]) -> None:
    for variable, value in zip(variables, values, strict=True):
        variable.assign(value)


def _layout(variables: Sequence[Any]) -> list[tuple[str, tuple[int, ...]]]:
    return [(str(np.dtype(np.array(v).dtype)), tuple(v.shape)) for v in variables]


def _rng_state() -> dict[str, Any]:
    return {"random": random.getstate(), "numpy": np.random.get_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])


def _check_launcher(state: State) -> None:
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        raise LaunchError(
            "horovodrun's elastic mode (--min-np/--max-np/--host-discovery-script) is not "
            "supported: Horovod gives running workers new ranks through its rendezvous server "
            "inside hvd.init(), dp_plugin reads each worker's rank once from its environment. "
            "Launch with `torchrun --max-restarts N --nproc_per_node M train.py` and "
            "KerasState(..., commit_path=...), or horovodrun without the elastic flags")
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if state.commit_path is None and restarts.isdigit() and int(restarts) > 0:
        raise LaunchError(
            f"torchrun restarts failed workers (TORCHELASTIC_MAX_RESTARTS={restarts}), but "
            f"this {type(state).__name__} has no commit_path: its commits live in the memory "
            "of the processes torchrun replaces, and the restarted job would begin from "
            "scratch. Pass commit_path='some/dir/elastic.pkl' (a file rank 0 can write)")
