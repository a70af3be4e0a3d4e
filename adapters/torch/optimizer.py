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

import collections
import contextlib
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from dp_plugin.compression import Compressor, get_compressor
from dp_plugin.engines.base import Engine, ReduceOp
from dp_plugin.errors import DPPluginError
from dp_plugin.fusion import TensorSpec
from dp_plugin.scheduler import GradientScheduler
from dp_plugin.timeline import StatsHistory
from dp_plugin.torch import joining as _join
from dp_plugin.torch.basics import engine as _global_engine
from dp_plugin.torch.basics import shared_timeline
from dp_plugin.torch.ops import Average, Compression, parse_op
from dp_plugin.torch.process_sets import ProcessSet, global_process_set
from dp_plugin.torch.sparse import SparseGradients

_RACE_MESSAGE = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)


class SynchronizationError(DPPluginError, AssertionError):
    """The optimizer was used out of order (e.g. ``zero_grad()`` between
    ``backward()`` and ``step()``). Also an ``AssertionError``, as in Horovod."""


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
    _check_groups(groups)
    if (isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int)
            or backward_passes_per_step <= 0):
        raise ValueError(
            f"backward_passes_per_step must be an int > 0, got {backward_passes_per_step!r}"
        )
    compressor = _compressor(compression)
    eng = _engine_of(process_set)
    names = _parameter_names(optimizer.param_groups, named_parameters)

    cls = _distributed_class(type(optimizer))
    wrapped: Any = object.__new__(cls)  # the optimizer exists already: no __init__
    # Take over the optimizer's attributes (shared, not copied), minus
    # instance attributes that would shadow the mixin's methods (an LR
    # scheduler created on the plain optimizer stores a wrapped ``step``).
    shadowed = {name for name in vars(_DistributedMixin) if not name.startswith("__")}
    wrapped.__dict__.update(
        {k: v for k, v in vars(optimizer).items() if k not in shadowed}
    )
    wrapped._dp = _State(
        names=names, named=named_parameters is not None, compressor=compressor, op=reduce_op,
        predivide=float(gradient_predivide_factor), passes=backward_passes_per_step,
        sparse_as_dense=bool(sparse_as_dense), groups=groups, process_set=process_set,
        engine=eng,
    )
    wrapped._dp_register()
    _join.register(wrapped)
    return wrapped


@dataclass(frozen=True, eq=False)
class _Reducer:
    """The scheduler of one optimizer and the join flags it carries (spec index 0)."""

    scheduler: GradientScheduler
    flags: _join.JoinFlags


@dataclass(eq=False)
class _State:
    """Everything the mixin adds to the optimizer, under one attribute (``_dp``)."""

    names: dict[torch.Tensor, str]
    named: bool
    compressor: Compressor
    op: ReduceOp
    predivide: float
    passes: int
    sparse_as_dense: bool
    groups: Any
    process_set: ProcessSet
    engine: Engine | None
    """None when this rank is outside the process set: nothing is reduced."""
    params: list[torch.Tensor] = field(default_factory=list)
    hooks: list[Any] = field(default_factory=list)
    reducer: _Reducer | None = None
    """None when nothing is reduced (one rank, outside the process set, no parameters)."""
    marked: list[bool] = field(default_factory=list)
    sparse_dims: list[int | None] = field(default_factory=list)
    sparse: SparseGradients = field(default_factory=SparseGradients)
    """Sparse gradients reduced outside the buckets (``sparse_as_dense=False``)."""
    pending: bool = False
    synchronized: bool = False
    should_synchronize: bool = True


