"""Gradients of ``DistributedGradientTape`` and ``DistributedOptimizer``, sparse ones included.

Dense gradients go through the bridge (fused all-reduce). A ``tf.IndexedSlices``
gradient (an embedding's) is reduced as Horovod does by default: its values
and indices are all-gathered, and for Average the values are divided by the
number of ranks; the optimizer then applies every rank's rows (duplicate
indices add up). ``sparse_as_dense=True`` makes it dense first and all-reduces
it with the others, which is cheaper when the slices cover much of the table.
Under a multi-replica ``MirroredStrategy`` sparse gradients are always made
dense (the bridge reduces once per worker there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf
from dp_plugin.agree.edge import calling
from dp_plugin.reduce.fusion import group_indices
from dp_plugin.tensorflow.bridge import GradientBridge
from dp_plugin.tensorflow.collectives import reduce_indexed_slices


def reduce_gradients(bridge: GradientBridge, grads: Sequence[Any],
                     variables: Sequence[Any] | None, sparse_as_dense: bool) -> list[Any]:
    """``grads`` with their non-None entries reduced across workers, in order (module
    docstring); ``variables``, when known, name them in layout errors. Horovod's
    ``bridge.groups`` are reduced as one bucket each; a sparse gradient in one travels
    on its own."""
    present = [i for i, g in enumerate(grads) if g is not None]
    if not present:
        return list(grads)  # Keras raises its own "No gradients provided" error
    ctx = tf.distribute.get_replica_context()
    replicas = 1 if ctx is None else ctx.num_replicas_in_sync
    sparse = [] if sparse_as_dense or replicas > 1 else [
        i for i in present if isinstance(grads[i], tf.IndexedSlices)]
    dense = [i for i in present if i not in sparse]
    position = {i: k for k, i in enumerate(dense)}
    groups = [[position[present[j]] for j in group if present[j] in position]
              for group in _groups(bridge.groups, present, variables)]
    out = list(grads)
    reduced = bridge.reduce([grads[i] for i in dense], [_label(i, variables) for i in dense],
                            [group for group in groups if group])
    for i, r in zip(dense, reduced, strict=True):
        out[i] = r
    for i in sparse:
        with calling(f"sparse gradient {_label(i, variables)!r}"):
            out[i] = reduce_indexed_slices(grads[i], bridge.op, 1.0, 1.0, None)
    return out


def _groups(groups: Any, present: list[int], variables: Sequence[Any] | None) -> list[list[int]]:
    """Horovod's ``groups`` as lists of indices into the present gradients: a
    count cuts them evenly, listed variables are matched to theirs."""
    if isinstance(groups, list) and variables is None:
        raise ValueError(
            "DistributedOptimizer(groups=[[...], ...]) names variables, but the gradients "
            "came without theirs; call optimizer.apply(grads, trainable_variables) (model.fit "
            "does), or pass groups as a number"
        )
    members = present if variables is None else [variables[i] for i in present]
    return group_indices(groups, members)


def _label(i: int, variables: Sequence[Any] | None) -> str:
    # The variables' short names ('kernel', 'bias') are the same on every rank;
    # their paths ('dense_3/kernel') depend on how many layers a process made.
    if variables is None or i >= len(variables):
        return f"{i}"
    return f"{i}:{getattr(variables[i], 'name', '?')}"
