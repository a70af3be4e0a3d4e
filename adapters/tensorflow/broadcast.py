"""Broadcast of variables from a root rank: model weights, optimizer state.

A thin caller of the core's ``Reducer`` (one run) with the broadcast hook: all
variables travel as raw bytes in fusion buffers, so any dtype works (bool,
uint32 seed states, int64 counters) and the cost is a few collectives plus
the agreement step. That step (names, shapes, dtypes, order, root rank)
runs first, so that ranks holding different models get
``LayoutMismatchError`` on every rank instead of corrupted weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

import tensorflow as tf
from dp_plugin.agree.edge import caller, calling
from dp_plugin.agree.roots import root_of
from dp_plugin.api.objects import broadcast_bytes, byte_layout
from dp_plugin.api.process_sets import engine_of
from dp_plugin.launch import runtime
from dp_plugin.reduce.fusion import TensorSpec
from dp_plugin.tensorflow.collectives import run_op


@tf.autograph.experimental.do_not_convert
def broadcast_variables(variables: Sequence[Any], root_rank: int = 0, process_set: Any = None,
                        inplace: bool = False) -> Any:
    """Set every rank's ``variables`` to ``root_rank``'s values. Collective.

    Eagerly, the variables hold the root's values on return (``None`` is
    returned). Inside ``tf.function`` the broadcast and the assignments become
    ops and the returned op groups them (Horovod's custom-loop pattern,
    ``if first_batch: dp.broadcast_variables(model.variables, 0)``, works).
    Keras variables and ``tf.Variable``s (also mirrored ones) are accepted.
    ``process_set`` limits it to a set's ranks (``root_rank`` is job-wide);
    ``inplace`` is accepted for Horovod compatibility (the values are always
    assigned into the variables).
    """
    variables = list(variables)
    labels = [f"{i}:{getattr(v, 'name', '?')}" for i, v in enumerate(variables)]
    with calling("broadcast_variables"):
        return broadcast_labelled(variables, labels, root_rank, engine=engine_of(process_set))


@tf.autograph.experimental.do_not_convert
def broadcast_labelled(
    variables: Sequence[Any], labels: Sequence[str], root_rank: int, engine: Any = None,
) -> Any:
    """``broadcast_variables`` with the labels that name the variables in layout errors
    (they must be the same on every rank); ``engine`` defaults to the running one."""
    engine = runtime.engine() if engine is None else engine
    root = root_of(engine, root_rank)
    if not variables:
        return None
    specs = tuple(_spec(label, v) for label, v in zip(labels, variables, strict=True))

    def exchange(*arrays: np.ndarray) -> list[np.ndarray]:
        # Fresh contiguous copies: TensorFlow may adopt the results, and its own
        # buffers (which ``arrays`` may view) must not be written.
        out = [np.array(a, order="C", copy=True) for a in arrays]
        wires = [o.reshape(-1).view(np.uint8) for o in out]
        # ``root_rank`` is job-wide (it names the collective), ``root`` the same
        # rank within ``engine``.
        broadcast_bytes(engine, [s.name for s in specs], wires, root, layout=specs,
                        name=f"broadcast_variables.root{root_rank}",
                        what=f"variables of {caller()} (root rank {root_rank})")
        return out

    values = run_op(exchange, [tf.convert_to_tensor(v) for v in variables],
                    [tf.as_dtype(v.dtype) for v in variables], [v.shape for v in variables],
                    "dp_plugin_broadcast")
    assigns = [v.assign(value) for v, value in zip(variables, values, strict=True)]
    return None if tf.executing_eagerly() else tf.group(*assigns)


def _spec(label: str, variable: Any) -> TensorSpec:
    dtype = tf.as_dtype(variable.dtype)
    shape = tuple(int(d) for d in variable.shape)
    return byte_layout(label, shape, dtype.name, dtype.size,
                       f"{label} ({dtype.name}{list(shape)})")


def broadcast_model_state(model: Any, root_rank: int) -> None:
    """Broadcast the model's weights and its optimizer's variables from ``root_rank``.

    The optimizer's variables are created first if needed (under the model's
    distribution strategy), so that every rank holds the same set. Seed
    generator states (``model.variables`` minus ``model.weights``) are left
    alone: each rank keeps its own dropout randomness.
    """
    optimizer = model.optimizer
    if not optimizer.built:
        with model.distribute_strategy.scope():
            optimizer.build(model.trainable_variables)
    weights = list(model.weights)
    opt_vars = list(optimizer.variables)
    labels = [f"weights[{i}] {getattr(v, 'name', '?')}" for i, v in enumerate(weights)]
    # Optimizer variable names embed the model's layer paths ('dense_3_kernel_momentum'),
    # which differ between processes that built different numbers of layers.
    labels += [f"optimizer.variables[{i}]" for i in range(len(opt_vars))]
    broadcast_labelled(weights + opt_vars, labels, root_rank)
