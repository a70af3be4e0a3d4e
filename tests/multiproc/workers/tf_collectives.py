"""Worker: dp_plugin.tensorflow's Horovod tensor API on 2 real ranks (gloo engine).

``python tf_collectives.py --case NAME`` (one case per launch; ``--list-cases``):

- ``values``: allreduce (every op, pre/postscale, integers, IndexedSlices),
  grouped_allreduce, allgather (uneven first dimension), grouped_allgather,
  broadcast (float and bool), alltoall (splits), reducescatter (uneven rows),
  each eagerly and inside ``tf.function`` with unknown dimensions, compared
  with Horovod 0.28.1's documented results;
- ``gradients``: the gradients Horovod defines for allreduce, allgather,
  broadcast, alltoall and reducescatter, eagerly and in ``tf.function``;
- ``objects_sets``: broadcast_object, allgather_object, barrier, join,
  process sets (singleton sets, duplicate and non-member errors), topology
  and the ``*_built`` / ``*_enabled`` answers for the gloo engine;
- ``sync_bn``: SyncBatchNormalization normalizes with the global batch's
  statistics (equal to BatchNormalization on the concatenated batch);
- ``sync_bn_horovod``: Horovod's own SyncBatchNormalization check (its
  test's inputs, ``axis=1``, built with Horovod's Keras 2 ``fused=False``):
  the output and the moving statistics equal BatchNormalization's on the
  concatenated batch, eagerly, in ``tf.function`` and in a TF1 ``Session``
  (Keras 3's layer refuses ``fused``);
- ``alltoall_sends_nothing``: Horovod's ``alltoall_one_rank_sends_nothing``:
  rank 0 sends no rows (splits all zero), the others ``rank + 1`` rows to
  each rank, for each of Horovod's dtypes and 1-3 dimensions, eagerly, in
  ``tf.function`` and in a TF1 ``Session``: every rank gets the rows meant
  for it and Horovod's received splits (the rank sending nothing
  must not fail while the others wait in the all-to-all);
- ``sparse``: embedding gradients (``tf.IndexedSlices``) through
  DistributedGradientTape and DistributedOptimizer, all-gathered by default
  and dense with ``sparse_as_dense=True``.

Every rank prints ``rank R OK``; any failure exits 1 at once.
"""

from __future__ import annotations

import importlib.util
import os
import time
from typing import Any

from _fail_fast import run_cases

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import dp_plugin.tensorflow as dp


def close(a: Any, b: Any, what: str) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    assert a.dtype == b.dtype or np.issubdtype(a.dtype, np.floating), f"{what}: {a.dtype}"
    np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=what)


def both_modes(fn: Any, *args: Any) -> list[Any]:
    """``fn(*args)`` eagerly and inside ``tf.function`` (with unknown dimensions)."""
    sig = [tf.TensorSpec([None] * len(a.shape), a.dtype) for a in args]
    return [fn(*args), tf.function(fn, input_signature=sig)(*args)]


