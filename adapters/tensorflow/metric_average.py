"""Average epoch-end metrics over all workers: Horovod's ``MetricAverageCallback`` for Keras 3.

Each worker of a data-parallel ``fit`` computes its metrics on its own shard,
so the epoch-end logs differ between ranks. This callback replaces every
value in the logs, in place, by its mean over all ranks, so that the
callbacks after it (``ReduceLROnPlateau``, ``EarlyStopping``,
``ModelCheckpoint``, ``CSVLogger``, ``TensorBoard``) and Keras's ``History``
see the same, global numbers on every rank and take the same decisions.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import keras
import numpy as np

from dp_plugin import runtime
from dp_plugin.arrays import as_numpy
from dp_plugin.engines.base import Engine
from dp_plugin.errors import NotInitializedError

_OP_NAME = "MetricAverageCallback"

# One int64 row per rank: a non-numeric value was logged (0/1), digest of the
# metric names and shapes, number of float64 values, length of the names
# (JSON, bytes). Gathered before any data moves, so that every rank sees the
# same table and raises the same error instead of entering mismatched
# all-reduces.
_BAD, _DIGEST, _COUNT, _NAMES_LEN = range(4)


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch-end metrics over all workers, in the logs, on every rank.

    Place it **before** every callback that reads epoch logs
    (``ReduceLROnPlateau``, ``EarlyStopping``, ``ModelCheckpoint``,
    ``CSVLogger``, ``TensorBoard``, ...): Keras calls callbacks in list order
    and they see the logs as they are when their turn comes. ``History``
    (``fit``'s return value) is appended after user callbacks and records the
    averaged values::

        callbacks = [dp.DistributedCallback(), dp.MetricAverageCallback(),
                     keras.callbacks.ReduceLROnPlateau(patience=3)]

    Distributed contract: ``on_epoch_end`` is collective. Every rank must run
    the same number of epochs and log the same metric names with the same
    shapes (the same ``compile(metrics=...)``, and validation on all ranks or
    none); the names are checked first (one small all-gather), and a
    difference raises ``ValueError`` on every rank, naming each rank's names.
    Then all values, in sorted-name order, go through one fused float64
    all-reduce (average). Scalar values come back as Python floats, arrays
    (e.g. per-class metrics) as float64 arrays of their shape. A rank that
    never reaches the end of the epoch makes the others fail with
    ``CollectiveTimeoutError`` after ``DP_PLUGIN_TIMEOUT`` seconds.

    Args:
        device: accepted for compatibility with Horovod; unused (metrics are
            a few numbers, reduced as host buffers by the engine).
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not runtime.is_initialized():
            raise NotInitializedError(_OP_NAME)
        # Even without logs this rank takes part: the others are waiting for it.
        average_logs({} if logs is None else logs, runtime.engine(), f"end of epoch {epoch}")


def average_logs(logs: dict[str, Any], engine: Engine, when: str = "") -> None:
    """Replace every value of ``logs`` by its mean over the ranks of ``engine``.

    Collective: every rank calls it at the same point with logs holding the
    same names and value shapes; otherwise every rank raises (``ValueError``
    for different names or shapes, ``TypeError`` for a non-numeric value).
    ``when`` (e.g. ``"end of epoch 3"``) is only used in error messages.
    """
    names = sorted(logs)
    values: list[np.ndarray] = []
    bad: str | None = None
    for name in names:
        try:
            values.append(np.asarray(logs[name], dtype=np.float64))
        except (TypeError, ValueError):
            bad = f"{name!r}: {logs[name]!r}"
            break
    described = [[n, list(v.shape)] for n, v in zip(names, values, strict=False)]
    names_json = json.dumps(described if bad is None else names).encode()
    count = sum(int(v.size) for v in values)
    row = np.array(
        [bad is not None, _digest(names_json), count, len(names_json)], dtype=np.int64
    )
    table = np.asarray(as_numpy(engine.allgather(row[None, :], name=f"{_OP_NAME} (names)")))
    where = f"{_OP_NAME} at the {when}" if when else _OP_NAME

    bad_ranks = np.flatnonzero(table[:, _BAD]).tolist()
    if bad_ranks:
        mine = f" (this rank logged {bad})" if bad is not None else ""
        raise TypeError(
            f"{where}: rank(s) {bad_ranks} logged a value that is not a number or a numeric "
            f"array{mine}; every epoch-end log value must be numeric to be averaged. Remove "
            "the entry, or put the callback that adds it after MetricAverageCallback"
        )
    if (table[:, _DIGEST] != table[0, _DIGEST]).any() or (table[:, _COUNT] != count).any():
        raise ValueError(
            f"{where}: ranks logged different metrics ("
            + _describe_per_rank(engine, names_json, table)
            + "); every rank must log the same names with the same shapes: compile the "
            "same metrics everywhere, run validation on all ranks or none, and add the "
            "same extra log entries on every rank"
        )
    if count == 0:  # no metrics anywhere: nothing to reduce
        return
    flat = np.concatenate([v.reshape(-1) for v in values])
    engine.allreduce_async(flat, "average", name=_OP_NAME).wait()
    offset = 0
    for name, value in zip(names, values, strict=True):
        part = flat[offset:offset + value.size]
        offset += value.size
        logs[name] = float(part[0]) if value.ndim == 0 else part.reshape(value.shape).copy()


def _digest(data: bytes) -> int:
    """A signed 64-bit hash: equal names and shapes give equal digests on every rank."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _describe_per_rank(engine: Engine, names_json: bytes, table: np.ndarray) -> str:
    """Gather every rank's metric names (collective: all ranks get here together)."""
    mine = np.frombuffer(names_json, dtype=np.uint8).copy()
    gathered = np.asarray(as_numpy(engine.allgather(mine, name=f"{_OP_NAME} (name list)")))
    parts = []
    start = 0
    for r, length in enumerate(table[:, _NAMES_LEN].tolist()):
        listed = json.loads(gathered[start:start + length].tobytes().decode())
        start += length
        shown = ", ".join(
            n if not shape else f"{n}{tuple(shape)}" for n, shape in listed
        )
        parts.append(f"rank {r}: [{shown}]")
    return "; ".join(parts)
