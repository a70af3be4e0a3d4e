"""``DistributedGradientTape``: a ``tf.GradientTape`` whose gradients are reduced
across workers, for custom training loops (Horovod's)."""

from __future__ import annotations

import threading
from typing import Any

import tensorflow as tf
from dp_plugin.tensorflow.bridge import GradientBridge, next_bridge_name
from dp_plugin.tensorflow.ops import Average, Compression
from dp_plugin.tensorflow.optimizer import parse_reduction, reduce_present

# Custom loops make a new tape every step: the bridge (and with it the
# scheduler, its fusion buffers and the traced numpy op's target) is shared
# by every tape with the same settings.
_bridges: dict[tuple[Any, ...], GradientBridge] = {}
_bridges_lock = threading.Lock()


class DistributedGradientTape:
    """Wrap a ``tf.GradientTape``; ``gradient()`` returns gradients reduced across workers.

    ::

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = dp.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    Works eagerly and inside ``tf.function``. Gradients are averaged by
    default (``op=dp.Sum`` sums), optionally compressed on the wire
    (``compression``) and pre-divided (``gradient_predivide_factor``), with
    the core's fusion buckets. Sparse gradients (``tf.IndexedSlices``) are
    all-gathered as in Horovod, or all-reduced dense with
    ``sparse_as_dense=True`` (see ``sparse.py``). Other tape
    methods (``watch``, ``jacobian``, ...) pass through to the wrapped tape.

    Under ``MirroredStrategy`` (inside ``strategy.run``), the replicas'
    gradients are summed in-process and reduced once per worker; the result is
    returned on the first replica and zeros on the others, so that a Keras
    optimizer's ``apply_gradients`` (which sums the replicas) applies exactly
    the cross-worker result.

    Distributed contract: ``gradient()`` is a collective; every rank calls it
    for the same sources (same shapes, dtypes, order) in the same order.
    Broadcast the initial state with ``dp.broadcast_variables`` first.
    """

    def __init__(
        self,
        gradtape: tf.GradientTape,
        compression: Any = Compression.none,
        sparse_as_dense: bool = False,
        op: Any = Average,
        gradient_predivide_factor: float = 1.0,
    ) -> None:
        who = "DistributedGradientTape"
        if isinstance(gradtape, DistributedGradientTape):
            raise ValueError(
                f"{who}: the tape is already a DistributedGradientTape; wrapping it twice "
                "would reduce the gradients twice. Wrap the tf.GradientTape once"
            )
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError(f"{who} wraps a tf.GradientTape, got {type(gradtape).__name__}")
        self._tape = gradtape
        self._sparse_as_dense = bool(sparse_as_dense)
        parsed_op, compressor, _, predivide = parse_reduction(
            who, op, compression, 1, gradient_predivide_factor)
        self._bridge = _shared_bridge(parsed_op, compressor, predivide)

    @tf.autograph.experimental.do_not_convert
    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
    ) -> Any:
        """``tf.GradientTape.gradient``, then the cross-worker reduction. Collective."""
        grads = self._tape.gradient(
            target, sources, output_gradients=output_gradients,
            unconnected_gradients=unconnected_gradients,
        )
        flat_grads = reduce_present(self._bridge, tf.nest.flatten(grads),
                                    tf.nest.flatten(sources), self._sparse_as_dense)
        return tf.nest.pack_sequence_as(grads, flat_grads)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tape.__exit__(*exc)


def _shared_bridge(op: Any, compression: Any, predivide: float) -> GradientBridge:
    key = (op, type(compression), predivide)
    with _bridges_lock:
        bridge = _bridges.get(key)
        if bridge is None:
            bridge = GradientBridge(
                op=op, compression=compression, gradient_predivide_factor=predivide,
                name=next_bridge_name("tape"),
            )
            _bridges[key] = bridge
        return bridge
