"""Communication hooks: what a fused collective does with one packed bucket.

Modelled on PyTorch DDP's comm hooks (``hook(state, bucket) -> future``):
a hook receives a ``GradBucket`` whose flat buffer is already packed (and
pre-scaled) and returns an engine ``Handle``; when the handle completes, the
bucket's buffer must hold the reduced values. Policies compose by wrapping::

    hook = compression_wrapper(allreduce_hook, get_compressor("fp16"))

Users may write their own hooks (error feedback, PowerSGD-style low rank): the
contract is only "after ``handle.wait()`` the buffer holds what every rank
agrees on", and every rank must run the same collectives for a bucket. A
hook object with ``bind(state, new_channel)`` is bound by the optimizer
that registers it, on every rank at the same point (after the ranks agreed
on its ``describe()``, if it has one): ``new_channel(name)`` makes another
communicator over the same ranks, for collectives a hook starts at times
that differ between ranks (``dp_plugin.torch.powersgd``).

Scaling (averaging, Horovod's predivide, pre/post factors) is *not* a hook:
``ReducePolicy`` computes the factors once, in one place, and the fusion
buffer folds them into its pack and unpack copies, so that averaging rounds
the same way on every path and every engine and costs no extra pass
(``allreduce_hook`` folds the post-scale into the reduction where it can).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dp_plugin.engines.base import Handle, ReduceOp
from dp_plugin.reduce.arrays import ArrayOps
from dp_plugin.reduce.compression import Cast, Compressor, get_compressor
from dp_plugin.reduce.dtypes import canonical_dtype, is_floating
from dp_plugin.validate import check_positive_float


@dataclass(frozen=True, init=False, slots=True)
class ReducePolicy:
    """How a reduction is scaled: the one definition of Average on every path.

    Horovod's rule: ``op=average`` multiplies each rank's input by
    ``prescale / predivide`` before the sum and the sum by
    ``postscale * predivide / size`` after it; ``op=sum`` applies only the
    user's factors; min/max/product allow none. ``engine_op`` is what the
    engine runs (Average is always a sum here). The factors are applied by
    ``ArrayOps.scale_`` (in the fusion buffer's pack/unpack, or on the
    reduce-scatter's input and output): integers in double precision,
    truncated; float16/bfloat16 in float32. The engines' own ``op=average``
    (``engines.generic.average``: times ``1/size``) is the same rule; no
    library's native average is used. The one exception is Horovod's own:
    sparse all-reduces (torch ``sparse_allreduce_async``, TensorFlow
    ``tf.IndexedSlices``) divide the gathered values by the size.
    """

    op: ReduceOp
    engine_op: ReduceOp
    prescale: float
    postscale: float
    settings: tuple[tuple[str, float], ...]
    """The factors as the user set them (``gradient_predivide_factor``,
    ``prescale_factor``, ``postscale_factor``), which a mismatch across ranks
    names: ``prescale``/``postscale`` are derived from them."""

    def __init__(self, op: ReduceOp | str = ReduceOp.SUM, size: int = 1, *,
                 predivide: float = 1.0, prescale: float = 1.0, postscale: float = 1.0,
                 gradients: Sequence[Any] | None = None) -> None:
        """The policy of ``op`` over ``size`` ranks with the user's factors.

        ``gradients`` (the ``TensorSpec`` of every tensor of a gradient
        stream, or none yet) applies the gradient rules, checked here once:
        factors > 0, ``predivide`` only with an average, floating tensors for
        an average, no scaling of integer tensors or of min/max/product.
        None: the caller checked its arguments: a tensor collective
        (Horovod's: any op and dtype may be scaled) or an adapter whose public
        edge built this policy's rules already (``parse_reduction``,
        ``DistributedOptimizer``).
        """
        op = ReduceOp.parse(op)
        if gradients is not None:
            predivide = check_positive_float("gradient_predivide_factor", predivide)
            if predivide != 1.0 and op is not ReduceOp.AVERAGE:
                raise ValueError(
                    f"gradient_predivide_factor={predivide:g} only applies to op='average' (got "
                    f"op={op.value!r}); leave it at 1.0"
                )
            prescale = check_positive_float("prescale_factor", prescale)
            postscale = check_positive_float("postscale_factor", postscale)
            _check_gradients(op, gradients, prescale, postscale)
        average = op is ReduceOp.AVERAGE
        set_ = object.__setattr__
        set_(self, "op", op)
        set_(self, "engine_op", ReduceOp.SUM if average else op)
        set_(self, "prescale", float(prescale / predivide if average else prescale))
        set_(self, "postscale", float(postscale * predivide / size if average else postscale))
        set_(self, "settings", (("gradient_predivide_factor", float(predivide)),
                                ("prescale_factor", float(prescale)),
                                ("postscale_factor", float(postscale))))


def _check_gradients(op: ReduceOp, gradients: Sequence[Any], prescale: float,
                     postscale: float) -> None:
    """``ReducePolicy``'s rules for the dtypes of a gradient stream."""
    ints = [f"tensor {s.name!r} is {s.dtype}" for s in gradients if not is_floating(s.dtype)]
    if op is ReduceOp.AVERAGE:
        if ints:
            raise TypeError(f"{ints[0]}, but op='average' needs floating tensors; use op='sum' "
                            "for integer tensors, or register only floating ones")
    elif op is ReduceOp.SUM:
        if ints and (prescale != 1.0 or postscale != 1.0):
            raise TypeError(f"{ints[0]}, which cannot be scaled by prescale_factor={prescale:g}"
                            f" / postscale_factor={postscale:g}; leave both at 1.0 for integer "
                            "tensors")
    elif prescale != 1.0 or postscale != 1.0:
        raise ValueError(
            f"op={op.value!r} does not allow scaling (prescale_factor={prescale:g}, "
            f"postscale_factor={postscale:g}); leave both at 1.0, or use op='sum'/'average'"
        )


NO_SCALING = ReducePolicy()


@dataclass(eq=False)
class GradBucket:
    """One packed fusion buffer, as a hook sees it (DDP's ``GradBucket``)."""

    index: int
    dtype: str
    device: str
    names: tuple[str, ...]
    ops: ArrayOps
    flat: Any
    """The packed, pre-scaled 1-D buffer; the hook leaves the result in it."""
    label: str
    """The collective's name on the engine (same on every rank)."""
    scratch: dict[str, Any] = field(default_factory=dict)
    """Persistent per-bucket storage for hooks (state such as an error-feedback
    residual); kept while the bucket plan stays the same."""
    shared: dict[str, Any] | None = None
    """Storage shared by the buckets that take turns on one slab
    (``dp_plugin.reduce.bucket``), for what a hook needs only while the bucket is in
    flight (a wire buffer), sized to ``shared_numel`` elements; None when the
    bucket has a buffer of its own (keep such things in ``scratch``)."""
    shared_numel: int = 0
    control_numel: int = 0
    """Trailing elements of ``flat`` that are the reducer's control slot (per-rank
    flags every rank reads): a hook that reduces only part of the buffer
    (``sharding.reducescatter_hook``) must still reduce these in full."""
    shapes: tuple[tuple[int, ...], ...] = ()
    """Each member's shape, in ``names`` order (DDP's ``bucket.gradients()``:
    a hook that treats members as matrices, ``dp_plugin.torch.powersgd``)."""
    offsets: tuple[int, ...] = ()
    """Where each member starts in ``flat``, in ``names`` order."""
    postscale: float = field(default=1.0, init=False)
    """The factor the unpack multiplies the result by (an Average's
    ``1/size``); a hook that folds it into its reduction sets it to 1.0. A
    ``dataclasses.replace`` copy (a wrapper's other buffer) has 1.0."""

    def buffer(self) -> Any:
        return self.flat


@dataclass(frozen=True, eq=False)
class HookState:
    """What every hook may use: the engine, the policy's engine op, a root."""

    engine: Any
    engine_op: ReduceOp = ReduceOp.SUM
    root: int = 0
    """Broadcast root, as a rank of ``engine`` (hooks that broadcast)."""


CommHook = Callable[[HookState, GradBucket], Handle]


def allreduce_hook(state: HookState, bucket: GradBucket) -> Handle:
    """Reduce the bucket in place with the policy's engine op; a sum takes
    its post-scale along where the engine multiplies as it reduces, bitwise
    as the unpack would (``Engine.scaled_sum_async``; never the control slot's counts)."""
    engine, flat = state.engine, bucket.buffer()
    if bucket.postscale != 1.0 and state.engine_op is ReduceOp.SUM and not bucket.control_numel:
        handle = engine.scaled_sum_async(flat, bucket.postscale, name=bucket.label)
        if handle is not None:
            bucket.postscale = 1.0
            return handle
    return engine.allreduce_async(flat, state.engine_op, name=bucket.label)


def broadcast_hook(state: HookState, bucket: GradBucket) -> Handle:
    """Overwrite the bucket with the root's (used for parameter/state broadcasts)."""
    return state.engine.broadcast_async(bucket.buffer(), state.root, name=bucket.label)


def compression_wrapper(hook: CommHook, compressor: Compressor | str) -> CommHook:
    """``hook`` run on the bucket in the compressor's wire form.

    A built-in cast (fp16, bf16) uses a wire buffer allocated once per bucket
    (in ``bucket.scratch``, or per slab in ``bucket.shared`` for a bucket that
    borrows one) and casts back when the handle is waited on; buckets it does
    not narrow (integers, already-narrow floats) go to ``hook`` unchanged.
    Any other compressor: see ``dp_plugin.reduce.compression``.
    """
    comp = get_compressor(compressor)
    wrapped = _cast_wrapper(hook, comp) if isinstance(comp, Cast) else _tensor_wrapper(hook, comp)
    wrapped.__name__ = wrapped.__qualname__ = f"{comp.name}_{getattr(hook, '__name__', 'hook')}"
    return wrapped


def _cast_wrapper(hook: CommHook, comp: Cast) -> CommHook:
    def compressed(state: HookState, bucket: GradBucket) -> Handle:
        wire_dtype = comp.wire_dtype(bucket.dtype)
        if wire_dtype == bucket.dtype:
            return hook(state, bucket)
        flat = bucket.buffer()
        numel = int(flat.shape[0])
        key = f"wire:{comp.name}"
        store = bucket.scratch if bucket.shared is None else bucket.shared
        wire = store.get(key)
        if wire is None or int(wire.shape[0]) < numel:
            wire = bucket.ops.empty(max(numel, bucket.shared_numel), wire_dtype, bucket.device)
            store[key] = wire
        if int(wire.shape[0]) != numel:  # shared by the buckets of a slab
            wire = bucket.ops.slice(wire, 0, numel)
        bucket.ops.cast_into(wire, flat)
        inner = replace(bucket, dtype=wire_dtype, flat=wire)
        return hook(state, inner).then(lambda: bucket.ops.cast_into(flat, wire))

    return compressed


def _tensor_wrapper(hook: CommHook, comp: Compressor) -> CommHook:
    def compressed(state: HookState, bucket: GradBucket) -> Handle:
        flat = bucket.buffer()
        wire, ctx = comp.compress(flat)
        try:
            wire_dtype = canonical_dtype(wire.dtype)
        except (AttributeError, TypeError) as exc:
            raise TypeError(
                f"compressor {comp.name}: compress() returned {type(wire).__name__} "
                f"({exc}); it must return (tensor, ctx) with a tensor of a reducible dtype"
            ) from None

        def restore() -> None:
            out = comp.decompress(wire, ctx)
            if out is flat:
                return
            numel = int(flat.shape[0])
            got = out.reshape(-1)
            if int(got.shape[0]) != numel:
                raise ValueError(
                    f"compressor {comp.name}: decompress() returned {int(got.shape[0])} elements "
                    f"for a bucket of {numel}; it must restore the tensor compress() was given"
                )
            bucket.ops.cast_into(flat, got)

        return hook(state, replace(bucket, dtype=wire_dtype, flat=wire)).then(restore)

    return compressed


def hook_for(comp: Compressor) -> CommHook:
    """The default gradient hook: all-reduce, compressed by ``comp`` unless it is 'none'."""
    return allreduce_hook if comp.name == "none" else compression_wrapper(allreduce_hook, comp)
