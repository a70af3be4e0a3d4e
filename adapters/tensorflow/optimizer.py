"""Cross-worker gradient reduction installed into a Keras 3 optimizer.

Where the hook sits: on one optimizer instance, ``apply`` is replaced by a
``DistributedApply`` that reduces the gradients across workers (through the
bridge, ``dp_plugin.tensorflow.bridge``) and then calls the class's own
``apply`` with the result. Every Keras update goes through it:
``train_step`` -> ``apply_gradients`` -> ``self.apply``. For a
``LossScaleOptimizer`` (mixed precision) the hook is on the loss-scale
optimizer itself, not on its inner one.

Why at the entry of ``apply`` rather than right after Keras's local replica
sum (``_all_reduce_sum_gradients``, deep inside ``apply``):

- ``LossScaleOptimizer`` decides whether to skip a step (non-finite
  gradients) before it calls the inner optimizer. Decided on local gradients,
  one rank could skip while another applies (diverged weights), and the rank
  that skips would leave the others waiting in their all-reduce. Reduced
  first, every rank tests the same (consistently scaled: the loss scale is
  broadcast and then evolves identically) gradient and takes the same
  decision. A non-finite gradient on any rank makes the sum non-finite
  everywhere.
- Gradient clipping (``clipnorm``, ``global_clipnorm``) runs before that
  local sum too; here it clips the global gradient, as a single process would.
- Only a public method is replaced; the private one is merely relied upon to
  keep summing replicas (``compat`` pins the Keras versions).

The class is not changed (no dynamic subclass): the instance gets an
attribute ``apply``, removed when the hook is moved or replaced. It is
written to the instance ``__dict__`` directly so that Keras's attribute
tracking does not treat the hook as optimizer state (it must not end up in
checkpoints).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import keras

import tensorflow as tf
from dp_plugin.agree.edge import calling
from dp_plugin.api import horovod_names as _names
from dp_plugin.api.horovod_names import Average, Compression
from dp_plugin.engines.base import ReduceOp
from dp_plugin.errors import DPPluginError
from dp_plugin.reduce.compression import Compressor
from dp_plugin.reduce.hooks import ReducePolicy
from dp_plugin.tensorflow.bridge import GradientBridge, next_bridge_name
from dp_plugin.tensorflow.collectives import parse_compression
from dp_plugin.tensorflow.compat import UnsupportedStrategyError, check_keras
from dp_plugin.tensorflow.sparse import reduce_gradients
from dp_plugin.validate import check_groups, check_int, check_positive_float


def parse_reduction(owner: str, op: Any, compression: Any, backward_passes_per_step: Any,
                    gradient_predivide_factor: Any) -> tuple[ReduceOp, Compressor, int, float]:
    """The reduction arguments of ``DistributedOptimizer``, ``DistributedCallback`` and
    ``DistributedGradientTape``, validated (errors name ``owner``)."""
    with calling(owner):
        op = _names.parse_op(op, prefix="dp.",
                             instead="op=dp.Average (the default) or op=dp.Sum")
        _names.require_sum_or_average(op, "is not a gradient reduction (Average is the "
                                      "default)", prefix="dp.")
        compressor = parse_compression(compression)
    passes = check_int("backward_passes_per_step", backward_passes_per_step, minimum=1,
                       where=owner)
    predivide = check_positive_float("gradient_predivide_factor", gradient_predivide_factor,
                                     where=owner)
    ReducePolicy(op, predivide=predivide, gradients=())  # its rules, checked here once
    return op, compressor, passes, predivide


@dataclass(eq=False)
class DistributedApply:
    """Replaces ``optimizer.apply`` on one optimizer: reduce across workers, then apply.

    With ``backward_passes_per_step = N > 1`` (Horovod's semantics) the
    gradients of N consecutive calls are summed locally (divided by N with
    ``average_aggregated_gradients``) and only every N-th call reduces them
    across workers and applies them; the calls in between change nothing
    else (``optimizer.iterations`` counts applied steps). That needs one
    replica per worker: TensorFlow cannot skip the optimizer's cross-replica
    update conditionally under MirroredStrategy.

    Distributed contract: each call is a collective (every N-th call with
    N > 1); all ranks must call it equally often with the same variables.
    """

    optimizer: Any
    bridge: GradientBridge
    _: KW_ONLY
    owner: str
    """Who installed it: 'DistributedOptimizer' or 'DistributedCallback'."""
    backward_passes_per_step: int = 1
    average_aggregated_gradients: bool = False
    sparse_as_dense: bool = False
    _accumulators: dict[tuple[int, ...], list[Any]] = field(default_factory=dict, init=False)
    _counter: Any = field(default=None, init=False)
    _captured: list[tuple[list[Any], list[Any] | None]] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.apply_reduced = type(self.optimizer).apply.__get__(self.optimizer)
        """The optimizer's own ``apply``, for gradients already reduced across workers."""

    def same_settings(self, other: DistributedApply) -> bool:
        return self._settings() == other._settings()

    def _settings(self) -> tuple[Any, ...]:
        bridge = self.bridge
        return (bridge.op, type(bridge.compression), bridge.gradient_predivide_factor,
                self.backward_passes_per_step, self.average_aggregated_gradients,
                self.sparse_as_dense)

    @tf.autograph.experimental.do_not_convert
    def __call__(
        self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None
    ) -> Any:
        grads = list(grads)
        variables = None if trainable_variables is None else list(trainable_variables)
        if self._captured is not None:  # inside ``capturing``
            if self._captured:
                raise DPPluginError(
                    f"{self.owner}: the train step calls {type(self.optimizer).__name__}.apply "
                    "more than once, which the XLA-compiled split step (jit_compile=True) "
                    "cannot reduce between its parts; compile the model with jit_compile=False")
            self._captured.append((grads, variables))
            return None
        if self.backward_passes_per_step == 1:
            return self.apply_reduced(self.reduce(grads, variables), variables)
        return self._accumulate_then_apply(grads, variables)

    # -- a train step split around the reduction (``xla_split``) ----------------
    @contextlib.contextmanager
    def capturing(self) -> Iterator[list[tuple[list[Any], list[Any] | None]]]:
        """While the block runs (a train step being traced), a call to this hook
        records ``(grads, variables)`` into the yielded list instead of reducing and
        applying them; the caller reduces (``reduce``) and applies (``apply_reduced``)."""
        captured: list[tuple[list[Any], list[Any] | None]] = []
        self._captured = captured
        try:
            yield captured
        finally:
            self._captured = None

    def reduce(self, grads: list[Any], variables: list[Any] | None) -> list[Any]:
        """``grads`` (None entries kept) reduced across workers through the bridge."""
        if variables is None:
            variables = getattr(self.optimizer, "_trainable_variables", None)
        return reduce_gradients(self.bridge, grads, variables, self.sparse_as_dense)

    def _accumulate_then_apply(self, grads: list[Any], variables: list[Any] | None) -> None:
        ctx = tf.distribute.get_replica_context()
        if ctx is not None and ctx.num_replicas_in_sync > 1:
            raise UnsupportedStrategyError(
                f"backward_passes_per_step={self.backward_passes_per_step} needs one replica per "
                f"worker, but this step runs {ctx.num_replicas_in_sync} replicas "
                "(MirroredStrategy): TensorFlow cannot skip the optimizer's cross-replica "
                "update conditionally. Use backward_passes_per_step=1 (and a larger batch), "
                "or no MirroredStrategy"
            )
        if variables is None:
            raise ValueError(
                "backward_passes_per_step > 1 needs optimizer.apply(grads, trainable_variables) "
                "with the variables (model.fit passes them)"
            )
        if not self.optimizer.built:
            # Keras builds inside apply(); here apply() runs inside a cond,
            # where variables cannot be created.
            self.optimizer.build(variables)
        accumulators = self._accumulators_for(variables)
        n = self.backward_passes_per_step
        for g, acc in zip(grads, accumulators, strict=True):
            if g is not None:
                acc.assign_add(tf.convert_to_tensor(g))
        count = self._counter.assign_add(1)

        def apply_now() -> Any:
            mean = self.average_aggregated_gradients
            summed = [None if g is None else acc.read_value() / n if mean else acc.read_value()
                      for g, acc in zip(grads, accumulators, strict=True)]
            self.apply_reduced(self.reduce(summed, variables), variables)
            for acc in accumulators:
                acc.assign(tf.zeros_like(acc))
            self._counter.assign(0)
            return tf.constant(True)

        tf.cond(count >= n, apply_now, lambda: tf.constant(False))

    def _accumulators_for(self, variables: list[Any]) -> list[Any]:
        key = tuple(id(v) for v in variables)
        if key not in self._accumulators:
            with tf.init_scope():  # created once, eagerly, even while a step is traced
                self._accumulators[key] = [
                    tf.Variable(tf.zeros(v.shape, dtype=v.dtype), trainable=False,
                                name="dp_plugin_accumulator")
                    for v in variables
                ]
                if self._counter is None:
                    self._counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                                                name="dp_plugin_passes")
        return self._accumulators[key]


