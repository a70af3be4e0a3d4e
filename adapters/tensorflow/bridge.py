"""The bridge from a TensorFlow program into the core's ``Reducer``.

``GradientBridge.reduce(grads, labels)`` is called while a train step is
built (inside ``tf.function``, or eagerly). It adds one ``tf.numpy_function``
op per fusion bucket of the scheduler's plan, in bucket order (the last
layers' gradients first), and one op that finishes the step:

- a bucket's op receives its gradients as numpy arrays (inside
  ``tf.function``, views of TensorFlow's own buffers: no copy), copies each
  into its slice of the fusion buffer and marks it ready, which starts the
  bucket's all-reduce and returns at once. TensorFlow's executor runs it as
  soon as those gradients exist, so the all-reduce of the last layers
  overlaps the backward pass of the first ones;
- the finishing op waits in ``synchronize()`` and returns the reduced
  gradients: the fusion buffer's own slices (64-byte aligned, so TensorFlow
  adopts them without a copy) when the caller consumes them before the next
  step (``results_alias_buffers=True``, the optimizer's hook), else fresh
  aligned copies (the tape, whose caller may keep the gradients).

Fusion, compression, engines, scaling and the first-step layout check are the
core's, shared with PyTorch. The ops are built with ``graph_order.ordered``
(each after the graph's previous dp_plugin op), so every rank marks and
launches the buckets in the same order, and runs the step's all-reduce in
the same place among the graph's other collectives.

Where replicas come in (``tf.distribute.MirroredStrategy`` with several
devices in this process): in replica context the local replicas' gradients
are first summed in-process with ``ReplicaContext.all_reduce`` (what Keras's
optimizer does itself), then a ``merge_call`` switches to cross-replica
context, where the numpy ops run *once per worker* on that sum: one
cross-worker all-reduce per fusion bucket, not one per replica. The result
goes back to the first replica and zeros to the others, because Keras's
TensorFlow optimizer sums the replicas' gradients again inside ``apply()``
(see ``compat``); ``x + 0 == x`` exactly, so the applied gradient is the
cross-worker result bit for bit.

Why all ranks stay identical: every rank adds the same ops in the same order,
the engines' all-reduce (a ring, or MPI's) hands every rank the same bytes,
and the scaling (average, predivide) is the same arithmetic everywhere; the
gradient applied next is therefore bitwise equal on all ranks, and so are
the weights, given equal starting state (the callbacks broadcast it).

Distributed contract: the numpy ops are collectives. Every rank must run the
same steps with gradients of the same shapes, dtypes and order; a new layout
is checked when the step is traced (``LayoutMismatchError`` on every rank,
before any step runs). Bridges are named in creation order ("keras0",
"tape1", ...), and Horovod's engine matches collectives by name: every rank
must create its distributed optimizers, callbacks and tapes in the same order.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import tensorflow as tf
from dp_plugin.api.timeline import shared_timeline
from dp_plugin.engines.base import ReduceOp
from dp_plugin.launch import runtime
from dp_plugin.reduce.arrays import NumpyOps, numpy_dtype
from dp_plugin.reduce.compression import Compressor
from dp_plugin.reduce.fusion import TensorSpec
from dp_plugin.reduce.hooks import ReducePolicy
from dp_plugin.reduce.reducer import Reducer
from dp_plugin.tensorflow import graph_order

_names = itertools.count()
_names_lock = threading.Lock()


def next_bridge_name(prefix: str) -> str:
    """A process-unique collective name; equal on all ranks that create bridges in the
    same order (the collectives' names must match across ranks)."""
    with _names_lock:
        return f"{prefix}{next(_names)}"


@dataclass(kw_only=True, eq=False)
class GradientBridge:
    """Reduce gradients across workers from inside a TensorFlow program.

    One ``Reducer`` per distinct gradient layout, made on first use (so
    ``dp_plugin.init()`` must have run by the time a step is traced), with
    the core's ``op``, ``compression`` and ``gradient_predivide_factor``;
    ``name`` prefixes the collectives' names, the same on every rank.
    ``results_alias_buffers``: see the module docstring. ``groups``: Horovod's
    ``groups=``, validated; the caller resolves it per step (``reduce``).
    """

    op: ReduceOp
    compression: Compressor
    name: str
    gradient_predivide_factor: float = 1.0
    results_alias_buffers: bool = False
    groups: Any = None
    calls: int = field(default=0, init=False)
    """Completed or failed steps (finishing numpy callbacks; one per worker per step)."""
    seconds: float = field(default=0.0, init=False)
    """Wall time spent inside the numpy callbacks (pack and launch, waiting for the
    all-reduce, handing the results back)."""
    _schedulers: dict[tuple[tuple[TensorSpec, ...], tuple[tuple[int, ...], ...]], Reducer] = (
        field(default_factory=dict, init=False, repr=False))
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def schedulers(self) -> list[Reducer]:
        """The schedulers made so far (their ``stats`` hold per-step communication times)."""
        return list(self._schedulers.values())

    # -- building the step ----------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def reduce(self, grads: Sequence[Any], labels: Sequence[str],
               groups: Sequence[Sequence[int]] = ()) -> list[Any]:
        """The cross-worker reduction of dense ``grads`` (see the module docstring).

        ``labels`` name the gradients in layout errors, the same on every rank.
        ``groups`` (lists of indices into ``grads``) are reduced as one bucket
        each. Sparse gradients (``IndexedSlices``) are made dense first.
        """
        tensors = [tf.convert_to_tensor(g) for g in grads]
        if not tensors:
            return []
        sched = self._scheduler(self._specs(tensors, labels),
                                tuple(tuple(group) for group in groups))
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return self._exchange_ops(sched, tensors)
        local_sum = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tensors)

        def once_per_worker(strategy: Any, *summed: Any) -> Any:
            # Every replica's value is the same local sum: take the first.
            first = [strategy.experimental_local_results(v)[0] for v in summed]
            reduced = self._exchange_ops(sched, first)
            return strategy.experimental_distribute_values_from_function(
                lambda rctx: reduced
                if rctx.replica_id_in_sync_group == 0
                else [tf.zeros_like(t) for t in reduced]
            )

        return list(ctx.merge_call(once_per_worker, args=tuple(local_sum)))

    def _specs(self, tensors: Sequence[Any], labels: Sequence[str]) -> tuple[TensorSpec, ...]:
        specs = []
        for label, t in zip(labels, tensors, strict=True):
            if not t.shape.is_fully_defined():
                raise ValueError(
                    f"the gradient of {label!r} has shape {t.shape}, which is not fully "
                    "known when the step is built; dp_plugin needs static gradient shapes "
                    "(the variables' shapes)"
                )
            specs.append(TensorSpec(label, tuple(t.shape.as_list()), t.dtype.name))
        return tuple(specs)

    def _scheduler(self, specs: tuple[TensorSpec, ...],
                   groups: tuple[tuple[int, ...], ...]) -> Reducer:
        engine = runtime.engine()
        with self._lock:
            sched = self._schedulers.get((specs, groups))
            # After shutdown() and init() a step traced anew needs the new engine.
            if sched is None or sched.engine is not engine:
                k = len(self._schedulers)
                # Arguments validated at the public edge (``parse_reduction``).
                name = self.name if k == 0 else f"{self.name}.{k}"
                sched = Reducer(
                    specs,
                    engine=engine,
                    policy=ReducePolicy(self.op, engine.size,
                                        predivide=self.gradient_predivide_factor),
                    passes=1,  # DistributedApply accumulates the passes itself
                    compression=self.compression,
                    name=name,
                    timeline=shared_timeline,  # hvd.start_timeline() reaches it
                    autotune=engine.config.autotune,
                    array_ops=AlignedNumpyOps(),
                    what=f"gradients of {name!r}",
                    groups=groups,
                )
                # Checked once, here, while every rank traces its step: different models
                # raise LayoutMismatchError itself on every rank before any step runs
                # (inside the numpy op TensorFlow would re-wrap it).
                sched.agree()
                self._schedulers[specs, groups] = sched
            return sched

    def _exchange_ops(self, sched: Reducer, tensors: Sequence[Any]) -> list[Any]:
        """One launching op per bucket of the current plan, then the finishing op."""
        tokens = []
        for bucket in sched.plan:
            members = list(bucket.members)
            tokens.append(graph_order.ordered(functools.partial(
                tf.numpy_function, functools.partial(self._launch, sched, members),
                [tensors[i] for i in members], tf.int32, stateful=True,
                name="dp_plugin_launch")))
        outs = graph_order.ordered(functools.partial(
            tf.numpy_function, functools.partial(self._finish, sched), tokens,
            [t.dtype for t in tensors], stateful=True, name="dp_plugin_allreduce"))
        if not isinstance(outs, list | tuple):  # eagerly, one output comes back bare
            outs = [outs]
        for out, t in zip(outs, tensors, strict=True):
            out.set_shape(t.shape)
        return list(outs)

    # -- running the step -------------------------------------------------------
    def _launch(self, sched: Reducer, members: list[int],
                *arrays: np.ndarray) -> np.ndarray:
        """A bucket's numpy callback: copy its gradients into the fusion buffer and mark
        them ready (the scheduler starts the all-reduce of every complete bucket).

        ``arrays`` may be views of TensorFlow's own buffers: they are only read.
        """
        start = time.perf_counter()
        try:
            for i, array in zip(members, arrays, strict=True):
                view = sched.view_for(i, like=array)
                np.copyto(view, array, casting="no")
                sched.mark_ready(i, view)
            return np.array(len(members), dtype=np.int32)
        finally:
            self.seconds += time.perf_counter() - start

    def _finish(self, sched: Reducer, *tokens: Any) -> list[np.ndarray]:
        """The step's last numpy callback: wait for every bucket, return the results."""
        start = time.perf_counter()
        try:
            reduced = sched.synchronize()
            if self.results_alias_buffers:
                return list(reduced)
            return [_adoptable_copy(r) for r in reduced]
        finally:
            self.calls += 1
            self.seconds += time.perf_counter() - start


class AlignedNumpyOps(NumpyOps):
    """Numpy buffers on 64-byte boundaries: TensorFlow adopts a returned slice that
    starts on one without copying it (an unaligned one it copies again)."""

    def empty(self, numel: int, dtype: str, device: str) -> np.ndarray:
        super().empty(0, dtype, device)  # the device check
        return _aligned_empty(numel, np.dtype(numpy_dtype(dtype)))


def _aligned_empty(numel: int, dtype: np.dtype) -> np.ndarray:
    raw = np.empty(numel * dtype.itemsize + 64, dtype=np.uint8)
    offset = -raw.ctypes.data % 64
    return raw[offset : offset + numel * dtype.itemsize].view(dtype)


def _adoptable_copy(src: np.ndarray) -> np.ndarray:
    """A copy of ``src`` in fresh 64-byte-aligned memory (adopted by TensorFlow
    without another copy; fresh because the fusion buffer is reused next step)."""
    out = _aligned_empty(src.size, src.dtype).reshape(src.shape)
    np.copyto(out, src)
    return out
