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
``horovod.tensorflow.keras.elastic`` (its states, ``run`` and Keras callbacks).
The recovery is the core's (``dp_plugin.api.elastic``, docs/elastic.md); this
module adds the generator states, the commit file and the variables' broadcast.

Tracked: the model's weights and the optimizer's variables (as numpy arrays,
assigned back into the same variables), the variables of a
``TensorFlowState``, any other keyword value (epoch, batch, ...) as it is,
and each rank's ``random`` and numpy generator states. The commit file holds
plain Python values and numpy arrays and scalars of plain dtypes only (read
back without running code, see "the commit file" below), so a keyword value
must be one of those: ``commit()`` refuses anything else (a numpy dtype, an
object array) with ``CommitError`` naming it, before writing.
A failure on rank 0 (writing, reading or loading the file) raises
``CommitError`` on every rank at once: rank 0's outcome is broadcast.
TensorFlow's own global generator and Keras ``SeedGenerator`` states are not
(seed them from ``state.batch`` if a replay must be bitwise).
"""

from __future__ import annotations

import io
import math
import os
import pickle
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import keras
import numpy as np

from dp_plugin.api import elastic as _core
from dp_plugin.api.atomic_file import write_on_rank0
from dp_plugin.api.elastic import CommitError, State
from dp_plugin.api.objects import first_unloadable, from_rank0
from dp_plugin.errors import DPPluginError as HorovodInternalError
from dp_plugin.reduce.arrays import numpy_dtype
from dp_plugin.tensorflow.basics import init, rank, shutdown, size
from dp_plugin.tensorflow.broadcast import broadcast_variables
from dp_plugin.tensorflow.functions import allgather_object, broadcast_object
from dp_plugin.tensorflow.graph_ops import broadcast_object_fn

__all__ = [
    "CommitError", "CommitStateCallback", "HorovodInternalError", "KerasState", "ObjectState",
    "State", "TensorFlowKerasState", "TensorFlowState", "UpdateBatchStateCallback",
    "UpdateEpochStateCallback", "broadcast_object", "broadcast_object_fn", "init", "rank",
    "run", "shutdown",
]


class ObjectState(_core.ObjectState):
    """Plain Python values, each keyword argument an attribute (Horovod's ``ObjectState``;
    see the core's). ``commit_path`` is required under ``torchrun --max-restarts N``
    (N > 0)."""

    def _rng_state(self) -> Any:
        return {"random": random.getstate(), "numpy": np.random.get_state()}

    def _set_rng_state(self, state: Any) -> None:
        random.setstate(state["random"])
        np.random.set_state(state["numpy"])

    def _write(self, path: Path, record: dict[str, Any]) -> None:
        rng = allgather_object(self._saved_rng, name="dp_plugin.api.elastic.rng")
        write_on_rank0(path, lambda: [_dumps({**record, "rng": rng}, path)], what="commit",
                       error=CommitError, name="dp_plugin.api.elastic.committed")

    def _read(self, path: Path) -> Any:
        data = from_rank0(lambda: _read_or_none(path), CommitError, "dp_plugin.api.elastic.load",
                          lambda exc: f"rank 0 could not read the commit {str(path)!r} "
                          f"({type(exc).__name__}: {exc}); check that this user can read it "
                          "on rank 0's host, or delete it to start afresh")
        if data is None:
            return None
        record = _loads(data, path)  # the same bytes: the same outcome everywhere
        rng = record.get("rng") if isinstance(record, dict) else None
        if rng is not None and len(rng) == size():
            self._set_rng_state(rng[rank()])
        return record


class _VariablesState(ObjectState):
    """An ``ObjectState`` that also tracks the values of ``_variables()`` (as numpy
    arrays, assigned back into the same variables; ``sync`` broadcasts them)."""

    def _variables(self) -> list[Any]:
        raise NotImplementedError

    def _snapshot(self) -> dict[str, Any]:
        return {**super()._snapshot(), "variables": [np.array(v) for v in self._variables()]}

    def _apply(self, snapshot: dict[str, Any]) -> None:
        super()._apply(snapshot)
        for variable, value in zip(self._variables(), snapshot["variables"], strict=True):
            variable.assign(value)

    def _tracked(self) -> dict[str, Any]:
        layout = [(str(np.dtype(np.array(v).dtype)), tuple(v.shape)) for v in self._variables()]
        return {**super()._tracked(), "variables": layout}

    def _apply_synced(self) -> None:
        broadcast_variables(self._variables(), root_rank=0)  # nothing moves for none
        super()._apply_synced()


class TensorFlowKerasState(_VariablesState):
    """The state of a Keras training run (Horovod's ``TensorFlowKerasState``, alias
    ``KerasState``): ``model``'s weights, ``optimizer``'s variables (default: the
    model's optimizer) and every keyword value. ``backend`` is accepted for
    Horovod compatibility.
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


KerasState = TensorFlowKerasState


class TensorFlowState(_VariablesState):
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

    def _variables(self) -> list[Any]:
        return self.variables


run = _core.runner(init)
"""Horovod's ``run``: see ``dp_plugin.api.elastic.runner``."""


# -- Keras callbacks (horovod.tensorflow.keras.elastic) -------------------------


class _StateCallback(keras.callbacks.Callback):
    """A Keras callback that keeps an elastic ``state`` up to date."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state


class CommitStateCallback(_StateCallback):
    """``state.commit()`` every ``batches_per_commit`` batches and at each epoch's end."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be >= 1, got {batches_per_commit}")
        super().__init__(state)
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


class UpdateBatchStateCallback(_StateCallback):
    """Keep ``state.batch`` at the batches done in the current epoch (0 at its end)."""

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch + 1  # type: ignore[attr-defined]

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0  # type: ignore[attr-defined]


class UpdateEpochStateCallback(_StateCallback):
    """Keep ``state.epoch`` at the epochs done over every attempt (pass
    ``initial_epoch=state.epoch`` to ``fit``)."""

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = epoch + 1  # type: ignore[attr-defined]


# -- the commit file ----------------------------------------------------------------
#
# A commit is a pickle of plain Python values in which every numpy array and
# scalar is replaced by a persistent id: a tuple of plain values (its dtype's
# name, its shape, its raw bytes). The unpickler names no numpy class at all:
# pickling a dtype or an array stores flags and object pointers that numpy
# trusts when it rebuilds them, so a forged file could make numpy read raw
# bytes as pointers in every rank. Dtypes that hold Python objects, or fields
# that could hide one, are refused both ways.

_LOADABLE = frozenset({
    ("builtins", "complex"), ("builtins", "set"), ("builtins", "frozenset"),
    ("builtins", "bytearray"), ("collections", "OrderedDict"),
})
"""What a commit may name when it is unpickled: Python's plain containers and
numbers. Rebuilding these runs no code of the file's choosing."""

_PLAIN_KINDS = "biufcmMSU"
"""numpy dtype kinds stored as raw bytes: bool, integers, floats, complex,
timedelta/datetime, bytes and str. Object (O) and structured or void (V) are not."""


def _dtype_name(dtype: np.dtype) -> str | None:
    """The name a commit stores ``dtype`` under, or None when it is not a plain
    dtype (the value is then refused, as anything else ``_LOADABLE`` lacks)."""
    if dtype == numpy_dtype("bfloat16"):
        return "bfloat16"
    if dtype.kind in _PLAIN_KINDS and dtype.fields is None and dtype.subdtype is None:
        return dtype.str
    return None


def _plain_dtype(name: Any) -> np.dtype:
    """The dtype a commit names, refusing anything ``_dtype_name`` would not write."""
    dtype = numpy_dtype(name) if name == "bfloat16" else (
        np.dtype(name) if isinstance(name, str) else None)
    if dtype is None or dtype.hasobject or _dtype_name(dtype) != name:
        raise pickle.UnpicklingError(
            f"an array of dtype {name!r}: a commit holds arrays of plain dtypes only "
            "(bool, integers, floats, complex, datetimes, bytes, str, bfloat16), never "
            "objects or structured dtypes")
    return dtype


class _Pickler(pickle.Pickler):
    """``pickle.Pickler`` that stores numpy arrays and scalars of plain dtypes as
    ``("ndarray", dtype name, shape, bytes)`` / ``("scalar", dtype name, bytes)``."""

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is np.ndarray or isinstance(obj, np.generic):
            name = _dtype_name(obj.dtype)
            if name is None:
                return None  # pickled as numpy's own class: refused by the check
            if isinstance(obj, np.generic):
                return ("scalar", name, np.asarray(obj).tobytes())
            return ("ndarray", name, tuple(int(d) for d in obj.shape), obj.tobytes())
        return None


class _PlainUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that refuses any class or function outside ``_LOADABLE``
    and rebuilds ``_Pickler``'s arrays from their bytes: whoever can write
    ``commit_path`` must not be able to run code, or forge object pointers, in
    every rank (``torch.load(weights_only=True)`` is the same rule for the torch
    adapter)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _LOADABLE:
            raise pickle.UnpicklingError(
                f"{module}.{name} is not a plain value (numbers, strings, bytes, lists, "
                "tuples, dicts, sets, numpy arrays and scalars of plain dtypes)")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 3 and pid[0] == "scalar":
            _, name, data = pid
            return _from_bytes(_plain_dtype(name), (), data)[()]
        if isinstance(pid, tuple) and len(pid) == 4 and pid[0] == "ndarray":
            _, name, shape, data = pid
            return _from_bytes(_plain_dtype(name), shape, data)
        raise pickle.UnpicklingError(f"unknown persistent id {str(pid)[:80]}")


def _from_bytes(dtype: np.dtype, shape: Any, data: Any) -> np.ndarray:
    """A new writable array of ``dtype`` and ``shape`` holding ``data``, exactly."""
    if not (isinstance(shape, tuple) and all(type(d) is int and d >= 0 for d in shape)):
        raise pickle.UnpicklingError(f"an array of shape {str(shape)[:80]}: not a shape")
    if type(data) is not bytes or len(data) != math.prod(shape) * dtype.itemsize:
        raise pickle.UnpicklingError(
            f"an array of dtype {dtype} and shape {shape} with "
            f"{len(data) if type(data) is bytes else type(data).__name__} bytes of data, "
            f"not {math.prod(shape) * dtype.itemsize}")
    return np.frombuffer(data, dtype).reshape(shape).copy()


def _pickled(value: Any) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return out.getvalue()


def _loads(data: bytes, path: Path) -> Any:
    """The commit in ``data``, unpickled without running code it names."""
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise CommitError(
            f"{str(path)!r} cannot be loaded as an elastic commit ({type(exc).__name__}: "
            f"{exc}): it was not written by this version's commit(), or was changed since; "
            "delete it to start afresh, or give commit_path a file of its own") from None


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None  # a first start


def _dumps(record: dict[str, Any], path: Path) -> bytes:
    """``record`` pickled, after checking that ``_loads`` can read it back (a commit that
    was written always loads on restart); ``CommitError`` naming the first value that
    could not be, otherwise."""
    data = _pickled(record)
    try:
        _PlainUnpickler(io.BytesIO(data)).load()
        return data
    except pickle.UnpicklingError as exc:
        reason = str(exc)
    entry, _ = first_unloadable(record.get("commit", {}), _refusal, reason)
    raise CommitError(
        f"commit {str(path)!r}: {entry} could not be loaded back safely, so a restart "
        f"could not read this commit ({reason}); nothing was written. "
        "Store it as a plain Python value (float(x), int(x), x.tolist()), a string, or a "
        "numpy array of a plain dtype")


def _refusal(value: Any) -> str | None:
    """Why ``_loads`` would refuse ``value`` pickled (None: it loads)."""
    try:
        _PlainUnpickler(io.BytesIO(_pickled(value))).load()
    except Exception as exc:
        return str(exc)
    return None
