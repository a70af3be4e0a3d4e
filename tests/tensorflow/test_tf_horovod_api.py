"""Horovod's TensorFlow / Keras names in one process (local engine).

The multi-rank behaviour of the same functions is in
tests/multiproc/test_tf_collectives.py and test_tf_horovod_script.py.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf

import dp_plugin.keras as hvd_keras
import dp_plugin.tensorflow as dp
from dp_plugin.tensorflow.optimizer import hook_of

CALLBACKS = ("BroadcastGlobalVariablesCallback", "MetricAverageCallback",
             "LearningRateWarmupCallback", "LearningRateScheduleCallback", "BestModelCheckpoint")
X = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
Y = X.sum(axis=1, keepdims=True)



def model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])


@pytest.mark.parametrize("module", [dp, hvd_keras])
def test_callbacks_namespace_names_every_horovod_callback(module: object) -> None:
    for name in CALLBACKS:
        assert getattr(module.callbacks, name) is getattr(dp, name)  # type: ignore[attr-defined]


def test_load_model_restores_the_optimizer_distributed(tmp_path: Path) -> None:
    m = model()
    m.compile(optimizer=dp.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    m.fit(X, Y, epochs=1, verbose=0)
    m.save(tmp_path / "m.keras")
    restored = hvd_keras.load_model(tmp_path / "m.keras", compression=dp.Compression.fp16)
    assert hook_of(restored.optimizer) is not None, "load_model must wrap the optimizer"
    assert int(restored.optimizer.iterations) == int(m.optimizer.iterations) == 1
    for a, b in zip(m.get_weights(), restored.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    restored.fit(X, Y, epochs=1, verbose=0)  # trains with the reduction installed
    assert int(restored.optimizer.iterations) == 2
    with pytest.raises(ValueError, match="legacy"):
        dp.load_model(tmp_path / "m.keras", legacy_opts=True)


def test_best_model_checkpoint_keeps_the_best_and_needs_a_path(tmp_path: Path) -> None:
    m = model()
    m.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="no filepath"):
        m.fit(X, Y, validation_data=(X, Y), verbose=0,
              callbacks=[dp.callbacks.BestModelCheckpoint()])
    best = dp.callbacks.BestModelCheckpoint(filepath=str(tmp_path / "best.keras"))
    assert best.save_best_only and best.monitor == "val_loss"
    m.fit(X, Y, validation_data=(X, Y), epochs=2, verbose=0, callbacks=[best])
    assert (tmp_path / "best.keras").exists()


def test_keras_module_tensor_functions_return_numpy_eagerly() -> None:
    out = hvd_keras.allreduce([1.0, 2.0], op=dp.Sum)
    assert isinstance(out, np.ndarray) and out.tolist() == [1.0, 2.0]
    assert hvd_keras.allgather(np.ones((2, 1))).shape == (2, 1)
    assert hvd_keras.broadcast(3.0, 0) == 3.0
    assert hvd_keras.reducescatter(np.ones((3, 2), np.float32)).shape == (3, 2)
    assert isinstance(dp.allreduce([1.0]), tf.Tensor)


def test_build_and_topology_queries_in_one_process() -> None:
    assert not (dp.gloo_enabled() or dp.mpi_enabled())
    assert (dp.cross_size(), dp.cross_rank(), dp.is_homogeneous()) == (1, 0, True)
    assert dp.nccl_built() == 0 and not dp.cuda_built()
    with pytest.raises(ValueError, match="MPI is not enabled"):
        dp.mpi_threads_supported()


def test_groups_make_one_bucket_each() -> None:
    def plan(m: keras.Model, **kwargs: object) -> list[tuple[int, ...]]:
        m.compile(optimizer=dp.DistributedOptimizer(keras.optimizers.SGD(0.1), **kwargs),
                  loss="mse")
        m.fit(X, Y, epochs=1, verbose=0)
        return [b.members for b in hook_of(m.optimizer).bridge.schedulers[0].plan]

    assert plan(model()) == [(1, 0)]  # kernel (0) and bias (1) fused
    assert plan(model(), groups=2) == [(1,), (0,)]
    with pytest.warns(DeprecationWarning, match="num_groups"):
        assert plan(model(), num_groups=2) == [(1,), (0,)]
    m = model()
    assert plan(m, groups=[[m.trainable_variables[0]]]) == [(1,), (0,)]


def test_the_tape_takes_groups_as_the_optimizer_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from dp_plugin.tensorflow import tape as tape_module

    def plan(m: keras.Model, **kwargs: object) -> list[tuple[int, ...]]:
        monkeypatch.setattr(tape_module, "_bridges", {})  # tapes share bridges by settings
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((m(X) - Y) ** 2)
        tape = dp.DistributedGradientTape(tape, **kwargs)
        tape.gradient(loss, m.trainable_variables)
        return [b.members for b in tape._bridge.schedulers[0].plan]

    assert plan(model()) == [(1, 0)]
    assert plan(model(), groups=2) == [(1,), (0,)]
    with pytest.warns(DeprecationWarning, match="num_groups"):
        assert plan(model(), num_groups=2) == [(1,), (0,)]
    m = model()
    assert plan(m, groups=[[m.trainable_variables[0]]]) == [(1,), (0,)]
    with pytest.raises(ValueError, match="groups should be a non-negative integer"):
        dp.DistributedGradientTape(tf.GradientTape(), groups=0)


@pytest.mark.parametrize(("groups", "match"), [
    (0, "groups should be a non-negative integer or a list of list of tf.Variable, got 0"),
    ([[np.ones(1)]], "groups must consist of tf.Variable, got ndarray"),
])
def test_bad_groups_are_refused(groups: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dp.DistributedOptimizer(keras.optimizers.SGD(0.1), groups=groups)


def test_timeline_starts_and_stops_in_one_process(tmp_path: Path) -> None:
    dp.start_timeline(str(tmp_path / "t-{rank}.json"))
    dp.stop_timeline()
    dp.stop_timeline()  # nothing running: fine
    events = json.loads((tmp_path / "t-0.json").read_text())  # closed: valid JSON
    assert events[0]["ph"] == "M"
    with pytest.raises(ValueError, match="file_path must be a non-empty string"):
        dp.start_timeline("")


def test_errors_name_the_value_and_the_fix() -> None:
    with pytest.raises(RuntimeError, match="broadcast_variables"):
        dp.broadcast_global_variables(0)
    with pytest.raises(NotImplementedError, match="Adasum"):
        dp.allreduce(tf.ones([1]), op=dp.Adasum)
    with pytest.warns(DeprecationWarning, match="replaced with `op`"):
        dp.allreduce(tf.ones([1]), average=False)
    with pytest.raises(ValueError, match="supersedes average"):
        dp.allreduce(tf.ones([1]), average=True, op=dp.Sum)
    slices = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([3, 2]))
    with pytest.raises(NotImplementedError, match="Sum and Average"):
        dp.allreduce(slices, op=dp.Max)
    with pytest.raises(NotImplementedError, match="prescale"):
        dp.allreduce(slices, prescale_factor=2.0)
    with pytest.raises(TypeError, match="process_set must be"):
        dp.allreduce(tf.ones([1]), process_set=[0])
    with pytest.raises(ValueError, match="not registered"):
        dp.allreduce(tf.ones([1]), process_set=dp.ProcessSet([0]))
    with pytest.raises(ValueError, match="root_rank 3"):
        dp.broadcast(tf.ones([1]), 3)
    with pytest.raises(ValueError, match="scalar"):
        dp.allgather(tf.constant(1.0))
    with pytest.raises(ValueError, match="synchronized"):
        dp.SyncBatchNormalization(synchronized=True)
    with pytest.raises(NotImplementedError, match="local_variables"):
        dp.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[1])


def test_sync_batch_norm_is_batch_norm_in_one_process_and_saves(tmp_path: Path) -> None:
    x = np.random.default_rng(1).normal(size=(8, 3)).astype(np.float32)
    sync, plain = dp.SyncBatchNormalization(), keras.layers.BatchNormalization()
    np.testing.assert_allclose(sync(x, training=True), plain(x, training=True), rtol=1e-6)
    m = keras.Sequential([keras.Input((3,)), dp.SyncBatchNormalization()])
    m.save(tmp_path / "bn.keras")
    assert isinstance(keras.models.load_model(tmp_path / "bn.keras").layers[0],
                      dp.SyncBatchNormalization)


def test_sync_batch_norm_takes_horovods_keras2_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keras 3 refused fused=; Horovod's layer took Keras 2's arguments."""
    from dp_plugin.tensorflow import sync_batch_norm

    monkeypatch.setattr(sync_batch_norm, "_warned", set())
    x = np.random.default_rng(2).normal(size=(8, 3)).astype(np.float32)
    plain = keras.layers.BatchNormalization()(x, training=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer = dp.SyncBatchNormalization(fused=False)  # Horovod's default: no warning
    np.testing.assert_allclose(layer(x, training=True), plain, rtol=1e-6)
    for fused in (True, None):  # Horovod's layer refused them, with this message
        with pytest.raises(ValueError, match=r"^SyncBatchNormalization does not support "
                                             r"fused=True\.$"):
            dp.SyncBatchNormalization(fused=fused)
    for argument, value in (("virtual_batch_size", 4), ("adjustment", lambda shape: (1, 0))):
        with pytest.warns(UserWarning, match=f"{argument}=.* is ignored"):
            layer = dp.SyncBatchNormalization(**{argument: value})
        np.testing.assert_allclose(layer(x, training=True), plain, rtol=1e-6)
        with warnings.catch_warnings():  # once per process
            warnings.simplefilter("error")
            dp.SyncBatchNormalization(**{argument: value})


def test_graph_helpers_answer_for_the_running_process() -> None:
    assert int(dp.rank_op()) == 0 and int(dp.size_op()) == 1
    assert int(dp.local_rank_op()) == 0 and int(dp.local_size_op()) == 1
    assert int(dp.process_set_included_op()) == 1
    with pytest.raises(ValueError, match="process_set_id=7 is not a registered process set"):
        dp.size_op(process_set_id=7)
    assert dp.broadcast_object_fn(root_rank=0)({"epoch": 3}) == {"epoch": 3}
    v = tf.Variable([1.0, 2.0])
    (value,) = dp.broadcast_([v], root_rank=0)  # Horovod returns the new values
    assert value.numpy().tolist() == [1.0, 2.0] and v.numpy().tolist() == [1.0, 2.0]
    w = tf.Variable([3.0])
    values = tf.function(lambda: dp.broadcast_([v, w], root_rank=0))()
    assert [t.numpy().tolist() for t in values] == [[1.0, 2.0], [3.0]]


def test_horovod_util_module_and_executing_eagerly() -> None:
    from dp_plugin.tensorflow import util

    assert dp._executing_eagerly() is True
    assert tf.function(lambda: tf.constant(dp._executing_eagerly()))().numpy() == False  # noqa: E712
    calls = []
    cached = util._cache(lambda n: calls.append(n) or n * 2)
    assert (cached(3), cached(3), calls) == (6, 6, [3])
    v, w = tf.Variable(1.0), tf.Variable(2.0)
    refs = util.vars_to_refs([v, [w]])
    assert hash(refs) is not None and util.refs_to_vars(refs)[1][0] is w
    assert float(util._make_subgraph(lambda: v * 3)()) == 3.0


def test_tape_local_sources_are_kept_and_scaled_like_horovods() -> None:
    layer = keras.layers.Dense(1, kernel_initializer="ones")
    local = keras.layers.Dense(1, kernel_initializer="ones")
    x = tf.ones([1, 2])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(local(layer(x)))
    tape = dp.PartialDistributedGradientTape(tape, local_layers=[local])
    grads = tape.gradient(loss, layer.trainable_weights + local.trainable_weights)
    assert [g.shape for g in grads] == [(2, 1), (1,), (1, 1), (1,)]
    assert len(tape._local_sources) == 2
    with tf.GradientTape() as tape2:
        loss = tf.reduce_sum(local(layer(x)))
    tape2 = dp.DistributedGradientTape(tape2)
    tape2.register_local_source(local.kernel)
    local_pairs, shared = tape2.get_local_and_global_gradients(
        loss, [*layer.trainable_weights, local.kernel])
    assert [s is local.kernel for s, _ in local_pairs] == [True] and len(shared) == 2
