"""Collectives inside TF1 control flow are refused when the graph is built.

In a TF1 graph, ``tf.compat.v1.cond``/``while_loop`` either put their ops in
v1 control-flow contexts (``disable_control_flow_v2``) or in branch graphs
of an ``If``/``While`` op (the default of TensorFlow 2): neither lets
``graph_order`` order an all-reduce inside against one built after the
construct, so rank 0 could pair it with a different all-reduce of rank 1.
Before the fix each graph here built without a word. Inside a
``tf.function`` TensorFlow orders the construct as one stateful op: allowed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import dp_plugin.tensorflow as dp

REFUSED = (r"allreduce: a dp_plugin collective cannot be built inside "
           r"tf\.compat\.v1\.(cond|while_loop) of a TF1 graph")


@pytest.fixture(params=["v2", "v1"])
def control_flow(request: pytest.FixtureRequest) -> Iterator[str]:
    """TensorFlow 2's control flow in graphs (If/While ops), or TF1's contexts."""
    if request.param == "v1":
        tf.compat.v1.disable_control_flow_v2()
    try:
        yield request.param
    finally:
        tf.compat.v1.enable_control_flow_v2()


def _branch() -> Any:
    return dp.allreduce(tf.constant([1.0, 2.0]), op=dp.Sum)


def _in_cond(p: Any) -> Any:
    return tf.compat.v1.cond(p, _branch, lambda: tf.constant([0.0, 0.0]))


def _in_while(p: Any) -> Any:
    def body(i: Any, x: Any) -> tuple[Any, Any]:
        return i + 1, dp.allreduce(x, op=dp.Sum)
    return tf.compat.v1.while_loop(lambda i, x: i < 2, body, [0, tf.constant([1.0])])


def _while_in_cond(p: Any) -> Any:
    return tf.compat.v1.cond(p, lambda: _in_while(p)[1], lambda: tf.constant([0.0]))


@pytest.mark.parametrize("build", [_in_cond, _in_while, _while_in_cond],
                         ids=["cond", "while_loop", "while_loop_in_cond"])
def test_a_collective_inside_tf1_control_flow_is_refused(
        control_flow: str, build: Callable[[Any], Any]) -> None:
    with tf.Graph().as_default():
        before = dp.allreduce(tf.constant([3.0]), op=dp.Sum)
        p = tf.compat.v1.placeholder(tf.bool, [])
        with pytest.raises(ValueError, match=REFUSED) as refused:
            build(p)
    message = str(refused.value)
    assert "tf.function" in message and ("tf.where" in message or "Python loop" in message), message
    assert before is not None


def test_control_flow_inside_a_tf_function_is_allowed() -> None:
    @tf.function
    def step(p: Any) -> Any:
        return _in_cond(p) + tf.reduce_sum(_in_while(p)[1])

    np.testing.assert_allclose(step(tf.constant(True)).numpy(), [2.0, 3.0])
