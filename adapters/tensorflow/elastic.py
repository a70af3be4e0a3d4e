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

import os
import pickle
import random
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from dp_plugin import elastic as _core
from dp_plugin.atomic_file import write_atomic
from dp_plugin.elastic import CommitError, State
from dp_plugin.errors import DPPluginError as HorovodInternalError
from dp_plugin.tensorflow import basics
from dp_plugin.tensorflow.basics import init, rank, shutdown
from dp_plugin.tensorflow.broadcast import broadcast_variables
from dp_plugin.tensorflow.functions import allgather_object, barrier, broadcast_object
from dp_plugin.tensorflow.graph_ops import broadcast_object_fn

__all__ = [
    "CommitError", "CommitStateCallback", "HorovodInternalError", "KerasState", "ObjectState",
    "State", "TensorFlowKerasState", "TensorFlowState", "UpdateBatchStateCallback",
    "UpdateEpochStateCallback", "broadcast_object_fn", "init", "rank", "run", "shutdown",
]


class ObjectState(_core.ObjectState):
    """Plain Python values, each keyword argument an attribute (Horovod's ``ObjectState``).

    ``commit_path``: the file each ``commit()`` replaces and ``run`` resumes from;
    required under ``torchrun --max-restarts N`` (N > 0). Multi-host: rank 0
    writes and reads it, so it must be where the next attempt's rank 0 finds it.
    """

    runtime = basics

    def _rng_state(self) -> Any:
        return {"random": random.getstate(), "numpy": np.random.get_state()}

    def _set_rng_state(self, state: Any) -> None:
        random.setstate(state["random"])
        np.random.set_state(state["numpy"])

    def _broadcast_object(self, obj: Any, name: str) -> Any:
        return broadcast_object(obj, 0, name=name)

    def _write(self, record: dict[str, Any]) -> None:
        assert self.commit_path is not None  # persist() checked
        rng = allgather_object(self._saved_rng, name="dp_plugin.elastic.rng")
        if basics.rank() == 0:
            write_atomic(self.commit_path, [pickle.dumps({**record, "rng": rng})])
        barrier()  # the commit is on disk before any rank goes on

    def _read(self) -> Any:
        assert self.commit_path is not None  # load() checked
        data = None
        if basics.rank() == 0 and self.commit_path.exists():
            data = self.commit_path.read_bytes()
        data = broadcast_object(data, 0, name="dp_plugin.elastic.load")
        if data is None:
            return None
        record = pickle.loads(data)
        rng = record.get("rng") if isinstance(record, dict) else None
        if rng is not None and len(rng) == basics.size():
            self._set_rng_state(rng[basics.rank()])
        return record


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

    def _apply_synced(self) -> None:
        broadcast_variables(self._variables(), root_rank=0)
        super()._apply_synced()


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

    def _apply_synced(self) -> None:
        if self.variables:
            broadcast_variables(self.variables, root_rank=0)
        super()._apply_synced()


run = _core.runner(basics)
"""Horovod's ``run``: see ``dp_plugin.elastic.runner``."""


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
