"""A sparse gradient (``tf.IndexedSlices``) through ``DistributedGradientTape`` in one process."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import dp_plugin.tensorflow as dp


def test_indexed_slices_gradient_is_gathered_not_densified() -> None:
    table = tf.Variable(np.arange(12, dtype=np.float32).reshape(4, 3))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(table, [1, 3, 1]))
    tape = dp.DistributedGradientTape(tape, sparse_as_dense=False)
    (grad,) = tape.gradient(loss, [table])
    assert isinstance(grad, tf.IndexedSlices)
    np.testing.assert_array_equal(tf.convert_to_tensor(grad).numpy(),
                                  [[0, 0, 0], [2, 2, 2], [0, 0, 0], [1, 1, 1]])
