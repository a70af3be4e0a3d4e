"""``DistributedOptimizer``: the user's optimizer, with gradients averaged across ranks.

The wrapper is an instance of ``Distributed<Name>``, a subclass of the
user's optimizer class whose MRO puts ``_DistributedOptimizer`` (this
module's one class, plain ``super()``) first; the subclass is built once per
optimizer class and cached. The wrapped instance takes over the user's
optimizer's attributes (``param_groups``, ``state``, ``defaults``, hooks):
the two objects share them, so keep using only the returned one.

Everything the wrapper adds lives under one attribute, ``_dp``
(``optimizer_state.OptimizerState``); the methods here are torch's and
Horovod's API over it.
"""

from __future__ import annotations

import contextlib
import threading
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from dp_plugin.agree.edge import calling
from dp_plugin.api.process_sets import ProcessSet, engine_or_none, global_process_set
from dp_plugin.api.timeline import StatsHistory
from dp_plugin.engines.base import ReduceOp
from dp_plugin.reduce.compression import Compressor, get_compressor
from dp_plugin.torch import joining as _join
from dp_plugin.torch.ops import Average, Compression, parse_op
from dp_plugin.torch.optimizer_state import (
    OptimizerState,
    SynchronizationError,
    parameter_names,
)
from dp_plugin.torch.sharded import check_shardable
from dp_plugin.validate import check_groups, check_int, check_positive_float


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
    shard_optimizer_state: bool | None = None,
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
    ``shard_optimizer_state=True`` (default: ``DP_PLUGIN_SHARD_OPTIMIZER_STATE``)
    keeps the optimizer state of 1/size of the parameters per rank (``sharded.py``).
    """
    _check_wrappable(optimizer)
    reduce_op, passes, groups, compressor = _checked_arguments(
        op, gradient_predivide_factor, num_groups, groups, backward_passes_per_step,
        compression, process_set)
    with calling("hvd.DistributedOptimizer()"):
        eng = engine_or_none(process_set)
    if named_parameters is not None:
        named_parameters = list(named_parameters)  # read twice
    names = parameter_names(optimizer.param_groups, named_parameters)  # validates them
    shard = _check_shard(shard_optimizer_state, optimizer, eng)
    _warn_if_ddp(named_parameters)
    label = f"DistributedOptimizer.{0 if eng is None else eng.channels_made}"
    wrapped = _wrap(optimizer)
    wrapped._dp = OptimizerState(
        names=names, named=named_parameters is not None, compression=compression,
        compressor=compressor, op=reduce_op, predivide=float(gradient_predivide_factor),
        passes=passes, sparse_as_dense=bool(sparse_as_dense), process_set=process_set,
        label=label, groups=groups, sharded=shard,
        # Its own communicator: buckets start when gradients are ready, which
        # differs between ranks when a parameter is unused on one of them, and
        # must not cross SyncBatchNorm's or the user's collectives.
        engine=None if eng is None else eng.channel(label),
    )
    wrapped._dp.register(wrapped)
    _join.register(wrapped._dp)
    return wrapped


class _DistributedOptimizer:
    """The methods placed in front of the user's optimizer class in the MRO."""

    _dp: OptimizerState
    param_groups: list[dict[str, Any]]

    # -- Horovod's public surface --------------------------------------------------
    @property
    def backward_passes_per_step(self) -> int:
        return self._dp.passes

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes: int) -> None:
        self.set_backward_passes_per_step(passes)

    @property
    def op(self) -> ReduceOp:
        return self._dp.op

    @property
    def gradient_predivide_factor(self) -> float:
        return self._dp.predivide

    @property
    def sparse_as_dense(self) -> bool:
        return self._dp.sparse_as_dense

    @property
    def process_set(self) -> ProcessSet:
        return self._dp.process_set

    @property
    def shard_optimizer_state(self) -> bool:
        """Does each rank keep the optimizer state of its pieces only?"""
        return self._dp.sharded

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Parameter -> name, as Horovod's attribute: from ``named_parameters``,
        else ``allreduce.noname.<group>.<index>`` (parameters added later
        with ``add_param_group`` get theirs when added)."""
        return self._dp.names

    @property
    def _compression(self) -> Any:
        """The ``compression`` argument, as given (Horovod's attribute)."""
        return self._dp.compression

    def comm_stats(self) -> StatsHistory | None:
        """Per-step communication stats of the gradient reduction (``StepStats``:
        bytes, all-reduce time, exposed time not hidden behind backward); None
        when nothing is reduced (one rank). Restarts when the buckets are re-planned."""
        reducer = self._dp.reducer
        return None if reducer is None else reducer.stats

    def register_comm_hook(self, hook: Callable[..., Any]) -> None:
        """Reduce each fusion bucket with ``hook(state, bucket) -> Handle``
        instead of the default all-reduce (PyTorch DDP's ``register_comm_hook``).

        ``bucket.buffer()`` holds the packed, pre-scaled gradients; after the
        returned handle completes it must hold what every rank agrees on (the
        average is finished by the post-scale on unpack). Hooks compose by
        wrapping: ``dp_plugin.reduce.hooks.compression_wrapper(allreduce_hook, "bf16")``.
        Replaces ``compression`` (wrap the hook to compress). Every rank must
        register the same hook before the first step.
        """
        if not callable(hook):
            raise TypeError(
                f"register_comm_hook expects a callable hook(state, bucket) -> Handle, got "
                f"{type(hook).__name__}; see dp_plugin.reduce.hooks.allreduce_hook"
            )
        self._dp.check_idle("register_comm_hook()")
        self._dp.comm_hook = hook
        self._dp.register(self)

    def refresh_parameters(self) -> None:
        """Re-plan which parameters are reduced (and which as sparse) after
        ``requires_grad`` (or an embedding's ``sparse``) changed.

        A parameter that did not require a gradient when the optimizer was
        wrapped has no hook and no bucket; unfreezing it later makes
        ``synchronize()`` raise until this is called. Collective: every rank
        calls it at the same point, between steps (the new layout is checked
        across ranks). Freezing needs no refresh: a frozen parameter keeps
        being reduced, contributing zeros.
        """
        self._dp.check_open("refresh_parameters()")
        self._dp.check_idle("refresh_parameters()")
        self._dp.register(self)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate ``passes`` backward passes per step from now on (all ranks alike)."""
        passes = check_int("backward_passes_per_step", passes, minimum=1)
        self._dp.check_idle("set_backward_passes_per_step()")
        self._dp.passes = passes
        self._dp.register(self)

    def synchronize(self) -> None:
        """Wait for this step's gradient reduction; ``.grad`` then holds the result.

        Synchronization point: every rank calls it once per step (``step()``
        does, unless inside ``skip_synchronize()``).
        """
        self._dp.synchronize(self)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside it, ``step()`` does not synchronize (call ``synchronize()`` before)."""
        self._dp.should_synchronize = False
        try:
            yield
        finally:
            self._dp.should_synchronize = True

    # -- torch.optim.Optimizer overrides -------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        st = self._dp
        loss = None
        if closure is not None and st.shard is not None:
            # Called here, not by the update: the groups hold this rank's
            # pieces while it runs (sharded.py).
            with torch.enable_grad():
                loss = closure()
            closure = None
        if closure is not None and st.should_synchronize:
            closure = self._synchronized(closure)
        elif st.should_synchronize:
            if st.synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context "
                    "after optimizer.synchronize(). This can cause training slowdown. You may "
                    "want to consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.", stacklevel=2,
                )
            self.synchronize()
        st.synchronized = False
        if st.skip_step:  # DP_PLUGIN_CHECK_FINITE=skip: every rank skips this step
            st.skip_step = False
            if st.shard is not None:
                st.shard.follow(self)
            return loss
        if st.shard is not None:
            st.shard.step(self, [p.grad.to_dense() if p.grad is not None and p.grad.is_sparse
                                 else p.grad for p in st.params])  # sparse_as_dense's
            return loss
        try:
            return super().step(closure)  # type: ignore[misc]
        except _SkippedStep as skipped:
            return skipped.loss

    # torch wraps a class's step() for profiling and step hooks unless it is
    # marked; the user's class's step() is already wrapped, so hooks run once.
    step.hooked = True  # type: ignore[attr-defined]

    def _plain_step(self) -> Any:
        """The wrapped optimizer's own update, nothing else (``sharded.py``
        runs it on this rank's pieces)."""
        return super().step()  # type: ignore[misc]

    def state_dict(self) -> dict[str, Any]:
        """As torch's. With ``shard_optimizer_state``: collective (every rank
        of the process set calls it at the same point), and the state is the
        whole, unsharded one, as the plain optimizer would have it, so it
        loads into a sharded or an unsharded run of any size."""
        shard = self._dp.shard
        if shard is None:
            return super().state_dict()  # type: ignore[misc]
        self._dp.check_idle("state_dict()")
        state = vars(self)["state"]
        whole = shard.full_state(self)
        pieces = dict(state)
        state.clear()
        state.update(whole)
        try:
            return super().state_dict()  # type: ignore[misc]
        finally:
            state.clear()
            state.update(pieces)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._dp.pending:  # Horovod's words
            raise SynchronizationError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                "cause a race condition."
            )
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but the loaded groups and state go into the objects this
        optimizer shares with the one it wraps: torch rebinds ``param_groups``
        and ``state``, which would leave an LR scheduler built on the plain
        optimizer setting learning rates nobody reads any more."""
        self._dp.check_idle("load_state_dict()")
        groups, state = self.param_groups, vars(self)["state"]
        super().load_state_dict(state_dict)  # type: ignore[misc]
        if self.param_groups is not groups and len(self.param_groups) == len(groups):
            for old, new in zip(groups, self.param_groups, strict=True):
                old.clear()
                old.update(new)
            self.param_groups = groups
        if vars(self)["state"] is not state:
            state.clear()
            state.update(vars(self)["state"])
            vars(self)["state"] = state
        if self._dp.shard is not None:  # keep this rank's pieces of it
            self._dp.shard.split(self, dict(state))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.add_param_group``; the new parameters are reduced too.

        Every rank must add the same group. The next step checks the new
        layout across ranks (one extra small collective).
        """
        st = getattr(self, "_dp", None)
        if st is not None:
            st.check_idle("add_param_group()")
        super().add_param_group(param_group)  # type: ignore[misc]
        if st is not None:
            try:
                st.register(self)
            except BaseException:
                self.param_groups.pop()  # as if it had never been added
                raise

    def _synchronized(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` followed by ``synchronize()``: its backward is reduced each call."""

        def synchronized_closure() -> Any:
            loss = closure()
            self.synchronize()
            if self._dp.skip_step:  # abort the user's step before it updates anything
                self._dp.skip_step = False
                raise _SkippedStep(loss)
            return loss

        return synchronized_closure


class _SkippedStep(Exception):
    """Raised by a synchronized closure to abort ``step()`` on every rank alike
    (``DP_PLUGIN_CHECK_FINITE=skip``; ``step`` catches it and returns ``loss``)."""

    def __init__(self, loss: Any) -> None:
        super().__init__("step skipped: non-finite gradients")
        self.loss = loss


# -- arguments ---------------------------------------------------------------------


def _checked_arguments(op: Any, gradient_predivide_factor: float, num_groups: int,
                       groups: Any, backward_passes_per_step: Any, compression: Any,
                       process_set: Any) -> tuple[ReduceOp, int, Any, Compressor]:
    """``DistributedOptimizer``'s arguments, validated with Horovod's rules:
    (op, passes, groups: ``num_groups`` folded in, the compressor). Every
    mistake raises naming the argument and the fix."""
    with calling("DistributedOptimizer"):
        reduce_op = parse_op(op)
    if gradient_predivide_factor != 1.0 and reduce_op is not ReduceOp.AVERAGE:
        raise ValueError(
            f"gradient_predivide_factor={gradient_predivide_factor!r} is only supported with "
            f"op=hvd.Average, got op={op!r}; leave it at 1.0"
        )
    check_positive_float("gradient_predivide_factor", gradient_predivide_factor)
    groups = check_groups(groups, num_groups, torch.Tensor, "torch.Tensor", stacklevel=4)
    passes = check_int("backward_passes_per_step", backward_passes_per_step, minimum=1)
    try:
        compressor = get_compressor(compression)
    except ValueError:
        raise ValueError(
            f"compression={compression!r} is not supported; use hvd.Compression.none, "
            "hvd.Compression.fp16, hvd.Compression.bf16 or a compressor class with static "
            "compress(tensor) -> (tensor, ctx) and decompress(tensor, ctx)"
        ) from None
    if not isinstance(process_set, ProcessSet):
        raise TypeError(
            f"DistributedOptimizer(process_set=...) expects an hvd.ProcessSet, got "
            f"{type(process_set).__name__}; pass hvd.global_process_set (the default) or a set "
            "registered with hvd.add_process_set(ranks)"
        )
    return reduce_op, passes, groups, compressor


def _check_shard(shard: bool | None, optimizer: torch.optim.Optimizer, eng: Any) -> bool:
    """``shard_optimizer_state``, resolved (None: ``DP_PLUGIN_SHARD_OPTIMIZER_STATE``)
    and checked against the optimizer (``sharded.check_shardable``)."""
    if shard is None:  # outside the process set nothing is reduced: no matter
        shard = eng is not None and eng.config.shard_optimizer_state
    elif not isinstance(shard, bool):
        raise TypeError(
            f"DistributedOptimizer(shard_optimizer_state=...) must be True or False, got "
            f"{shard!r}"
        )
    if shard:
        check_shardable(optimizer)
    return shard


def _warn_if_ddp(named: Iterable[tuple[str, torch.Tensor]] | None) -> None:
    """Warn when ``named_parameters`` look like a ``DistributedDataParallel``'s,
    whose gradients would be averaged twice. torch's DDP leaves no mark on the
    parameters it reduces (its reducer hooks the gradient accumulators in C++),
    so the signal is the names: ``DDP.named_parameters()`` prefixes every one
    with ``module.``."""
    if named is None:
        return
    names = [name for name, _ in named]
    if names and all(name.startswith("module.") for name in names):
        warnings.warn(
            "every name in named_parameters starts with 'module.', as those of a model "
            "wrapped in torch.nn.parallel.DistributedDataParallel: if it is, DDP already "
            "averages the gradients and DistributedOptimizer would reduce them a second "
            "time. Fix: use one of the two, e.g. pass the plain model "
            "(model.module.named_parameters()) and do not wrap it in DDP",
            stacklevel=3,
        )


# -- the Distributed<Name> class ---------------------------------------------------


def _check_wrappable(optimizer: Any) -> None:
    """Refuse what is not an optimizer, or is already wrapped (unless that
    wrapper's engine was shut down: its hooks go, and it is wrapped anew)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"DistributedOptimizer expects a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}; create the optimizer first, then wrap it"
        )
    if isinstance(optimizer, _DistributedOptimizer):
        if not optimizer._dp.closed:
            raise ValueError(
                f"{type(optimizer).__name__} is already a DistributedOptimizer; wrap the plain "
                "optimizer only once (two wrappers would reduce every gradient twice)"
            )
        for handle in optimizer._dp.hooks:  # its engine was shut down: wrap it anew
            handle.remove()


def _wrap(optimizer: torch.optim.Optimizer) -> Any:
    """A ``Distributed<Class>`` instance sharing ``optimizer``'s attributes."""
    plain = type(optimizer).__bases__[1] if isinstance(optimizer, _DistributedOptimizer) \
        else type(optimizer)
    cls = _distributed_class(plain)
    wrapped: Any = object.__new__(cls)  # the optimizer exists already: no __init__
    # Take over the optimizer's attributes (shared, not copied), minus
    # instance attributes that would shadow the wrapper's methods (an LR
    # scheduler created on the plain optimizer stores a wrapped ``step``).
    shadowed = {name for name in vars(_DistributedOptimizer) if not name.startswith("__")}
    wrapped.__dict__.update(
        {k: v for k, v in vars(optimizer).items() if k not in shadowed}
    )
    return wrapped


_classes: dict[type, type[Any]] = {}
_classes_lock = threading.Lock()


def _distributed_class(cls: type[torch.optim.Optimizer]) -> type[Any]:
    """``Distributed<cls>``: the wrapper first, then ``cls``; built once per class."""
    with _classes_lock:
        made = _classes.get(cls)
        if made is None:
            made = types.new_class(f"Distributed{cls.__name__}", (_DistributedOptimizer, cls))
            made.__module__ = __name__
            made.__doc__ = f"{cls.__name__} whose gradients are reduced across ranks " \
                           "(see dp_plugin.torch.DistributedOptimizer)."
            _classes[cls] = made
        return made
