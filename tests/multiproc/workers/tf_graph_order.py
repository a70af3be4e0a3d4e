"""Worker: several independent collectives in one graph, run many times on 2 ranks.

``python tf_graph_order.py --case NAME`` (one case per launch; ``--list-cases``):

- ``session``: a TF1 graph (``tf.compat.v1.Session``) holding nine collectives
  that do not depend on each other (all-reduces, a fused grouped all-reduce,
  grouped all-gather, uneven all-gather, broadcast, all-to-all with uneven
  splits, uneven and fused reduce-scatter), fetched together by one
  ``Session.run`` many times. TensorFlow's executor runs them in any order
  and concurrently; before ``graph_order`` the ranks paired the wrong tensors,
  hung or aborted. Every value is checked against its closed form.
- ``function``: the same collectives inside one ``tf.function``, called many
  times, together with a ``DistributedGradientTape`` step.
- ``global_variables``: Horovod's TF1 pattern: a training step whose
  all-reduce reads a placeholder, then ``broadcast_global_variables(0)``
  built after it (as ``BroadcastGlobalVariablesHook`` does) and run alone,
  without feeding the placeholder; then steps, whose weights stay equal;
  and ``BroadcastGlobalVariablesHook`` in a ``MonitoredSession``.

Every rank prints ``rank R OK``; any failure exits 1 at once.
"""

from __future__ import annotations

import os
from typing import Any

from _fail_fast import run_cases

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import dp_plugin.tensorflow as dp

ROUNDS = 30


def collectives(rank: int) -> tuple[list[Any], list[Any]]:
    """Nine independent collectives of this rank's inputs, and what each must return
    (2 ranks)."""
    r = float(rank)
    a = tf.constant(np.arange(6, dtype=np.float32) + r)
    b = tf.constant(np.full((3, 2), r + 1.0, np.float64))
    c = tf.constant(np.arange(2 + rank, dtype=np.float32).reshape(-1, 1) + 10 * r)
    d = tf.constant(np.arange(5, dtype=np.int32) * (rank + 1))
    e = tf.constant(np.arange(8, dtype=np.float32).reshape(4, 2) + r)
    f = tf.constant(np.arange(5, dtype=np.float32) + r)  # 5 rows: 3 and 2
    built = [
        dp.allreduce(a, op=dp.Sum, name="a"),
        dp.grouped_allreduce([b, a * 2.0], op=dp.Average, name="ab"),
        dp.allgather(c, name="c"),
        dp.grouped_allgather([c * 2.0, tf.reshape(d, [-1, 1])], name="cd"),
        dp.broadcast(d, root_rank=1, name="d"),
        dp.alltoall(e, splits=[1 + rank, 3 - rank], name="e"),
        dp.reducescatter(f, op=dp.Sum, name="f"),
        dp.grouped_reducescatter([e, f], op=dp.Sum, name="ef"),
        dp.allreduce(d, op=dp.Max, name="dmax"),
    ]
    ar = np.arange(6, dtype=np.float32)
    c0, c1 = np.arange(2, dtype=np.float32).reshape(-1, 1), np.arange(3, dtype=np.float32)
    gathered = np.concatenate([c0, c1.reshape(-1, 1) + 10])
    d_all = [np.arange(5, dtype=np.int32), np.arange(5, dtype=np.int32) * 2]
    e_all = [np.arange(8, dtype=np.float32).reshape(4, 2) + k for k in (0, 1)]
    # rank k sends its first 1 + k rows to rank 0 and the rest to rank 1
    e_got = np.concatenate([e_all[0][:1], e_all[1][:2]] if rank == 0
                           else [e_all[0][1:], e_all[1][2:]])
    f_sum = 2 * np.arange(5, dtype=np.float32) + 1
    rows = slice(0, 3) if rank == 0 else slice(3, 5)
    e_rows = slice(0, 2) if rank == 0 else slice(2, 4)
    expected = [
        2 * ar + 1,
        [np.full((3, 2), 1.5), 2 * ar + 1],
        gathered,
        [gathered * 2, np.concatenate(d_all).reshape(-1, 1)],
        d_all[1],
        (e_got, np.array([1, 2] if rank == 0 else [3, 2], np.int32)),
        f_sum[rows],
        [(e_all[0] + e_all[1])[e_rows], f_sum[rows]],
        d_all[1],
    ]
    return built, expected


def check(got: Any, want: Any, what: str) -> None:
    if isinstance(want, list | tuple):
        assert len(got) == len(want), f"{what}: {len(got)} outputs, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            check(g, w, f"{what}[{i}]")
        return
    got = np.asarray(got)
    assert got.shape == np.shape(want), f"{what}: shape {got.shape} != {np.shape(want)}"
    np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=what)


def check_session(_: Any) -> None:
    graph = tf.Graph()
    with graph.as_default():
        built, expected = collectives(dp.rank())
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=8)
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        for i in range(ROUNDS):
            check(sess.run(built), expected, f"session run {i}")


def check_function(_: Any) -> None:
    w = tf.Variable(np.ones((3, 2), np.float32))

    @tf.function
    def step(x: Any) -> Any:
        built, _ = collectives(dp.rank())
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(x, w))
        tape = dp.DistributedGradientTape(tape)
        (grad,) = tape.gradient(loss, [w])
        return built, grad

    _, expected = collectives(dp.rank())
    x = tf.constant(np.full((1, 3), dp.rank() + 1.0, np.float32))  # d loss / d w = x^T 1
    for i in range(ROUNDS):
        built, grad = step(x)
        check(built, expected, f"tf.function call {i}")
        check(grad, np.full((3, 2), 1.5), f"tape gradient {i}")


def check_global_variables(_: Any) -> None:
    rank = dp.rank()
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.get_variable(
            "w", initializer=tf.constant(np.full((4,), 10.0 * (rank + 1), np.float32)))
        step_count = tf.compat.v1.get_variable("steps", initializer=tf.constant(rank, tf.int64))
        x = tf.compat.v1.placeholder(tf.float32, [4])
        grad = dp.allreduce(x * w, op=dp.Average)
        train = tf.group(w.assign_sub(0.1 * grad), step_count.assign_add(1))
        bcast = dp.broadcast_global_variables(0)  # built after the step, as the hook does
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)
        sess.run(bcast)  # x is not fed: the broadcast must not run the step's all-reduce
        np.testing.assert_array_equal(sess.run(w), np.full((4,), 10.0, np.float32))
        assert sess.run(step_count) == 0
        for _ in range(3):
            sess.run(train, feed_dict={x: np.full((4,), rank + 1.0, np.float32)})
        weights = dp.allgather_object(sess.run(w))
        np.testing.assert_array_equal(weights[0], weights[1])
        assert sess.run(step_count) == 3
    with tf.Graph().as_default():  # Horovod's hook, in a MonitoredSession
        v = tf.compat.v1.get_variable("v", initializer=tf.constant([float(rank)]))
        hooks = [dp.BroadcastGlobalVariablesHook(1)]
        with tf.compat.v1.train.MonitoredSession(hooks=hooks) as sess:
            assert sess.run(v).tolist() == [1.0]


CASES = {
    "session": check_session,
    "function": check_function,
    "global_variables": check_global_variables,
}


def start(_: Any) -> None:
    dp.init()


if __name__ == "__main__":
    run_cases(CASES, setup=start, teardown=lambda _: dp.shutdown())
