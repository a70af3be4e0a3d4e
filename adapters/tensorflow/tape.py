"""``DistributedGradientTape``: a ``tf.GradientTape`` whose gradients are reduced
across workers, for custom training loops (Horovod's)."""

from __future__ import annotations

import threading
from typing import Any

import keras

import tensorflow as tf
from dp_plugin.api.horovod_names import Average, Compression
from dp_plugin.launch import runtime
from dp_plugin.tensorflow.bridge import GradientBridge, next_bridge_name
from dp_plugin.tensorflow.optimizer import parse_reduction
from dp_plugin.tensorflow.sparse import reduce_gradients
from dp_plugin.tensorflow.util import variable_ref
from dp_plugin.validate import check_groups

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
    ``sparse_as_dense=True`` (see ``sparse.py``). ``groups`` (or the older
    ``num_groups``), as Horovod's and the optimizer's: each group of
    gradients is reduced as one bucket, once all of it is ready. Other tape
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
        scale_local_gradients: bool = True,
        num_groups: int = 0,
        groups: Any = None,
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
        groups = check_groups(groups, num_groups, (tf.Variable, keras.Variable), "tf.Variable")
        self._bridge = _shared_bridge(parsed_op, compressor, predivide, groups)
        self._local_sources: dict[Any, Any] = {}  # variable_ref(source) -> source
        self.scale_local_gradients = bool(scale_local_gradients)

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient on this worker (Horovod's): it is not reduced,
        only divided by the number of ranks when ``scale_local_gradients`` (the
        default), so that its step size matches the averaged ones. Every rank
        must register the same sources (the reduced set must match)."""
        self._local_sources[variable_ref(source)] = source

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
        flat_grads, flat_sources = tf.nest.flatten(grads), tf.nest.flatten(sources)
        local = [variable_ref(s) in self._local_sources for s in flat_sources]
        shared = [None if is_local else g for g, is_local in zip(flat_grads, local, strict=True)]
        reduced = reduce_gradients(self._bridge, shared, flat_sources, self._sparse_as_dense)
        scale = self.scale_local_gradients
        out = [(_scaled_locally(g) if scale and g is not None else g) if is_local else r
               for g, r, is_local in zip(flat_grads, reduced, local, strict=True)]
        return tf.nest.pack_sequence_as(grads, out)

    def get_local_and_global_gradients(self, target: Any, sources: Any,
                                       output_gradients: Any = None) -> Any:
        """``gradient()``, split into ``(local (source, gradient) pairs, global pairs)``."""
        grads = self.gradient(target, sources, output_gradients=output_gradients)
        pairs = list(zip(tf.nest.flatten(sources), tf.nest.flatten(grads), strict=True))
        local = [(s, g) for s, g in pairs if variable_ref(s) in self._local_sources]
        shared = [(s, g) for s, g in pairs if variable_ref(s) not in self._local_sources]
        return local, shared

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tape.__exit__(*exc)


def _scaled_locally(grad: Any) -> Any:
    """A worker-local gradient divided by the number of ranks (Horovod's scaling)."""
    size = tf.cast(runtime.size(), grad.dtype)
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / size, grad.indices, grad.dense_shape)
    return grad / size


def PartialDistributedGradientTape(
    gradtape: tf.GradientTape, compression: Any = Compression.none,
    sparse_as_dense: bool = False, op: Any = Average, gradient_predivide_factor: float = 1.0,
    local_layers: Any = None, scale_local_gradients: bool = True,
) -> DistributedGradientTape:
    """A ``DistributedGradientTape`` that keeps the gradients of ``local_layers``'
    trainable weights on this worker (``register_local_source``), as Horovod's."""
    layers = [] if local_layers is None else (
        [local_layers] if isinstance(local_layers, keras.layers.Layer) else list(local_layers))
    if not all(isinstance(layer, keras.layers.Layer) for layer in layers):
        raise ValueError(
            "PartialDistributedGradientTape: local_layers takes keras layers, got "
            f"{[type(layer).__name__ for layer in layers]}")
    tape = DistributedGradientTape(gradtape, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, scale_local_gradients)
    for layer in layers:
        for weight in layer.trainable_weights:
            tape.register_local_source(weight)
    return tape


def _shared_bridge(op: Any, compression: Any, predivide: float, groups: Any) -> GradientBridge:
    key = (op, type(compression), predivide, groups if not isinstance(groups, list) else
           tuple(tuple(variable_ref(v) for v in group) for group in groups))
    with _bridges_lock:
        if key not in _bridges:
            _bridges[key] = GradientBridge(op=op, compression=compression, groups=groups,
                                           gradient_predivide_factor=predivide,
                                           name=next_bridge_name("tape"))
        return _bridges[key]
