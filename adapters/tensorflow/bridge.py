"""The bridge from a TensorFlow program into the core's ``GradientScheduler``.

``GradientBridge.reduce(grads, labels)`` is called while a train step is
built (inside ``tf.function``, or eagerly). It adds one ``tf.numpy_function``
op that receives the gradients as numpy arrays (inside ``tf.function``,
views of TensorFlow's own buffers: no copy), copies each into its slice of
the scheduler's fusion
buffer, marks it ready (complete buckets start their all-reduce while later
ones are still being packed), waits in ``synchronize()`` and returns the
reduced gradients in fresh arrays that TensorFlow adopts without another copy.
Fusion, compression, engines, scaling and the first-step layout check are the
core's, shared with PyTorch.

Where replicas come in (``tf.distribute.MirroredStrategy`` with several
devices in this process): in replica context the local replicas' gradients
are first summed in-process with ``ReplicaContext.all_reduce`` (what Keras's
optimizer does itself), then a ``merge_call`` switches to cross-replica
context, where the numpy op runs *once per worker* on that sum: one
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

Distributed contract: the numpy op is a collective. Every rank must run the
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
from typing import Any

import numpy as np

import tensorflow as tf
from dp_plugin import agreement, runtime
from dp_plugin.compression import Compressor
from dp_plugin.engines.base import ReduceOp
from dp_plugin.fusion import TensorSpec
from dp_plugin.scheduler import GradientScheduler

_names = itertools.count()
_names_lock = threading.Lock()


def next_bridge_name(prefix: str) -> str:
    """A process-unique collective name; equal on all ranks that create bridges in the
    same order (the collectives' names must match across ranks)."""
    with _names_lock:
        return f"{prefix}{next(_names)}"


class GradientBridge:
    """Reduce gradients across workers from inside a TensorFlow program.

    Arguments are the core's (``GradientScheduler``): ``op`` (average or
    sum), ``compression`` (a ``Compressor``), ``gradient_predivide_factor``;
    ``name`` prefixes the collectives' names and must be the same on every
    rank. One ``GradientScheduler`` is made per distinct gradient layout, on
    first use (so ``dp_plugin.init()`` must have run by the time a step is
    traced).
    """

    def __init__(
        self,
        *,
        op: ReduceOp,
        compression: Compressor,
        gradient_predivide_factor: float = 1.0,
        name: str,
    ) -> None:
        self.op = op
        self.compression = compression
        self.gradient_predivide_factor = gradient_predivide_factor
        self.name = name
        self._schedulers: dict[tuple[TensorSpec, ...], GradientScheduler] = {}
        self._lock = threading.Lock()
        self.calls = 0
        """Completed or failed numpy callbacks (one per worker per step)."""
        self.seconds = 0.0
        """Wall time spent inside the numpy callback (pack, all-reduce, unpack)."""
        self.error: BaseException | None = None
        """The first exception raised inside the callback (TensorFlow re-wraps it)."""

    @property
    def schedulers(self) -> list[GradientScheduler]:
        """The schedulers made so far (their ``stats`` hold per-step communication times)."""
        return list(self._schedulers.values())

    def same_settings(self, op: ReduceOp, compression: Compressor, predivide: float) -> bool:
        return (
            op is self.op
            and type(compression) is type(self.compression)
            and predivide == self.gradient_predivide_factor
        )

    # -- building the step ----------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def reduce(self, grads: Sequence[Any], labels: Sequence[str]) -> list[Any]:
        """The cross-worker reduction of dense ``grads`` (see the module docstring).

        ``labels`` name the gradients in layout errors; they must be the same
        on every rank. Works in eager mode, in ``tf.function``, in replica
        context (once per worker via ``merge_call``) and in cross-replica
        context. Sparse gradients (``IndexedSlices``) are made dense first.
        """
        tensors = [tf.convert_to_tensor(g) for g in grads]
        if not tensors:
            return []
        sched = self._scheduler(self._specs(tensors, labels))
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return self._exchange_op(sched, tensors)
        local_sum = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tensors)

        def once_per_worker(strategy: Any, *summed: Any) -> Any:
            # Every replica's value is the same local sum: take the first.
            first = [strategy.experimental_local_results(v)[0] for v in summed]
            reduced = self._exchange_op(sched, first)
            return strategy.experimental_distribute_values_from_function(
                lambda rctx: reduced
                if rctx.replica_id_in_sync_group == 0
                else [tf.zeros_like(t) for t in reduced]
            )

        return list(ctx.merge_call(once_per_worker, args=tuple(local_sum)))

    def _specs(self, tensors: Sequence[Any], labels: Sequence[str]) -> tuple[TensorSpec, ...]:
        if len(labels) != len(tensors):
            raise ValueError(
                f"{len(tensors)} gradients but {len(labels)} labels; pass one label per gradient"
            )
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

    def _scheduler(self, specs: tuple[TensorSpec, ...]) -> GradientScheduler:
        engine = runtime.engine()
        with self._lock:
            sched = self._schedulers.get(specs)
            # After shutdown() and init() a step traced anew needs the new engine.
            if sched is None or sched.engine is not engine:
                k = len(self._schedulers)
                sched = GradientScheduler(
                    specs,
                    engine=engine,
                    op=self.op,
                    compression=self.compression,
                    gradient_predivide_factor=self.gradient_predivide_factor,
                    name=self.name if k == 0 else f"{self.name}.{k}",
                    autotune=engine.config.autotune,
                )
                # Checked now, while the step is traced, so that different models
                # fail here with LayoutMismatchError itself on every rank, before any
                # step runs (inside the numpy op TensorFlow would re-wrap it). Every
                # rank traces its train step at the same point; a layout is checked
                # once, here (the scheduler does not repeat it).
                agreement.agree(engine, specs, f"gradients of {sched.name!r}",
                                sched.fused.settings)
                sched.fused.agreed = True
                self._schedulers[specs] = sched
            return sched

    def _exchange_op(self, sched: GradientScheduler, tensors: Sequence[Any]) -> list[Any]:
        outs = tf.numpy_function(
            functools.partial(self._exchange, sched),
            list(tensors),
            [t.dtype for t in tensors],
            stateful=True,
            name="dp_plugin_allreduce",
        )
        if not isinstance(outs, list | tuple):  # eagerly, one output comes back bare
            outs = [outs]
        for out, t in zip(outs, tensors, strict=True):
            out.set_shape(t.shape)
        return list(outs)

    # -- running the step -------------------------------------------------------
    def _exchange(self, sched: GradientScheduler, *arrays: np.ndarray) -> list[np.ndarray]:
        """The numpy callback: pack, all-reduce (via the scheduler), unpack.

        ``arrays`` may be views of TensorFlow's own buffers: they are only read.
        """
        start = time.perf_counter()
        try:
            views = [sched.view_for(i, like=a) for i, a in enumerate(arrays)]
            # Backward produces the last layers' gradients first, and the
            # default plan puts them in the first buckets: marking in that
            # order launches each bucket as soon as it is packed.
            for i in reversed(range(len(arrays))):
                np.copyto(views[i], arrays[i], casting="no")
                sched.mark_ready(i, views[i])
            sched.synchronize()
            return [_adoptable_copy(v) for v in views]
        except BaseException as exc:
            if self.error is None:
                self.error = exc
            raise
        finally:
            self.calls += 1
            self.seconds += time.perf_counter() - start


def _adoptable_copy(src: np.ndarray) -> np.ndarray:
    """A copy of ``src`` in fresh 64-byte-aligned memory.

    TensorFlow adopts an aligned array returned by a numpy op without copying
    it (an unaligned one is copied again); fresh memory is needed because the
    adopted array must not be touched afterwards, and the fusion buffer is
    reused by the next step.
    """
    raw = np.empty(src.nbytes + 64, dtype=np.uint8)
    offset = -raw.ctypes.data % 64
    out = raw[offset : offset + src.nbytes].view(src.dtype).reshape(src.shape)
    np.copyto(out, src)
    return out