# -- installing ---------------------------------------------------------------

def hook_of(optimizer: Any) -> DistributedApply | None:
    """The hook installed on this very optimizer instance, if any."""
    hook = vars(optimizer).get("apply")
    return hook if isinstance(hook, DistributedApply) else None


def find_hook(optimizer: Any) -> tuple[Any, DistributedApply | None]:
    """The first optimizer in ``optimizer``'s wrapping chain (``inner_optimizer``) with a
    hook, and the hook; ``(optimizer, None)`` if none has one."""
    current = optimizer
    while current is not None:
        if (hook := hook_of(current)) is not None:
            return current, hook
        current = getattr(current, "inner_optimizer", None)
    return optimizer, None


def install(optimizer: Any, hook: DistributedApply, replacing: Any = None) -> None:
    """Put ``hook`` on this optimizer instance, after removing the hook of ``replacing``
    (an optimizer of the same wrapping chain that has one), if given."""
    if replacing is not None:
        del vars(replacing)["apply"]
    vars(optimizer)["apply"] = hook


def make_hook(
    optimizer: Any,
    *,
    owner: str,
    compression: Any,
    op: Any,
    backward_passes_per_step: int,
    gradient_predivide_factor: float,
    average_aggregated_gradients: bool = False,
    name: str | None = None,
    sparse_as_dense: bool = False,
    groups: Any = None,
) -> DistributedApply:
    """Validate the arguments and build (not install) a hook for ``optimizer``
    (``groups`` already checked, ``check_groups``)."""
    parsed_op, compressor, passes, predivide = parse_reduction(
        owner, op, compression, backward_passes_per_step, gradient_predivide_factor)
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"{owner}: name must be a non-empty string or None, got {name!r}")
    bridge = GradientBridge(
        op=parsed_op, compression=compressor, gradient_predivide_factor=predivide,
        name=name or next_bridge_name("keras"),
        # The hook hands the reduced gradients straight to apply(): they are
        # consumed before the next step packs the fusion buffers again.
        results_alias_buffers=True,
        groups=groups,
    )
    return DistributedApply(
        optimizer, bridge, owner=owner, backward_passes_per_step=passes,
        average_aggregated_gradients=bool(average_aggregated_gradients),
        sparse_as_dense=bool(sparse_as_dense),
    )


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
) -> Any:
    """Make a Keras 3 optimizer average its gradients across workers; return it.

    ``opt = dp.DistributedOptimizer(keras.optimizers.SGD(0.01)); model.compile(opt, ...)``.
    The same optimizer object is returned, with the reduction installed into
    its ``apply`` (see the module docstring); ``model.fit``, ``train_on_batch``
    and custom steps that call ``apply``/``apply_gradients`` then reduce.
    Pair it with ``BroadcastGlobalVariablesCallback(0)`` (or use
    ``DistributedCallback`` instead of both).

    - ``op``: ``dp.Average`` (default) or ``dp.Sum``; ``compression``:
      ``dp.Compression.none/fp16/bf16``; ``gradient_predivide_factor``:
      divide before the sum and multiply back after, as Horovod.
    - ``backward_passes_per_step`` / ``average_aggregated_gradients``: local
      accumulation (see ``DistributedApply``; one replica per worker).
    - ``sparse_as_dense``: ``tf.IndexedSlices`` gradients (embeddings) are
      all-gathered as in Horovod by default; True all-reduces them dense.
    - ``groups`` (or the older ``num_groups``), as Horovod: each group of
      gradients is reduced as one bucket of its own once all of it is ready;
      ``groups=N`` cuts the gradients, in order, into N groups of near-equal
      count, ``groups=[[v, ...], ...]`` names the variables of each.
    - ``name``: prefix of the collectives' names (the same on every rank).
    - Mixed precision: wrap the ``LossScaleOptimizer``, or let ``compile()``
      wrap this one and add ``BroadcastGlobalVariablesCallback`` or
      ``DistributedCallback``, which move the reduction onto it.

    Raises ``ValueError`` if the optimizer (or an optimizer it wraps) already
    reduces across workers, ``UnsupportedKerasError`` for an unsupported Keras.
    Distributed contract: every rank wraps the same optimizer type with the
    same arguments and runs the same steps.
    """
    who = "DistributedOptimizer"
    check_keras()
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"{who} needs a Keras 3 optimizer (keras.optimizers.Optimizer), got "
            f"{type(optimizer).__name__}; tf.compat.v1 and Keras 2 optimizers are not supported"
        )
    groups = check_groups(groups, num_groups, (tf.Variable, keras.Variable), "tf.Variable")
    target, existing = find_hook(optimizer)
    if existing is not None:
        raise ValueError(
            f"{who}: optimizer {target.name!r} already reduces gradients across workers "
            f"(installed by {existing.owner}); wrapping it twice would reduce twice. Wrap the "
            "plain optimizer once"
        )
    install(optimizer, make_hook(
        optimizer, owner=who, compression=compression, op=op,
        backward_passes_per_step=backward_passes_per_step,
        gradient_predivide_factor=gradient_predivide_factor,
        average_aggregated_gradients=average_aggregated_gradients, name=name,
        sparse_as_dense=sparse_as_dense, groups=groups,
    ))
    return optimizer
