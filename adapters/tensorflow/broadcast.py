"""Broadcast of variables from a root rank: model weights, optimizer state.

All variables travel as raw bytes in one buffer and one broadcast, so any
dtype works (bool, uint32 seed states, int64 counters) and the cost is one
collective plus a layout check. The layout check (names, shapes, dtypes,
order) runs first, so that ranks holding different models get
``LayoutMismatchError`` on every rank instead of corrupted weights.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

import tensorflow as tf
from dp_plugin import runtime
from dp_plugin.dtypes import SUPPORTED_DTYPES
from dp_plugin.fusion import TensorSpec
from dp_plugin.layout import check_layout


@tf.autograph.experimental.do_not_convert
def broadcast_variables(variables: Sequence[Any], root_rank: int = 0) -> Any:
    """Set every rank's ``variables`` to ``root_rank``'s values. Collective.

    Eagerly, the variables hold the root's values on return (``None`` is
    returned). Inside ``tf.function`` the broadcast and the assignments become
    ops and the returned op groups them (Horovod's custom-loop pattern,
    ``if first_batch: dp.broadcast_variables(model.variables, 0)``, works).
    Keras variables and ``tf.Variable``s (also mirrored ones) are accepted.
    """
    variables = list(variables)
    labels = [f"{i}:{getattr(v, 'name', '?')}" for i, v in enumerate(variables)]
    return broadcast_labelled(variables, labels, root_rank, what="broadcast_variables")


@tf.autograph.experimental.do_not_convert
def broadcast_labelled(
    variables: Sequence[Any], labels: Sequence[str], root_rank: int, what: str
) -> Any:
    """``broadcast_variables`` with the labels that name the variables in layout errors
    (they must be the same on every rank)."""
    engine = runtime.engine()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not (
        0 <= root_rank < engine.size
    ):
        raise ValueError(
            f"{what}: root_rank={root_rank!r} is not a rank of this job; expected an int in "
            f"0..{engine.size - 1}"
        )
    if not variables:
        return None
    specs = tuple(_spec(label, v) for label, v in zip(labels, variables, strict=True))
    exchange = functools.partial(_exchange, engine, specs, root_rank, what)
    if tf.executing_eagerly():
        values = exchange(*[np.asarray(tf.convert_to_tensor(v)) for v in variables])
        for v, value in zip(variables, values, strict=True):
            v.assign(value)
        return None
    values = tf.numpy_function(
        exchange, [tf.convert_to_tensor(v) for v in variables],
        [tf.as_dtype(v.dtype) for v in variables], stateful=True, name="dp_plugin_broadcast",
    )
    assigns = []
    for v, value in zip(variables, values, strict=True):
        value.set_shape(v.shape)
        assigns.append(v.assign(value))
    return tf.group(*assigns)


def _spec(label: str, variable: Any) -> TensorSpec:
    dtype = tf.as_dtype(variable.dtype)
    shape = tuple(int(d) for d in variable.shape)
    if dtype.name in SUPPORTED_DTYPES:
        return TensorSpec(label, shape, dtype.name)
    # Dtypes the core does not reduce (bool, uint32, ...) are compared as bytes.
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.size
    return TensorSpec(f"{label} ({dtype.name}{list(shape)})", (nbytes,), "uint8")


def _exchange(
    engine: Any, specs: tuple[TensorSpec, ...], root: int, what: str, *arrays: np.ndarray
) -> list[np.ndarray]:
    check_layout(engine, specs, what=f"variables of {what} (root rank {root})")
    sizes = [a.nbytes for a in arrays]
    buf = np.empty(sum(sizes), dtype=np.uint8)
    offset = 0
    for a, n in zip(arrays, sizes, strict=True):
        buf[offset : offset + n] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        offset += n
    engine.broadcast(buf, root, name=f"broadcast_variables.root{root}")
    out = []
    offset = 0
    for a, n in zip(arrays, sizes, strict=True):
        # Views of the fresh buffer: nothing else holds it, TensorFlow may adopt it.
        out.append(buf[offset : offset + n].view(a.dtype).reshape(a.shape))
        offset += n
    return out


def broadcast_model_state(model: Any, root_rank: int, what: str) -> None:
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
    broadcast_labelled(weights + opt_vars, labels, root_rank, what=what)
