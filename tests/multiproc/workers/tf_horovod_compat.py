"""Worker: Horovod's TensorFlow error types and local gradients on 2 ranks.

``python tf_horovod_compat.py --case NAME`` (one case per launch; ``--list-cases``):

- ``errors``: ranks that disagree raise, on every rank and at the call, an
  error that a Horovod script's ``except tf.errors.FailedPreconditionError``
  catches (``InvalidArgumentError`` for bad all-to-all splits) and that is
  still the core's type (``MismatchError`` / ``ValueError``) with the
  core's message; inside ``tf.function`` TensorFlow's own ``OpError`` carries
  the message. The engine keeps working afterwards.
- ``graph_errors``: every tensor collective's errors are Horovod's types in
  all three modes, eager, ``tf.function`` and a TF1 ``Session``:
  ``FailedPreconditionError`` when the ranks disagree (shape, dtype, root,
  trailing dimensions, group size), ``InvalidArgumentError`` for one rank's bad
  argument (splits, root, dtype), with the eager message word for word inside
  the graph's (not ``InvalidArgumentError`` /
  ``UnknownError`` for all of them).
- ``keras3_local_layers``: ``PartialDistributedGradientTape`` over a Keras 3
  model (``keras.Variable``, which has no ``ref()``) with its first layer
  local, eagerly, in ``tf.function`` and in a TF1 ``Session``: that layer's
  gradients stay this rank's (divided by the size), the others are averaged;
  ``get_local_and_global_gradients`` splits them and ``vars_to_refs`` /
  ``refs_to_vars`` take Keras 3 variables.
- ``local_sources``: ``DistributedGradientTape.register_local_source`` keeps a
  rank's own gradient (divided by the size), the others are averaged.
- ``groups``: ``DistributedOptimizer(groups=N)`` and ``groups=[[v, ...]]``
  reduce each group as one bucket and train to the weights of the run
  without groups, bitwise, on every rank.

Every rank prints ``rank R OK``; any failure exits 1 at once.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from _fail_fast import run_cases

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import dp_plugin.tensorflow as dp
from dp_plugin.errors import DPPluginError
from dp_plugin.tensorflow.optimizer import hook_of


def raises(kinds: tuple[type, ...], words: str, call: Callable[[], Any]) -> None:
    try:
        call()
    except BaseException as error:
        for kind in kinds:
            assert isinstance(error, kind), f"{type(error).__mro__} is not a {kind.__name__}"
        assert words in str(error), f"{words!r} not in the message: {error}"
        return
    raise AssertionError(f"no error; expected {[k.__name__ for k in kinds]}")


def check_errors(_: Any) -> None:
    r = dp.rank()
    precondition = tf.errors.FailedPreconditionError
    raises((precondition, DPPluginError, ValueError), "rank",
           lambda: dp.allreduce(tf.ones([2 + r])))
    raises((precondition, ValueError), "rank",
           lambda: dp.allgather(tf.ones([1], tf.float32 if r == 0 else tf.float64)))
    raises((precondition,), "rank", lambda: dp.broadcast(tf.ones([2 + r]), root_rank=0))
    raises((tf.errors.InvalidArgumentError, ValueError), "splits",
           lambda: dp.alltoall(tf.ones([3]), splits=[1, 1] if r == 0 else [1, 2]))
    fn = tf.function(lambda x: dp.allreduce(x), input_signature=[tf.TensorSpec([None])])
    raises((tf.errors.OpError,), "rank", lambda: fn(tf.ones([2 + r])))
    np.testing.assert_allclose(dp.allreduce(tf.constant([float(r)]), op=dp.Sum), [1.0])


PRECONDITION, ARGUMENT = tf.errors.FailedPreconditionError, tf.errors.InvalidArgumentError


def error_cases(r: int) -> list[tuple[str, type, Callable[[], Any]]]:
    """(what, Horovod's error type, a call that builds / runs the collective) on rank ``r``;
    every call must fail on every rank."""
    ones = tf.ones
    return [
        ("allreduce shape", PRECONDITION, lambda: dp.allreduce(ones([2 + r]))),
        ("allreduce dtype", PRECONDITION,
         lambda: dp.allreduce(ones([2], tf.float32 if r == 0 else tf.float64))),
        ("allreduce bool", ARGUMENT, lambda: dp.allreduce(tf.constant([True]))),
        ("grouped_allreduce count", PRECONDITION,
         lambda: dp.grouped_allreduce([ones([2])] * (1 + r))),
        ("allgather trailing", PRECONDITION, lambda: dp.allgather(ones([1, 2 + r]))),
        ("allgather dtype", PRECONDITION,
         lambda: dp.allgather(ones([1], tf.int32 if r == 0 else tf.int64))),
        ("broadcast shape", PRECONDITION, lambda: dp.broadcast(ones([2 + r]), root_rank=0)),
        ("broadcast dtype", PRECONDITION,
         lambda: dp.broadcast(ones([2], tf.float32 if r == 0 else tf.int32), root_rank=0)),
        ("broadcast root mismatch", PRECONDITION, lambda: dp.broadcast(ones([2]), root_rank=r)),
        ("broadcast bad root on one rank", ARGUMENT,
         lambda: dp.broadcast(ones([2]), root_rank=0 if r == 0 else 5)),
        ("alltoall splits on one rank", ARGUMENT,
         lambda: dp.alltoall(ones([3]), splits=[1, 2] if r == 0 else [1, 1])),
        ("alltoall uneven rows", ARGUMENT, lambda: dp.alltoall(ones([3]))),
        ("alltoall trailing", PRECONDITION, lambda: dp.alltoall(ones([2, 1 + r]))),
        ("alltoall dtype", PRECONDITION,
         lambda: dp.alltoall(ones([2], tf.float32 if r == 0 else tf.float16))),
        ("reducescatter shape", PRECONDITION, lambda: dp.reducescatter(ones([2 + r, 2]))),
        ("reducescatter dtype", PRECONDITION,
         lambda: dp.reducescatter(ones([2], tf.float32 if r == 0 else tf.float64))),
    ]


def failure(call: Callable[[], Any]) -> BaseException:
    try:
        call()
    except BaseException as error:
        return error
    raise AssertionError("no error")


def in_session(build: Callable[[], Any]) -> None:
    with tf.Graph().as_default():
        fetch = build()
        with tf.compat.v1.Session() as session:
            session.run(fetch)


def check_graph_errors(_: Any) -> None:
    for what, kind, call in error_cases(dp.rank()):
        eager = failure(call)
        assert type(eager) is not kind and isinstance(eager, kind), (what, type(eager).__mro__)
        message = str(eager)
        runs = {"tf.function": tf.function(call), "session": functools.partial(in_session, call)}
        for mode, run in runs.items():
            error = failure(run)
            where = f"{what} in {mode}"
            assert isinstance(error, kind), f"{where}: {type(error).__name__}: {error}"
            assert message in error.message, f"{where}: {message!r} not in {error.message!r}"
    np.testing.assert_allclose(dp.allreduce(tf.constant([float(dp.rank())]), op=dp.Sum), [1.0])


def keras3_model() -> keras.Model:
    keras.utils.set_random_seed(3)  # the same weights on every rank
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="local"),
                             keras.layers.Dense(2, name="shared_a"),
                             keras.layers.Dense(1, name="shared_b")])


def layer_path(variable: Any) -> str:
    """'local/kernel': the variable's path without the model's (numbered) name."""
    return str(variable.path).split("/", 1)[1]


def tape_gradients(model: keras.Model, x: Any, split: list[Any] | None = None) -> Any:
    """The model's gradients of ``sum(model(x))``: this rank's own, or (``split``: a
    list that receives the local and the global variables' paths, when traced) from
    ``PartialDistributedGradientTape`` with the first layer local, local ones first."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.constant(x)))
    if split is None:
        return tape.gradient(loss, model.trainable_variables)
    tape = dp.PartialDistributedGradientTape(tape, local_layers=model.layers[0])
    local, shared = tape.get_local_and_global_gradients(loss, model.trainable_variables)
    split[:] = [[layer_path(v) for v, _ in local], [layer_path(v) for v, _ in shared]]
    return [g for _, g in local] + [g for _, g in shared]


def check_keras3_local_layers(_: Any) -> None:
    r, size = dp.rank(), dp.size()
    model = keras3_model()
    variables = model.trainable_variables
    assert not hasattr(variables[0], "ref"), "a Keras 3 variable; this case needs one"
    back = dp.refs_to_vars(dp.vars_to_refs([variables, variables[:1]]))
    assert all(a is b for a, b in zip(back[0], variables, strict=True))
    assert back[1][0] is variables[0]
    x = np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1)
    own = [np.asarray(g) for g in tape_gradients(model, x)]
    expected = [own[0] / size, own[1] / size,
                *[np.asarray(dp.allreduce(tf.constant(g))) for g in own[2:]]]
    local_paths = {layer_path(v) for v in model.layers[0].trainable_variables}

    def in_session(split: list[Any]) -> Any:
        with tf.Graph().as_default():
            grads = tape_gradients(keras3_model(), x, split)
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                return session.run(grads)

    def traced(split: list[Any]) -> Any:
        @tf.function
        def step() -> Any:
            return tape_gradients(model, x, split)

        return step()

    runs = {"eager": functools.partial(tape_gradients, model, x), "tf.function": traced,
            "session": in_session}
    for mode, run in runs.items():
        split: list[Any] = []
        grads = run(split)
        assert set(split[0]) == local_paths and not set(split[1]) & local_paths, (mode, split)
        for got, want in zip(grads, expected, strict=True):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, err_msg=mode)


