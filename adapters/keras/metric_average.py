"""Average epoch-end metrics over all workers: Horovod's ``MetricAverageCallback`` for Keras 3.

Each worker of a data-parallel ``fit`` computes its metrics on its own shard,
so the epoch-end logs differ between ranks. This callback replaces every
value in the logs, in place, by its mean over all ranks, so that the
callbacks after it (``ReduceLROnPlateau``, ``EarlyStopping``,
``ModelCheckpoint``, ``CSVLogger``, ``TensorBoard``) and Keras's ``History``
see the same, global numbers on every rank and take the same decisions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import keras
from dp_plugin.agree import agreement
from dp_plugin.engines.base import Engine, ReduceOp
from dp_plugin.errors import MismatchError, NotInitializedError, Problem
from dp_plugin.launch import runtime
from dp_plugin.reduce.collective import fused_collective
from dp_plugin.reduce.hooks import ReducePolicy

_OP_NAME = "MetricAverageCallback"

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
    none); the names are checked first (the core's agreement exchange), and a
    difference raises ``ValueError`` on every rank, naming each rank's names.
    Then all values, in sorted-name order, go through one ``Reducer`` run
    float64 average. Scalar values come back as Python floats, arrays
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
    same names and value shapes; otherwise every rank raises ``MismatchError``
    (a ``ValueError``) for different names or shapes, its ``TypeError`` form
    (``Problem.UNSUPPORTED_DTYPE``) for a non-numeric value.
    ``when`` (e.g. ``"end of epoch 3"``) is only used in error messages.
    """
    names = sorted(logs)
    values: list[np.ndarray] = []
    bad: str | None = None
    for name in names:
        try:
            values.append(np.array(logs[name], dtype=np.float64))
        except (TypeError, ValueError):
            bad = f"{name!r}: {logs[name]!r}"
            break
    mine = {"bad": bad is not None,
            "metrics": [[n, list(v.shape)] for n, v in zip(names, values, strict=False)]}
    heard = agreement.compare(engine, _OP_NAME, mine)
    if bad is not None or not heard.same:  # same: every rank logged this bad value
        everyone = [mine] * engine.size if heard.same else heard.described
        _raise_difference(everyone, bad, f"{_OP_NAME} at the {when}" if when else _OP_NAME)
    if sum(v.size for v in values) == 0:  # no metrics anywhere: nothing to reduce
        return
    fused_collective(values, engine=engine, name=_OP_NAME, names=names,
                     policy=ReducePolicy(ReduceOp.AVERAGE, engine.size)).finish()
    for name, value in zip(names, values, strict=True):
        logs[name] = float(value) if value.ndim == 0 else value


def _raise_difference(everyone: list[Any], bad: str | None, where: str) -> None:
    bad_ranks = [r for r, d in enumerate(everyone) if d["bad"]]
    if bad_ranks:
        mine = f" (this rank logged {bad})" if bad is not None else ""
        raise MismatchError.of(
            Problem.UNSUPPORTED_DTYPE,
            f"{where}: rank(s) {bad_ranks} logged a value that is not a number or a numeric "
            f"array{mine}; every epoch-end log value must be numeric to be averaged. Remove "
            "the entry, or put the callback that adds it after MetricAverageCallback"
        )
    per_rank = "; ".join(
        f"rank {r}: [" + ", ".join(n if not shape else f"{n}{tuple(shape)}"
                                   for n, shape in d["metrics"]) + "]"
        for r, d in enumerate(everyone)
    )
    raise MismatchError(
        f"{where}: ranks logged different metrics ({per_rank}); every rank must log the same "
        "names with the same shapes: compile the same metrics everywhere, run validation on "
        "all ranks or none, and add the same extra log entries on every rank"
    )
