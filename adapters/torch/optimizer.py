"""``DistributedOptimizer``: the user's optimizer, with gradients averaged across ranks.

The wrapper is an instance of a subclass of the user's optimizer class,
``Distributed<Name>``, whose MRO puts ``_DistributedMixin`` first; the mixin
uses plain ``super()``. The subclass is built once per optimizer class and
cached. The wrapped instance takes over the user's optimizer's attributes
(``param_groups``, ``state``, ``defaults``, hooks): the two objects share
them, so keep using only the returned one.

Gradients go through ONE ``dp_plugin.scheduler.GradientScheduler`` per
optimizer: a post-accumulate-grad hook on every parameter that requires a
gradient reports it ready, and complete fusion buckets are all-reduced while
backward still runs. ``step()`` first calls ``synchronize()``.
"""

from __future__ import annotations

import threading
import types
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from dp_plugin.engines.base import ReduceOp
from dp_plugin.torch import joining as _join
from dp_plugin.torch.distributed_mixin import _DistributedMixin
from dp_plugin.torch.ops import Average, Compression, parse_op
from dp_plugin.torch.optimizer_args import (
    check_groups,
    compressor_of,
    parameter_names,
)
from dp_plugin.torch.optimizer_state import OptimizerState
from dp_plugin.torch.process_sets import ProcessSet, engine_or_none, global_process_set
from dp_plugin.validate import check_int


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Returns an instance of ``Distributed<OptimizerClass>``, a subclass of the
    optimizer's class (``isinstance(opt, torch.optim.SGD)`` holds), sharing
    its param_groups and state. ``state_dict``/``load_state_dict``,
    ``param_groups`` and ``add_param_group`` behave as before (parameters
    added later are reduced too).

    Distributed contract: every rank wraps the same optimizer over the same
    parameters (same names, shapes, dtypes and order; the first step checks
    it and raises on every rank otherwise), with the same arguments, and
    calls ``step()``/``synchronize()`` the same number of times. Gradients
    are all-reduced while backward runs; ``step()`` waits for them first.
    ``synchronize()`` does that wait on its own, for gradient clipping or
    AMP's ``GradScaler.unscale_``; then step inside ``skip_synchronize()``::

        loss.backward()
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with optimizer.skip_synchronize():
            optimizer.step()

    ``zero_grad()`` between ``backward()`` and ``step()``/``synchronize()``
    raises (the reduction would race with it). A parameter without a
    gradient in a step contributes zeros (its ``.grad`` then holds the
    others' average); one whose hook did not fire but that still has a
    ``.grad`` contributes that gradient, as in Horovod.

    Arguments (Horovod's): ``named_parameters`` names the gradients
    (usually ``model.named_parameters()``; unique names, covering every
    parameter of the optimizer); ``compression`` is ``Compression.none``,
    ``.fp16`` or ``.bf16`` (the fusion buffers travel in that type);
    ``backward_passes_per_step`` accumulates that many backward passes
    locally before one reduction; ``op`` is ``Average``, ``Sum``, ``Min``,
    ``Max`` or ``Product`` (``Adasum`` raises ``NotImplementedError``);
    ``gradient_predivide_factor`` splits the averaging into ``1/f`` before
    the sum and ``f/size`` after; ``groups``/``num_groups`` are accepted and
    validated but are only hints: dp_plugin's planner already fuses
    gradients deterministically into buckets of ``DP_PLUGIN_FUSION_THRESHOLD``
    bytes; ``sparse_as_dense`` reduces sparse gradients as dense tensors
    (without it, each sparse gradient is reduced on its own outside the
    buckets by an all-gather of indices and values, as in Horovod);
    ``process_set`` reduces over that set's
    ranks only (on the other ranks the optimizer steps on local gradients,
    as in Horovod).

    With a single rank nothing is reduced (as in Horovod): gradients stay
    exactly as backward made them (the ``zero_grad()`` check still applies,
    so a script that would race at scale fails already on one process).
    A rank that runs out of data calls ``hvd.join()``: it then answers the
    other ranks' steps with zero gradients (see ``dp_plugin.torch.joining``).

    ``step(closure)``: the closure's backward is synchronized after each
    call of the closure, so closure-based optimizers (LBFGS) work too.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"DistributedOptimizer expects a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}; create the optimizer first, then wrap it"
        )
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError(
            f"{type(optimizer).__name__} is already a DistributedOptimizer; wrap the plain "
            "optimizer only once (two wrappers would reduce every gradient twice)"
        )
    reduce_op = parse_op(op, "DistributedOptimizer")
    if gradient_predivide_factor != 1.0 and reduce_op is not ReduceOp.AVERAGE:
        raise ValueError(
            f"gradient_predivide_factor={gradient_predivide_factor!r} is only supported with "
            f"op=hvd.Average, got op={op!r}; leave it at 1.0"
        )
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups`.",
                      DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    check_groups(groups)
    backward_passes_per_step = check_int("backward_passes_per_step", backward_passes_per_step,
                                         minimum=1)
    compressor = compressor_of(compression)
    if not isinstance(process_set, ProcessSet):
        raise TypeError(
            f"DistributedOptimizer(process_set=...) expects an hvd.ProcessSet, got "
            f"{type(process_set).__name__}; pass hvd.global_process_set (the default) or a set "
            "registered with hvd.add_process_set(ranks)"
        )
    eng = engine_or_none(process_set, "hvd.DistributedOptimizer()")
    names = parameter_names(optimizer.param_groups, named_parameters)
    label = f"DistributedOptimizer.{0 if eng is None else eng.channels_made}"
    # Its own communicator (collective: every rank of the set constructs the
    # optimizer at the same point): buckets start when gradients are ready,
    # which differs between ranks when some parameter is unused on one of
    # them, and must not cross SyncBatchNorm's or the user's collectives.
    channel = None if eng is None else eng.channel(label)

    cls = _distributed_class(type(optimizer))
    wrapped: Any = object.__new__(cls)  # the optimizer exists already: no __init__
    # Take over the optimizer's attributes (shared, not copied), minus
    # instance attributes that would shadow the mixin's methods (an LR
    # scheduler created on the plain optimizer stores a wrapped ``step``).
    shadowed = {name for name in vars(_DistributedMixin) if not name.startswith("__")}
    wrapped.__dict__.update(
        {k: v for k, v in vars(optimizer).items() if k not in shadowed}
    )
    wrapped._dp = OptimizerState(
        names=names, named=named_parameters is not None, compressor=compressor,
        compression=compression, op=reduce_op,
        predivide=float(gradient_predivide_factor), passes=backward_passes_per_step,
        sparse_as_dense=bool(sparse_as_dense), groups=groups, process_set=process_set,
        engine=channel, label=label,
    )
    wrapped._dp_register()
    _join.register(wrapped)
    return wrapped


_classes: dict[type, type[Any]] = {}
_classes_lock = threading.Lock()


def _distributed_class(cls: type[torch.optim.Optimizer]) -> type[Any]:
    """``Distributed<cls>``: the mixin first, then ``cls``; built once per class."""
    with _classes_lock:
        made = _classes.get(cls)
        if made is None:
            made = types.new_class(f"Distributed{cls.__name__}", (_DistributedMixin, cls))
            made.__module__ = __name__
            made.__doc__ = f"{cls.__name__} whose gradients are reduced across ranks " \
                           "(see dp_plugin.torch.DistributedOptimizer)."
            _classes[cls] = made
        return made
