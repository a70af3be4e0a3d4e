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
from dp_plugin.edge import calling
from dp_plugin.tensorflow.bridge import GradientBridge
from dp_plugin.tensorflow.collectives import reduce_indexed_slices


def reduce_gradients(bridge: GradientBridge, grads: Sequence[Any], labels: Sequence[str],
                     sparse_as_dense: bool, groups: Sequence[Sequence[int]] = ()) -> list[Any]:
    """``grads`` (no None) reduced across workers, in order; see the module docstring.
    ``groups`` (lists of indices into ``grads``) are reduced as one bucket each;
    a sparse gradient in one travels on its own."""
    ctx = tf.distribute.get_replica_context()
    replicas = 1 if ctx is None else ctx.num_replicas_in_sync
    sparse = [] if sparse_as_dense or replicas > 1 else [
        i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
    dense = [i for i in range(len(grads)) if i not in sparse]
    out = list(grads)
    position = {i: k for k, i in enumerate(dense)}
    dense_groups = [[position[i] for i in group if i in position] for group in groups]
    reduced = bridge.reduce([grads[i] for i in dense], [labels[i] for i in dense],
                            [group for group in dense_groups if group])
    for i, r in zip(dense, reduced, strict=True):
        out[i] = r
    for i in sparse:
        with calling(f"sparse gradient {labels[i]!r}"):
            out[i] = reduce_indexed_slices(grads[i], bridge.op, 1.0, 1.0, None)
    return out