def check_local_sources(_: Any) -> None:
    r = dp.rank()
    shared = tf.Variable([1.0, 1.0])
    local = tf.Variable([1.0])
    with tf.GradientTape() as tape:
        loss = (r + 1.0) * (tf.reduce_sum(shared) + 3.0 * tf.reduce_sum(local))
    tape = dp.DistributedGradientTape(tape)
    tape.register_local_source(local)
    g_shared, g_local = tape.gradient(loss, [shared, local])
    np.testing.assert_allclose(g_shared, [1.5, 1.5])  # averaged: (1 + 2) / 2
    np.testing.assert_allclose(g_local, [3.0 * (r + 1) / 2])  # own, scaled by 1/size
    layer = keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)
    with tf.GradientTape() as tape:
        out = tf.reduce_sum(layer(tf.fill([1, 2], r + 1.0)))
    tape = dp.PartialDistributedGradientTape(tape, local_layers=layer,
                                             scale_local_gradients=False)
    (g_kernel,) = tape.gradient(out, layer.trainable_weights)
    np.testing.assert_allclose(g_kernel, np.full((2, 1), r + 1.0))


def check_groups(_: Any) -> None:
    r = dp.rank()
    x = np.random.default_rng(r).normal(size=(8, 3)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)

    def train(groups: Callable[[keras.Model], Any]) -> tuple[list[np.ndarray], list[Any]]:
        model = keras3_model()
        opt = dp.DistributedOptimizer(keras.optimizers.SGD(0.1), groups=groups(model))
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=4, epochs=2, verbose=0)
        plan = hook_of(model.optimizer).bridge.schedulers[0].plan  # type: ignore[union-attr]
        return model.get_weights(), [b.members for b in plan]

    plain, _ = train(lambda m: None)
    everyone = dp.allgather_object([w.tobytes() for w in plain])
    assert all(theirs == everyone[0] for theirs in everyone), "ranks differ"
    # Six variables: kernel, bias of each of the three layers.
    for groups, expected in [(lambda m: 2, [{0, 1, 2}, {3, 4, 5}]),
                             (lambda m: [[m.layers[2].kernel, m.layers[0].bias]], [{4, 1}])]:
        weights, plan = train(groups)
        assert all(group in [set(b) for b in plan] for group in expected), plan
        for got, want in zip(weights, plain, strict=True):
            np.testing.assert_array_equal(got, want)


CASES = {
    "errors": check_errors,
    "groups": check_groups,
    "graph_errors": check_graph_errors,
    "local_sources": check_local_sources,
    "keras3_local_layers": check_keras3_local_layers,
}


def start(_: Any) -> None:
    dp.init()


if __name__ == "__main__":
    run_cases(CASES, setup=start, teardown=lambda _: dp.shutdown())