class _DistributedMixin:
    """Methods placed in front of the user's optimizer class in the MRO."""

    _dp: _State
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

    def comm_stats(self) -> StatsHistory | None:
        """Per-step communication stats of the gradient reduction (``StepStats``:
        bytes, all-reduce time, exposed time not hidden behind backward); None
        when nothing is reduced (one rank). Restarts when the buckets are re-planned."""
        reducer = self._dp.reducer
        return None if reducer is None else reducer.scheduler.stats

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate ``passes`` backward passes per step from now on (all ranks alike)."""
        if isinstance(passes, bool) or not isinstance(passes, int) or passes <= 0:
            raise ValueError(f"backward_passes_per_step must be an int > 0, got {passes!r}")
        self._dp_check_idle("set_backward_passes_per_step()")
        self._dp.passes = passes
        self._dp_register()

    def synchronize(self) -> None:
        """Wait for this step's gradient reduction; ``.grad`` then holds the result.

        Synchronization point: every rank calls it once per step (``step()``
        does, unless inside ``skip_synchronize()``).
        """
        st = self._dp
        if st.reducer is None:
            st.pending = False
            st.synchronized = True
            return
        sched, flags = st.reducer.scheduler, st.reducer.flags
        for i, p in enumerate(st.params):
            if not st.marked[i] and p.grad is not None:
                # Horovod reduces an existing gradient whose hook did not fire.
                dense = self._dp_dense(i, p.grad)
                if dense is not None:
                    sched.mark_ready(i + 1, dense)
        sched.mark_ready(0, flags.fill(joined=False))
        results = sched.synchronize()
        st.sparse.reduce(st.params, st.names, st.op, st.process_set)
        for i, p in enumerate(st.params):
            if st.sparse.owns(p):
                continue  # reduced above, outside the buckets
            reduced = results[i + 1]
            sparse_dim = st.sparse_dims[i]
            if sparse_dim is not None:
                p.grad = reduced.to_sparse(sparse_dim)
            elif p.grad is None:
                p.grad = reduced
            elif p.grad is not reduced:
                with torch.no_grad():
                    p.grad.copy_(reduced)
        flags.keep()
        self._dp_reset_step()
        st.synchronized = True
        if st.sparse.changed:  # take the new sparse parameters out of the buckets
            st.sparse.changed = False
            self._dp_register()

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
        if closure is not None and st.should_synchronize:
            closure = self._dp_synchronized(closure)
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
        return super().step(closure)  # type: ignore[misc]

    # torch wraps a class's step() for profiling and step hooks unless it is
    # marked; the user's class's step() is already wrapped, so hooks run once.
    step.hooked = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._dp.pending:
            raise SynchronizationError(_RACE_MESSAGE)
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._dp_check_idle("load_state_dict()")
        super().load_state_dict(state_dict)  # type: ignore[misc]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.add_param_group``; the new parameters are reduced too.

        Every rank must add the same group. The next step checks the new
        layout across ranks (one extra small collective).
        """
        st = getattr(self, "_dp", None)
        if st is not None:
            self._dp_check_idle("add_param_group()")
        super().add_param_group(param_group)  # type: ignore[misc]
        if st is not None:
            try:
                self._dp_register()
            except BaseException:
                self.param_groups.pop()  # as if it had never been added
                raise

    # -- internals -------------------------------------------------------------------
    def _dp_synchronized(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` followed by ``synchronize()``: its backward is reduced each call."""

        def synchronized_closure() -> Any:
            loss = closure()
            self.synchronize()
            return loss

        return synchronized_closure

    def _dp_check_idle(self, what: str) -> None:
        if self._dp.pending:
            raise SynchronizationError(
                f"optimizer.{what} was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(); finish the step first "
                "(the gradients of this step are being reduced)"
            )

    def _dp_register(self) -> None:
        """(Re)build the hooks and the scheduler for the current param_groups.

        Transactional: on an error (an unnamed or unsupported parameter) the
        previous hooks and scheduler stay in place.
        """
        st = self._dp
        params, names = self._dp_collect()
        reducer = self._dp_reducer(params, names)
        for handle in st.hooks:
            handle.remove()
        st.names.update(names)
        st.params, st.reducer, st.hooks = params, reducer, []
        self._dp_reset_step()
        ref = weakref.ref(self)
        for index, p in enumerate(params):
            st.hooks.append(p.register_post_accumulate_grad_hook(_make_hook(ref, index)))

    def _dp_collect(self) -> tuple[list[torch.Tensor], dict[torch.Tensor, str]]:
        """The parameters to reduce (requiring grad, in group order) and names for new ones."""
        st = self._dp
        params: list[torch.Tensor] = []
        new_names: dict[torch.Tensor, str] = {}
        seen: set[int] = set()
        for gi, group in enumerate(self.param_groups):
            for pj, p in enumerate(group["params"]):
                if not p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                params.append(p)
                if p in st.names:
                    continue
                if st.named:
                    raise ValueError(
                        "named_parameters was given to DistributedOptimizer, but the parameter "
                        f"param_groups[{gi}]['params'][{pj}] (shape {tuple(p.shape)}) added "
                        "later has no name; pass every parameter in named_parameters (e.g. "
                        "model.named_parameters())"
                    )
                new_names[p] = _default_name(group, gi, pj)
        return params, new_names

    def _dp_reducer(self, params: list[torch.Tensor],
                    new_names: dict[torch.Tensor, str]) -> _Reducer | None:
        """The scheduler (and join flags) for ``params``; None if nothing is reduced."""
        st = self._dp
        eng = st.engine
        if eng is None or eng.size == 1 or not params:
            return None
        first = params[0]
        flags = _join.JoinFlags(
            op=st.op, predivide=st.predivide, ranks=_ranks_of(st.process_set, eng),
            slot=eng.rank, dtype=first.dtype, device=first.device,
        )
        # The flags are registered first so that they land in the last
        # bucket, which is launched at synchronize() anyway.
        specs = [flags.spec]
        for p in params:
            name = st.names.get(p) or new_names[p]
            try:
                specs.append(TensorSpec.of(name, st.sparse.dense_stand_in(p)))
            except TypeError as exc:
                raise TypeError(
                    f"DistributedOptimizer cannot reduce parameter {name!r}: {exc}"
                ) from None
        # One name for every optimizer: the horovod engine matches collectives
        # by name (plus a slot in program order), so a name that depends on
        # nothing rank-local keeps it in step exactly when the order-matched
        # engines are, and a layout difference still meets in the layout
        # check and gets its clear error.
        scheduler = GradientScheduler(
            specs, engine=eng, op=st.op, compression=st.compressor,
            gradient_predivide_factor=st.predivide, backward_passes_per_step=st.passes,
            timeline=shared_timeline, name="DistributedOptimizer",
        )
        return _Reducer(scheduler, flags)

    def _dp_grad_ready(self, index: int, param: torch.Tensor) -> None:
        st = self._dp
        st.pending = True
        grad = param.grad
        if st.reducer is None or grad is None:
            return
        dense = self._dp_dense(index, grad)
        if dense is not None:
            st.reducer.scheduler.mark_ready(index + 1, dense)
        st.marked[index] = True

    def _dp_dense(self, index: int, grad: torch.Tensor) -> torch.Tensor | None:
        """The gradient for the dense buckets; None if it is reduced as sparse."""
        if not grad.is_sparse:
            return grad
        st = self._dp
        if not st.sparse_as_dense:
            st.sparse.add(st.params[index], grad)
            return None
        st.sparse_dims[index] = grad.sparse_dim()
        return grad.to_dense()

    def _dp_reset_step(self) -> None:
        st = self._dp
        st.marked = [False] * len(st.params)
        st.sparse_dims = [None] * len(st.params)
        st.pending = False

    def _dp_join_ready(self) -> bool:
        st = self._dp
        if st.pending:
            raise SynchronizationError(
                "hvd.join() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(); finish the step first, then join"
            )
        return st.reducer is not None

    def _dp_join_step(self) -> tuple[bool, int]:
        """A step in which this rank contributes zero gradients and its joined flag."""
        reducer = self._dp.reducer
        if reducer is None:
            return True, -1
        reducer.scheduler.mark_ready(0, reducer.flags.fill(joined=True))
        reducer.scheduler.synchronize()  # every other tensor: zeros; results are dropped
        st = self._dp
        st.sparse.reduce(st.params, st.names, st.op, st.process_set, contribute=False)
        return reducer.flags.decide()


def _make_hook(ref: weakref.ref[Any], index: int) -> Callable[[torch.Tensor], None]:
    # Weak: a dropped optimizer must not keep reducing through old hooks.
    def hook(param: torch.Tensor) -> None:
        optimizer = ref()
        if optimizer is not None:
            optimizer._dp_grad_ready(index, param)

    return hook


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


def _compressor(compression: Any) -> Compressor:
    try:
        return get_compressor(compression)
    except ValueError:
        raise ValueError(
            f"compression={compression!r} is not supported; use hvd.Compression.none, "
            "hvd.Compression.fp16 or hvd.Compression.bf16 (dp_plugin compresses whole fusion "
            "buffers, so Horovod-style per-tensor compressor classes cannot be plugged in)"
        ) from None


def _engine_of(process_set: ProcessSet) -> Engine | None:
    """The engine that reduces over ``process_set``; None if this rank is not in it
    (as in Horovod, the optimizer then steps on local gradients)."""
    eng = _global_engine("hvd.DistributedOptimizer()")
    if not isinstance(process_set, ProcessSet):
        raise TypeError(
            f"DistributedOptimizer(process_set=...) expects an hvd.ProcessSet, got "
            f"{type(process_set).__name__}; pass hvd.global_process_set (the default) or a set "
            "registered with hvd.add_process_set(ranks)"
        )
    if process_set.process_set_id == 0:
        return eng
    if not process_set.included():
        return None
    return process_set.engine()


def _ranks_of(process_set: ProcessSet, eng: Engine) -> list[int]:
    """Global rank of each rank of the optimizer's engine (slot order)."""
    if process_set.process_set_id == 0:
        return list(range(eng.size))
    return sorted(process_set.ranks or [])


def _parameter_names(
    param_groups: list[dict[str, Any]], named_parameters: Iterable[tuple[str, torch.Tensor]] | None
) -> dict[torch.Tensor, str]:
    """Name of each parameter: from ``named_parameters`` (validated), else Horovod's default."""
    if named_parameters is None:
        return {p: _default_name(group, i, j)
                for i, group in enumerate(param_groups) for j, p in enumerate(group["params"])}
    named = list(named_parameters)
    bad = [item for item in named if not isinstance(item, tuple) or len(item) != 2]
    if bad:
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually "
            f"produced by model.named_parameters(); got {type(bad[0]).__name__} {bad[0]!r:.80}"
        )
    counts = collections.Counter(name for name, _ in named)
    duplicates = sorted(name for name, count in counts.items() if count > 1)
    if duplicates:
        raise ValueError(
            "Parameter names in named_parameters must be unique. Found duplicates: "
            + ", ".join(duplicates)
        )
    names: dict[torch.Tensor, str] = {}
    for name, p in sorted(named, key=lambda item: item[0]):
        names.setdefault(p, name)
    missing = [
        f"param_groups[{i}]['params'][{j}] (shape {tuple(p.shape)})"
        for i, group in enumerate(param_groups) for j, p in enumerate(group["params"])
        if p not in names
    ]
    if missing:
        raise ValueError(
            "named_parameters was specified, but one or more model parameters were not "
            f"named: {', '.join(missing)}. Pass every parameter of the optimizer, e.g. "
            "named_parameters=model.named_parameters()"
        )
    return names


def _default_name(group: dict[str, Any], i: int, j: int) -> str:
    """Horovod's default name, or torch's own when the optimizer was given named
    parameters (torch >= 2.6 keeps them in the group's ``param_names``)."""
    names = group.get("param_names")
    if names is not None and j < len(names):
        return str(names[j])
    return f"allreduce.noname.{i}.{j}"


def _check_groups(groups: Any) -> None:
    """Horovod's validation of ``groups``: an int > 0 or a list of lists of tensors."""
    if groups is None:
        return
    if isinstance(groups, list):
        seen: set[int] = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError(
                        f"groups must consist of torch.Tensor, got {type(p).__name__}"
                    )
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
        return
    if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
        raise ValueError(
            "groups should be a non-negative integer or a list of list of torch.Tensor, "
            f"got {groups!r}"
        )
