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
from collections.abc import Iterable
from typing import Any

import torch
from dp_plugin.process_sets import ProcessSet, engine_or_none, global_process_set
from dp_plugin.torch import joining as _join
from dp_plugin.torch.distributed_mixin import _DistributedMixin
from dp_plugin.torch.misuse import warn_if_ddp
from dp_plugin.torch.ops import Average, Compression
from dp_plugin.torch.optimizer_args import checked_arguments, parameter_names
from dp_plugin.torch.optimizer_state import OptimizerState


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
    optimizer's class sharing its param_groups and state; keep using only the
    returned object. Gradients are all-reduced in fusion buckets while
    backward runs, on a communicator of the optimizer's own; ``step()``
    waits for them first (``synchronize()`` alone, then ``step()`` inside
    ``skip_synchronize()``, for gradient clipping or AMP's ``unscale_``).

    Distributed contract: every rank of ``process_set`` wraps the same
    optimizer over the same parameters (names, shapes, dtypes, order) with
    the same arguments, at the same point: construction is collective (it
    checks that, raising on every rank otherwise, and opens the channel).
    Every rank then calls ``step()``/``synchronize()`` the same number of
    times. A parameter without a gradient in a step (unused on this rank)
    contributes zeros; ``zero_grad()`` between ``backward()`` and ``step()``
    raises. Arguments are Horovod's; see docs/torch.md for each of them,
    ``hvd.join()``, sparse gradients and process sets.
    """
    _check_wrappable(optimizer)
    reduce_op, groups, passes, compressor = checked_arguments(
        op, gradient_predivide_factor, num_groups, groups, backward_passes_per_step,
        compression, process_set)
    eng = engine_or_none(process_set, "hvd.DistributedOptimizer()")
    if named_parameters is not None:
        named_parameters = list(named_parameters)  # read twice
    names = parameter_names(optimizer.param_groups, named_parameters)  # validates them
    warn_if_ddp(named_parameters)
    label = f"DistributedOptimizer.{0 if eng is None else eng.channels_made}"
    wrapped = _wrap(optimizer)
    wrapped._dp = OptimizerState(
        names=names, named=named_parameters is not None, compressor=compressor,
        compression=compression, op=reduce_op, predivide=float(gradient_predivide_factor),
        passes=passes, sparse_as_dense=bool(sparse_as_dense), groups=groups,
        process_set=process_set, label=label,
        # Its own communicator: buckets start when gradients are ready, which
        # differs between ranks when a parameter is unused on one of them, and
        # must not cross SyncBatchNorm's or the user's collectives.
        engine=None if eng is None else eng.channel(label),
    )
    wrapped._dp_register()
    _join.register(wrapped)
    return wrapped


def _check_wrappable(optimizer: Any) -> None:
    """Refuse what is not an optimizer, or is already wrapped (unless that
    wrapper's engine was shut down: its hooks go, and it is wrapped anew)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"DistributedOptimizer expects a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}; create the optimizer first, then wrap it"
        )
    if isinstance(optimizer, _DistributedMixin) and optimizer._dp.closed:
        for handle in optimizer._dp.hooks:  # its engine was shut down: wrap it anew
            handle.remove()
    elif isinstance(optimizer, _DistributedMixin):
        raise ValueError(
            f"{type(optimizer).__name__} is already a DistributedOptimizer; wrap the plain "
            "optimizer only once (two wrappers would reduce every gradient twice)"
        )


def _wrap(optimizer: torch.optim.Optimizer) -> Any:
    """A ``Distributed<Class>`` instance sharing ``optimizer``'s attributes."""
    plain = type(optimizer).__bases__[1] if isinstance(optimizer, _DistributedMixin) \
        else type(optimizer)
    cls = _distributed_class(plain)
    wrapped: Any = object.__new__(cls)  # the optimizer exists already: no __init__
    # Take over the optimizer's attributes (shared, not copied), minus
    # instance attributes that would shadow the mixin's methods (an LR
    # scheduler created on the plain optimizer stores a wrapped ``step``).
    shadowed = {name for name in vars(_DistributedMixin) if not name.startswith("__")}
    wrapped.__dict__.update(
        {k: v for k, v in vars(optimizer).items() if k not in shadowed}
    )
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