def check_values(_: Any) -> None:
    r = dp.rank()
    x = tf.constant([r + 1.0, 2.0 * r])  # ranks: [1, 0], [2, 2]
    for mode, out in enumerate(both_modes(lambda t: [
            dp.allreduce(t), dp.allreduce(t, op=dp.Sum), dp.allreduce(t, op=dp.Min),
            dp.allreduce(t, op=dp.Max), dp.allreduce(t, op=dp.Product),
            dp.allreduce(t, op=dp.Sum, prescale_factor=2.0, postscale_factor=3.0)], x)):
        avg, total, lo, hi, prod, scaled = out
        close(avg, [1.5, 1.0], f"average ({mode})")
        close(total, [3.0, 2.0], "sum")
        close(lo, [1.0, 0.0], "min")
        close(hi, [2.0, 2.0], "max")
        close(prod, [2.0, 0.0], "product")
        close(scaled, [18.0, 12.0], "pre/postscale")
    ints = dp.allreduce(tf.constant([r + 1, 7], tf.int32), op=dp.Sum)
    assert ints.dtype == tf.int32
    close(ints, np.array([3, 14], np.int32), "int sum")
    close(dp.allreduce(tf.Variable([float(r)])), [0.5], "variable")
    close(dp.allreduce(np.full((2, 2), r, np.float64), op=dp.Sum), np.ones((2, 2)), "numpy")
    g = dp.grouped_allreduce([x, tf.constant([[r]], tf.float64)], op=dp.Sum)
    close(g[0], [3.0, 2.0], "grouped 0")
    assert g[1].dtype == tf.float64
    close(g[1], [[1.0]], "grouped 1")
    big = tf.fill([(1 << 20) // 4 + 5], float(r + 1))  # 1 MiB and more: travels alone
    g = dp.grouped_allreduce([big, tf.constant([r], tf.int32)], op=dp.Sum)
    close(g[0], np.full(big.shape, 3.0, np.float32), "grouped, one alone")
    close(g[1], np.array([1], np.int32), "grouped, beside one alone")
    close(big, np.full(big.shape, float(r + 1), np.float32), "grouped leaves its input alone")
    slices = tf.IndexedSlices(tf.constant([[r + 1.0]]), tf.constant([r]), tf.constant([3, 1]))
    red = dp.allreduce(slices)  # Horovod: all-gather values / size and indices
    assert isinstance(red, tf.IndexedSlices), type(red)
    close(red.values, [[0.5], [1.0]], "sparse values")
    close(red.indices, np.array([0, 1], np.int32), "sparse indices")

    rows = tf.fill([r + 1, 3], float(r))  # rank 0: 1 row of 0, rank 1: 2 rows of 1
    for out in both_modes(lambda t: dp.allgather(t), rows):
        close(out, [[0.0] * 3, [1.0] * 3, [1.0] * 3], "allgather")
    a, b = dp.grouped_allgather([rows, tf.constant([r], tf.int64)])
    close(a, [[0.0] * 3, [1.0] * 3, [1.0] * 3], "grouped allgather 0")
    close(b, np.array([0, 1], np.int64), "grouped allgather 1")

    for out in both_modes(lambda t: dp.broadcast(t, 1), tf.fill([4], float(r))):
        close(out, [1.0] * 4, "broadcast")
    flags = dp.broadcast(tf.constant([r == 0, True]), 0)
    assert flags.dtype == tf.bool and flags.numpy().tolist() == [True, True], flags

    data = tf.reshape(tf.range(3 * 2, dtype=tf.float32), [3, 2]) + 100.0 * r
    splits = tf.constant([1, 2] if r == 0 else [2, 1])
    for out, rsplits in both_modes(lambda t, s: dp.alltoall(t, splits=s), data, splits):
        mine = [data.numpy()[:1], (data.numpy() - 100.0 * r + 100.0)[:2]] if r == 0 else [
            (data.numpy() - 100.0)[1:3], data.numpy()[2:3]]
        close(out, np.concatenate(mine), "alltoall")
        close(rsplits, np.array([1, 2] if r == 0 else [2, 1], np.int32), "received splits")
    even = dp.alltoall(tf.constant([[r * 10.0], [r * 10.0 + 1]]))
    close(even, [[float(r)], [10.0 + r]], "alltoall even")

    same = tf.fill([3, 2], r + 1.0)
    for total, avg in both_modes(lambda t: [dp.reducescatter(t, op=dp.Sum),
                                            dp.reducescatter(t)], same):
        n = 2 if r == 0 else 1  # 3 rows: rank 0 gets 2, rank 1 gets 1 (Horovod)
        close(total, np.full((n, 2), 3.0), "reducescatter sum")
        close(avg, np.full((n, 2), 1.5), "reducescatter average")


def check_gradients(_: Any) -> None:
    r = dp.rank()

    def grads(x: Any) -> list[Any]:
        outs = []
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            losses = [
                tf.reduce_sum(dp.allreduce(x * (r + 1.0))),
                tf.reduce_sum(dp.allreduce(x, op=dp.Sum, prescale_factor=2.0)),
                tf.reduce_sum(dp.allgather(x[: r + 1]) * tf.constant([[1.0], [2.0], [3.0]])),
                tf.reduce_sum(dp.broadcast(x, 0) * (r + 1.0)),
                tf.reduce_sum(dp.alltoall(x, splits=[1, 2] if r == 0 else [2, 1])[0]
                              * (r + 1.0)),
                tf.reduce_sum(dp.reducescatter(x, op=dp.Sum)),
                tf.reduce_sum(dp.reducescatter(x)),
            ]
        for loss in losses:
            outs.append(tape.gradient(loss, x))
        return outs

    x = tf.ones([3, 1])
    for mode, (ar, ar_sum, ag, bc, a2a, rs_sum, rs_avg) in enumerate(
            [grads(x), tf.function(grads)(x)]):
        where = f"({'tf.function' if mode else 'eager'})"
        close(ar, np.full((3, 1), r + 1.0), f"allreduce grad {where}")  # averaged dy = 1
        close(ar_sum, np.full((3, 1), 4.0), f"allreduce sum grad {where}")  # sum(1)*2
        mine = [[1.0], [0.0], [0.0]] if r == 0 else [[2.0], [3.0], [0.0]]
        close(ag, mine, f"allgather grad {where}")
        close(bc, np.full((3, 1), 1.5 if r == 0 else 0.0), f"broadcast grad {where}")
        back = [[1.0], [2.0], [2.0]] if r == 0 else [[1.0], [1.0], [2.0]]
        close(a2a, back, f"alltoall grad {where}")
        close(rs_sum, np.full((3, 1), 2.0), f"reducescatter sum grad {where}")
        close(rs_avg, np.ones((3, 1)), f"reducescatter average grad {where}")


def check_objects_and_sets(_: Any) -> None:
    r = dp.rank()
    got = dp.broadcast_object({"from": r, "list": [r] * 3} if r == 1 else None, root_rank=1)
    assert got == {"from": 1, "list": [1, 1, 1]}, got
    assert dp.allgather_object(("rank", r, "x" * (r * 1000))) == [
        ("rank", 0, ""), ("rank", 1, "x" * 1000)]
    dp.barrier()
    if r == 1:
        time.sleep(0.5)
    last = dp.join()
    assert int(last) == 1, f"join returned {int(last)}, expected the last rank (1)"

    assert (dp.size(), dp.local_size(), dp.cross_size(), dp.cross_rank()) == (2, 2, 1, 0)
    assert dp.is_homogeneous() and dp.gloo_enabled() and not dp.mpi_enabled()
    assert dp.gloo_built() and dp.nccl_built() == 0 and not dp.cuda_built()
    assert not (dp.rocm_built() or dp.ddl_built() or dp.ccl_built())
    assert dp.mpi_built() == (importlib.util.find_spec("mpi4py") is not None)
    try:
        dp.mpi_threads_supported()
        raise AssertionError("mpi_threads_supported() must raise without MPI")
    except ValueError as exc:
        assert "not enabled" in str(exc), exc

    sets = [dp.add_process_set([0]), dp.add_process_set(dp.ProcessSet([1]))]
    assert [s.process_set_id for s in sets] == [1, 2], sets
    mine, other = sets[r], sets[1 - r]
    assert mine.size() == 1 and mine.rank() == 0 and mine.included() and not other.included()
    close(dp.allreduce(tf.constant([r + 5.0]), op=dp.Sum, process_set=mine), [r + 5.0], "set")
    close(dp.allgather(tf.constant([r]), process_set=mine), np.array([r], np.int32), "set ag")
    close(dp.broadcast(tf.constant([r]), r, process_set=mine), np.array([r], np.int32), "set bc")
    for bad, kind in ((lambda: dp.allreduce(tf.ones([1]), process_set=other), "not in"),
                      (lambda: dp.add_process_set([0]), "duplicate"),
                      (lambda: dp.add_process_set([0, 1]), "duplicate")):
        try:
            bad()
            raise AssertionError(f"expected ValueError ({kind})")
        except ValueError as exc:
            assert kind in str(exc), exc
    close(dp.allreduce(tf.constant([1.0]), op=dp.Sum, process_set=dp.global_process_set),
          [2.0], "global set")
    assert all(dp.remove_process_set(s) for s in sets)
    assert [s.process_set_id for s in sets] == [None, None]
    assert dp.add_process_set([1]).process_set_id in (1, 2)


def check_sync_bn(_: Any) -> None:
    r = dp.rank()
    rng = np.random.default_rng(7)
    full = rng.normal(size=(8, 3)).astype(np.float32) * [1.0, 5.0, 0.1] + [0.0, 3.0, -2.0]
    mine = full[4 * r: 4 * r + 4]
    sync = dp.SyncBatchNormalization(momentum=0.0)
    plain = keras.layers.BatchNormalization(momentum=0.0)
    out = sync(mine, training=True)
    reference = plain(full, training=True).numpy()[4 * r: 4 * r + 4]
    np.testing.assert_allclose(out, reference, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(sync.moving_mean, full.mean(0), rtol=1e-5, atol=1e-6)
    step = tf.function(lambda t: sync(t, training=True))
    np.testing.assert_allclose(step(tf.constant(mine)), reference, rtol=1e-4, atol=1e-5)
    # Horovod's gradient (the all-reduce's backward averages over the ranks) is
    # the gradient of the sum of every rank's loss: BatchNormalization on the
    # whole batch, each rank's rows weighted as that rank weighs them.
    x = tf.constant(mine)
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(sync(x, training=True) * (r + 1.0))
    got = tape.gradient(loss, x)
    whole = tf.constant(full)
    with tf.GradientTape() as tape:
        tape.watch(whole)
        weights = tf.constant([[1.0]] * 4 + [[2.0]] * 4)
        loss = tf.reduce_sum(keras.layers.BatchNormalization()(whole, training=True) * weights)
    expected = tape.gradient(loss, whole).numpy()[4 * r: 4 * r + 4]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def horovod_bn_inputs(size: int) -> list[np.ndarray]:
    """The two inputs of Horovod's SyncBatchNormalization test: one [4, c] block per rank."""
    return [
        np.stack([np.array([[r, r + 1], [r * 2, r * 2 + 1], [r * 3, r * 3 + 1],
                            [r * 4, r * 4 + 1]], np.float32) for r in range(size)]),
        np.stack([np.array([[r + 1], [r * 2 + 1], [r * 3 + 1], [r * 4 + 1]], np.float32)
                  for r in range(size)]),
    ]


def batch_norm_run(mode: str, layer: Any, x: np.ndarray) -> list[np.ndarray]:
    """``layer(x, training=True)``, then (not in a session, where Keras 3 leaves the
    moving-average updates outside the fetched output) its moving statistics."""
    def step() -> Any:
        return layer(tf.constant(x), training=True)

    if mode == "session":
        with tf.Graph().as_default():
            out = step()
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                return [session.run(out)]
    y = step() if mode == "eager" else tf.function(step)()
    return [np.asarray(v) for v in (y, layer.moving_mean, layer.moving_variance)]


def check_sync_bn_horovod(_: Any) -> None:
    r, size = dp.rank(), dp.size()
    for x in horovod_bn_inputs(size):
        for mode in ("eager", "tf.function", "session"):
            sync = dp.SyncBatchNormalization(axis=1, fused=False)
            got = batch_norm_run(mode, sync, x[r:r + 1])
            plain = keras.layers.BatchNormalization(axis=1)
            want = batch_norm_run(mode, plain, x)
            np.testing.assert_allclose(got[0], want[0][r:r + 1], rtol=1e-5, atol=1e-5,
                                       err_msg=f"output, {mode}")
            if mode != "session":
                assert np.abs(got[1]).min() > 0, f"moving mean not updated, {mode}"
                np.testing.assert_allclose(got[1:], want[1:], rtol=1e-6,
                                           err_msg=f"moving statistics, {mode}")


A2A_DTYPES = [tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16,
              tf.float32, tf.float64]


def sends_nothing_input(r: int, size: int, dtype: Any, dim: int) -> tuple[Any, Any]:
    """Horovod's test input: rows for rank i hold i, ``r + 1`` of them per rank; none
    at all on rank 0. Built with TensorFlow ops (in the caller's graph)."""
    if r == 0:
        return (tf.reshape(tf.convert_to_tensor([], dtype=dtype), [0] + [2] * (dim - 1)),
                tf.convert_to_tensor([0] * size, dtype=tf.int32))
    tensor = tf.convert_to_tensor([i for i in range(size) for _ in range(r + 1)], dtype=dtype)
    for _ in range(dim - 1):
        tensor = tf.expand_dims(tensor, axis=1)
        tensor = tf.concat([tensor, tensor], axis=1)
    return tensor, tf.convert_to_tensor([r + 1] * size, dtype=tf.int32)


def check_alltoall_sends_nothing(_: Any) -> None:
    r, size = dp.rank(), dp.size()
    splits = [0] + [j + 1 for j in range(1, size)]  # rows each rank sends to this one

    def exchange(dtype: Any, dim: int) -> Any:
        return dp.alltoall(*sends_nothing_input(r, size, dtype, dim))

    def in_session(dtype: Any, dim: int) -> Any:
        with tf.Graph().as_default():
            fetch = exchange(dtype, dim)
            with tf.compat.v1.Session() as session:
                return session.run(fetch)

    modes = {"eager": exchange, "tf.function": tf.function(exchange), "session": in_session}
    for dtype in A2A_DTYPES:
        for dim in (1, 2, 3):
            for mode, run in modes.items():
                collected, received = (np.asarray(v) for v in run(dtype, dim))
                what = f"{mode} {dtype.name} dim {dim}"
                assert collected.shape == (sum(splits), *[2] * (dim - 1)), (what, collected.shape)
                assert (collected.astype(np.int64) == r).all(), (what, collected)
                assert received.dtype == np.int32 and received.tolist() == splits, (what, received)


def check_sparse(_: Any) -> None:
    r = dp.rank()
    table = tf.Variable(np.zeros((4, 2), np.float32))
    ids = tf.constant([0, 1] if r == 0 else [1, 2])

    def sparse_grad(sparse_as_dense: bool) -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, ids))
        tape = dp.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
        return tape.gradient(loss, [table])[0]

    averaged = [[0.5, 0.5], [1.0, 1.0], [0.5, 0.5], [0.0, 0.0]]
    for fn in (sparse_grad, tf.function(sparse_grad)):
        g = fn(False)
        assert isinstance(g, tf.IndexedSlices), type(g)
        assert g.indices.numpy().tolist() == [0, 1, 1, 2], g.indices
        close(tf.convert_to_tensor(g), averaged, "gathered sparse gradient")
        dense = fn(True)
        assert not isinstance(dense, tf.IndexedSlices), type(dense)
        close(dense, averaged, "sparse_as_dense gradient")

    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(4, 2)])
    opt = dp.DistributedOptimizer(keras.optimizers.SGD(1.0))
    dp.broadcast_variables(model.variables, 0)
    before = model.weights[0].numpy().copy()

    @tf.function
    def step(x: Any) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        assert isinstance(grads[0], tf.IndexedSlices)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    step(tf.reshape(ids, [1, 2]))
    close(model.weights[0].numpy(), before - np.array(averaged), "optimizer step")
    weights = dp.allgather_object(model.weights[0].numpy())
    np.testing.assert_array_equal(weights[0], weights[1])


CASES = {
    "values": check_values,
    "gradients": check_gradients,
    "objects_sets": check_objects_and_sets,
    "sync_bn": check_sync_bn,
    "sync_bn_horovod": check_sync_bn_horovod,
    "alltoall_sends_nothing": check_alltoall_sends_nothing,
    "sparse": check_sparse,
}


def start(_: Any) -> None:
    dp.init()


if __name__ == "__main__":
    run_cases(CASES, setup=start, teardown=lambda _: dp.shutdown())
