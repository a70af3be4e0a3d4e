"""Tensor collectives on ``tf.Tensor`` / ``tf.Variable`` / numpy values, as ``horovod.tensorflow``.

``allreduce``, ``grouped_allreduce``, ``allgather``, ``grouped_allgather``,
``broadcast``, ``alltoall``, ``reducescatter`` and ``grouped_reducescatter``
work eagerly and inside ``tf.function`` (where they become one
``tf.numpy_function`` op each, with the output shapes and dtypes set), and
have Horovod 0.28.1's gradients:

- allreduce: the gradient is all-reduced with the same op and scale factors;
- allgather: the gradient is averaged over the ranks, and each rank keeps
  the rows its input contributed;
- broadcast: the gradient is averaged over the ranks on the root, zero elsewhere;
- alltoall: the gradient travels back (alltoall with the received splits);
- reducescatter: the gradient is all-gathered (times the set size for Sum,
  times the scale factors).

Every collective takes the torch adapter's path: the core's one check
(``dp_plugin.agree.check``: a shape, dtype, op, root or splits mismatch
raises on every rank, with the same messages), then the engine moves the
agreed bytes — all-reduces through a ``Reducer`` run (one fused buffer per
dtype), reduce-scatters scaled by the one ``ReducePolicy``.

Distributed contract: every rank of the process set calls the same
collectives in the same order with matching inputs. Errors are Horovod's
TensorFlow types eagerly and in graphs (``errors.py``, ``run_op``):
``FailedPreconditionError`` when ranks disagree, ``InvalidArgumentError``
for a rank's bad argument, with the core's message.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import tensorflow as tf
from dp_plugin.agree.check import check
from dp_plugin.agree.edge import caller, deferred, public
from dp_plugin.agree.request import Request
from dp_plugin.api import horovod_names as _names
from dp_plugin.api.horovod_names import Compression
from dp_plugin.api.process_sets import engine_of, global_process_set
from dp_plugin.engines.base import ReduceOp
from dp_plugin.launch import runtime
from dp_plugin.reduce.arrays import NumpyOps
from dp_plugin.reduce.collective import fused_collective
from dp_plugin.reduce.compression import Compressor, get_compressor
from dp_plugin.reduce.hooks import ReducePolicy
from dp_plugin.tensorflow import errors as tf_errors
from dp_plugin.tensorflow import graph_gradient, graph_order, status_op
from dp_plugin.validate import check_positive_float


@tf.autograph.experimental.do_not_convert
def run_op(fn: Callable[..., Sequence[np.ndarray]], inputs: Sequence[Any],
           dtypes: Sequence[Any], shapes: Sequence[Any], name: str) -> list[Any]:
    """``fn`` on numpy values: called directly when eager, a ``tf.numpy_function``
    op (with ``shapes`` set on its outputs) inside ``tf.function`` or a TF1 graph,
    ordered after the graph's previous dp_plugin op (``graph_order``).

    Errors are Horovod's types (``dp_plugin.tensorflow.errors``) in both: in a
    graph ``fn``'s typed error travels as a code and message to a
    ``status_op`` that fails the step with them (TensorFlow would retype an
    exception raised by the numpy callback); the outputs depend on that op.
    ``fn`` runs under this call's name (``dp_plugin.agree.edge``).
    """
    fn = deferred(tf_errors.translated(fn))
    if tf.executing_eagerly():
        arrays = fn(*[np.asarray(t) for t in inputs])
        return [tf.convert_to_tensor(np.asarray(o, dtype=tf.as_dtype(d).as_numpy_dtype))
                for o, d in zip(arrays, dtypes, strict=True)]
    typed = status_op.library() is not None  # else warned: TensorFlow's own error types
    fillers = [_filler(shape, dtype) for shape, dtype in zip(shapes, dtypes, strict=True)]

    def reporting(*arrays: np.ndarray) -> list[Any]:
        try:
            return [*fn(*arrays), np.int32(0), b""]
        except tf.errors.OpError as error:  # a core error, typed by ``translated``
            if not typed:
                raise
            return [*fillers, np.int32(error.error_code), error.message.encode()]

    *outs, code, message = graph_order.ordered(lambda: tf.numpy_function(
        reporting, list(inputs), [*dtypes, tf.int32, tf.string], stateful=True, name=name))
    if typed:
        with tf.control_dependencies([status_op.fail_on(code, message)]):
            outs = [tf.identity(out) for out in outs]
    for out, shape in zip(outs, shapes, strict=True):
        out.set_shape(shape)
    return outs


def _filler(shape: Any, dtype: Any) -> np.ndarray:
    """Zeros that fit ``shape`` (unknown dimensions 0): the outputs of a failed step."""
    shape = tf.TensorShape(shape)
    dims = [] if shape.rank is None else [d or 0 for d in shape.as_list()]
    return np.zeros(dims, tf.as_dtype(dtype).as_numpy_dtype)


def _differentiable(outs: list[Any], backward: Callable[..., list[Any]], xs: list[Any],
                    side: int = 0) -> list[Any]:
    """``outs`` (computed from ``xs``) with ``backward(*dys)`` as their gradient (floating
    inputs only; others have no gradient in TensorFlow either). The last ``side`` outputs
    (row counts, received splits) are not differentiated; ``backward`` gets them first:
    ``backward(*side_outputs, *dys)``."""
    ys, kept = outs[:len(outs) - side], outs[len(outs) - side:]
    if not all(x.dtype.is_floating for x in xs):
        return [*ys, *kept]
    backward = deferred(backward)  # run by the tape later, under this call's name
    return [*graph_gradient.with_gradient(ys, xs, lambda *dys: backward(*kept, *dys)), *kept]


def _writable(array: np.ndarray) -> np.ndarray:
    """``array`` as the engines take it: C-contiguous and writable (TensorFlow's
    buffers are read-only views; copied only then)."""
    return np.require(array, requirements=["C", "W"])


def _tensors(values: Any) -> list[Any]:
    if not isinstance(values, list | tuple):
        raise TypeError(f"{caller()} takes a list of tensors, got {type(values).__name__}")
    return [tf.convert_to_tensor(v) for v in values]


def parse_compression(compression: object) -> Compressor:
    """A compressor from ``Compression.x``, a name ('none', 'fp16', 'bf16') or an object."""
    try:
        return get_compressor(compression)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"{caller()}: {exc}; use dp.Compression.none/fp16/bf16") from None


resolve_op = functools.partial(_names.resolve_op, prefix="",
                               instead="Average, Sum, Min, Max or Product")
"""Horovod's ``op=None`` (Average) and deprecated ``average=`` flag."""


