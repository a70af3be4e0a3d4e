"""The graph op behind Horovod's error types inside graphs (issue 36), in one process.

Multi-rank: tests/multiproc/workers/tf_horovod_compat.py, case graph_errors.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

import dp_plugin.tensorflow as dp
from dp_plugin.tensorflow import status_op


def test_the_op_fails_with_the_code_and_the_message_unchanged() -> None:
    message = "Mismatched allreduce tensor shapes: rank(s) 0 passed (2,)\nsecond line 'quoted'"

    @tf.function
    def fail(code: tf.Tensor) -> tf.Tensor:
        with tf.control_dependencies([status_op.fail_on(code, tf.constant(message))]):
            return tf.constant(1)

    assert int(fail(tf.constant(0))) == 1
    with pytest.raises(tf.errors.FailedPreconditionError) as caught:
        fail(tf.constant(tf.errors.FAILED_PRECONDITION))
    assert message in caught.value.message


def test_a_bad_argument_is_invalid_argument_in_a_graph_with_the_eager_message() -> None:
    with pytest.raises(tf.errors.InvalidArgumentError) as eager:
        dp.alltoall(tf.ones([3]), [1, 1])
    assert isinstance(eager.value, ValueError)
    with pytest.raises(tf.errors.InvalidArgumentError) as graph:
        tf.function(lambda: dp.alltoall(tf.ones([3]), [1, 1]))()
    assert str(eager.value) in graph.value.message


def test_without_a_compiler_it_warns_and_graphs_keep_tensorflows_types(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    status_op.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="could not build its TensorFlow status op"):
            assert status_op.library() is None
        out = tf.function(lambda: dp.allreduce(tf.ones([2]), op=dp.Sum))()
        np.testing.assert_allclose(out, [1.0, 1.0])
        with pytest.raises(tf.errors.InvalidArgumentError, match="splits"):
            tf.function(lambda: dp.alltoall(tf.ones([3]), [1, 1]))()
    finally:
        status_op.library.cache_clear()