@public("allreduce")
def allreduce(tensor: Any, average: Any = None, device_dense: str = "",
              device_sparse: str = "", compression: Any = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: str | None = None, process_set: Any = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` over the process set (Average by default): a new tensor of the
    same shape and dtype. A ``tf.IndexedSlices`` is all-gathered (values and indices;
    values divided by the set size for Average), as Horovod does."""
    op = resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return reduce_indexed_slices(tensor, op, prescale_factor, postscale_factor, process_set)
    return grouped_allreduce([tensor], None, compression=compression, op=op,
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             name=name or "allreduce", process_set=process_set)[0]


@public("grouped_allreduce")
def grouped_allreduce(tensors: Sequence[Any], average: Any = None, device_dense: str = "",
                      device_sparse: str = "", compression: Any = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = global_process_set,
                      ignore_name_scope: bool = False, name: str | None = None) -> list[Any]:
    """``allreduce`` of a list, fused into one collective per dtype."""
    op = resolve_op(op, average)
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        return [reduce_indexed_slices(t, op, prescale_factor, postscale_factor, process_set)
                if isinstance(t, tf.IndexedSlices)
                else allreduce(t, compression=compression, op=op, process_set=process_set,
                               prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor) for t in tensors]
    xs = _tensors(tensors)
    pre = check_positive_float("prescale_factor", prescale_factor, where="grouped_allreduce")
    post = check_positive_float("postscale_factor", postscale_factor, where="grouped_allreduce")
    compressor = parse_compression(compression)
    engine_of(process_set)  # not a member: fails here, while tracing
    label = name or "grouped_allreduce"

    def reduce(*arrays: np.ndarray) -> list[np.ndarray]:
        engine = engine_of(process_set)
        # New outputs, filled bucket by bucket from the inputs (fused_collective).
        outs = [np.empty_like(a, order="C") for a in arrays]
        check(engine, Request.of("allreduce", outs, name=label, op=op, scales=(pre, post)))
        fused_collective(outs, engine=engine, name=label, compression=compressor,
                         policy=ReducePolicy(op, engine.size, prescale=pre, postscale=post),
                         sources=arrays).finish()
        return outs

    def forward(*args: Any) -> list[Any]:
        return run_op(reduce, args, [x.dtype for x in args], [x.shape for x in args],
                      "grouped_allreduce")

    return _differentiable(forward(*xs), forward, xs) if xs else []


def reduce_indexed_slices(slices: Any, op: ReduceOp, prescale: float, postscale: float,
                          process_set: Any) -> Any:
    """Horovod's sparse all-reduce: all-gather values and indices (an IndexedSlices
    whose duplicate indices add up); Average divides the values by the set size."""
    _names.require_sum_or_average(
        op, "is not supported with tf.IndexedSlices (only Sum and Average are)", prefix="dp.",
        otherwise=", pass sparse_as_dense=True or convert with tf.convert_to_tensor",
        error=NotImplementedError)
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError(
            f"{caller()}: prescale_factor/postscale_factor are not supported with tf.IndexedSlices "
            f"(got {prescale}, {postscale}); scale the values yourself")
    values, indices = grouped_allgather([slices.values, slices.indices], process_set=process_set)
    if op is ReduceOp.AVERAGE:
        values = values / tf.cast(engine_of(process_set).size, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: Any = global_process_set) -> Any:
    """Concatenate every rank's ``tensor`` along the first dimension (which may differ)."""
    return grouped_allgather([tensor], name=name or "allgather", process_set=process_set)[0]


@public("grouped_allgather")
def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      ignore_name_scope: bool = False,
                      process_set: Any = global_process_set) -> list[Any]:
    """``allgather`` of each tensor of a list."""
    xs = _tensors(tensors)
    engine_of(process_set)
    label = name or "grouped_allgather"
    if any(x.shape.rank == 0 for x in xs):
        raise ValueError("grouped_allgather: a scalar cannot be all-gathered; reshape it to [1]")

    def gather(*arrays: np.ndarray) -> list[np.ndarray]:
        engine = engine_of(process_set)
        bufs = [_writable(a) for a in arrays]
        agreed = check(engine, Request.of("allgather", bufs, name=label))
        outs = [np.asarray(engine.allgather(b, agreed.rows(i), f"{label}.{i}"))
                for i, b in enumerate(bufs)]
        firsts = np.array([agreed.rows(i) for i in range(len(bufs))], np.int64).T
        return [*outs, np.ascontiguousarray(firsts)]

    outs = run_op(gather, xs, [*(x.dtype for x in xs), tf.int64],
                  [*([None, *x.shape[1:]] for x in xs), [None, len(xs)]], "grouped_allgather")

    def backward(firsts: Any, *dys: Any) -> list[Any]:
        me = engine_of(process_set).rank
        reduced = grouped_allreduce(list(dys), op=ReduceOp.AVERAGE, process_set=process_set,
                                    name=f"{label}.grad")
        out = []
        for i, dy in enumerate(reduced):
            start = tf.reduce_sum(firsts[:me, i])
            out.append(dy[start:start + firsts[me, i]])
        return out

    return _differentiable(outs, backward, xs, side=1)[:-1]


@public("broadcast")
def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              ignore_name_scope: bool = False, process_set: Any = global_process_set) -> Any:
    """``root_rank``'s ``tensor`` on every rank of the set (``root_rank`` is job-wide)."""
    (x,) = _tensors([tensor])
    engine_of(process_set)  # not a member: fails here, while tracing
    # A bad root_rank is the callback's check's Problem.BAD_ROOT, raised on every
    # rank (checked here it failed only this rank, and the others waited).
    label = name or "broadcast"

    def bcast(array: np.ndarray) -> list[np.ndarray]:
        engine = engine_of(process_set)
        out = np.array(array, order="C", copy=True)  # TensorFlow may adopt it
        agreed = check(engine, Request.of("broadcast", [out], name=label, root=root_rank))
        if out.size:
            engine.broadcast(out.reshape(-1), agreed.root, name=label)
        return [out]

    def backward(dy: Any) -> list[Any]:
        (reduced,) = grouped_allreduce([dy], op=ReduceOp.AVERAGE, process_set=process_set,
                                       name=f"{label}.grad")
        return [reduced if runtime.rank() == root_rank else reduced * 0]

    return _differentiable(run_op(bcast, [x], [x.dtype], [x.shape], "broadcast"), backward, [x])[0]


@public("alltoall")
def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False, process_set: Any = global_process_set) -> Any:
    """Send ``splits[j]`` rows (default: equal parts) to rank j; return the rows
    received, in rank order, and (when ``splits`` is given) how many came from each rank."""
    (x,) = _tensors([tensor])
    size = engine_of(process_set).size
    label = name or "alltoall"
    given = splits is not None
    s = (tf.cast(tf.reshape(tf.convert_to_tensor(splits), [-1]), tf.int64) if given
         else tf.constant([], tf.int64))

    def exchange(array: np.ndarray, sp: np.ndarray) -> list[np.ndarray]:
        engine = engine_of(process_set)
        buf = _writable(array)
        agreed = check(engine, Request.of("alltoall", [buf], name=label,
                                          splits=[int(c) for c in sp] if given else None))
        received, counts = engine.alltoall(buf, agreed.counts(), label)
        return [np.asarray(received), np.asarray(counts, np.int64)]

    def backward(rsplits: Any, dy: Any) -> list[Any]:
        return [alltoall(dy, rsplits, name=f"{label}.grad", process_set=process_set)[0]]

    outs = run_op(exchange, [x, s], [x.dtype, tf.int64], [[None, *x.shape[1:]], [size]],
                  "alltoall")
    out, rsplits = _differentiable(outs, backward, [x], side=1)
    return (out, tf.cast(rsplits, tf.int32)) if given else out


def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none,
                  op: Any = ReduceOp.AVERAGE, name: str | None = None,
                  process_set: Any = global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
    """Reduce ``tensor`` over the set (Average by default) and return this rank's block of
    rows: ``rows // size`` each, the first ``rows % size`` ranks one more."""
    return grouped_reducescatter([tensor], op=op, name=name or "reducescatter",
                                 process_set=process_set, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor)[0]


@public("reducescatter")
def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: Any = Compression.none, op: Any = ReduceOp.AVERAGE,
                          name: str | None = None, process_set: Any = global_process_set,
                          ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[Any]:
    """``reducescatter`` of each tensor of a list."""
    op = resolve_op(op, None)
    xs = _tensors(tensors)
    pre = check_positive_float("prescale_factor", prescale_factor, where="reducescatter")
    post = check_positive_float("postscale_factor", postscale_factor, where="reducescatter")
    size = engine_of(process_set).size
    label = name or "reducescatter"

    def scatter(*arrays: np.ndarray) -> list[np.ndarray]:
        # The torch adapter's path (``start_reducescatters``): one check, then
        # per tensor the policy's pre-scale, the engine's op, the post-scale.
        engine = engine_of(process_set)
        bufs = [np.array(a, order="C", copy=True) for a in arrays]
        check(engine, Request.of("reducescatter", bufs, name=label, op=op, scales=(pre, post)))
        policy = ReducePolicy(op, engine.size, prescale=pre, postscale=post)
        ops, outs = NumpyOps(), []
        for i, buf in enumerate(bufs):
            ops.scale_(buf, policy.prescale)
            out = np.asarray(engine.reducescatter(buf, policy.engine_op, f"{label}.{i}"))
            ops.scale_(out, policy.postscale)
            outs.append(out)
        return outs

    def backward(*dys: Any) -> list[Any]:
        factor = (size if op is ReduceOp.SUM else 1) * pre * post
        return [allgather(dy * factor if factor != 1 else dy, name=f"{label}.grad.{i}",
                          process_set=process_set) for i, dy in enumerate(dys)]

    outs = run_op(scatter, xs, [x.dtype for x in xs], [[None, *x.shape[1:]] for x in xs],
                  "reducescatter")
    return _differentiable(outs, backward, xs)
