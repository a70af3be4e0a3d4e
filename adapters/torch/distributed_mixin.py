"""The methods a ``DistributedOptimizer`` adds to the user's optimizer class.

``_DistributedMixin`` is placed first in the MRO of ``Distributed<Name>``
(see ``optimizer.py``) and uses plain ``super()``. Everything it adds lives
under one attribute, ``_dp`` (``optimizer_state.OptimizerState``). Gradients go through ONE
``GradientScheduler`` per optimizer: a post-accumulate-grad hook on every
parameter that requires a gradient reports it ready, and complete fusion
buckets are all-reduced while backward still runs; ``step()`` first calls
``synchronize()``. ``hvd.join()`` flags travel in the scheduler's control slot.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from dp_plugin.engines.base import ReduceOp
from dp_plugin.errors import DPPluginError
from dp_plugin.process_sets import ProcessSet
from dp_plugin.timeline import StatsHistory
from dp_plugin.torch.finite import SkippedStep
from dp_plugin.torch.misuse import check_open, check_requires_grad, unfrozen
from dp_plugin.torch.optimizer_args import default_name
from dp_plugin.torch.optimizer_control import SynchronizationError, _ControlSlotMixin
from dp_plugin.torch.optimizer_state import OptimizerState, build_reducer
from dp_plugin.validate import check_int

_RACE_MESSAGE = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)


class _DistributedMixin(_ControlSlotMixin):
    """Methods placed in front of the user's optimizer class in the MRO."""

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
        return None if reducer is None else reducer.scheduler.stats

    def register_comm_hook(self, hook: Callable[..., Any]) -> None:
        """Reduce each fusion bucket with ``hook(state, bucket) -> Handle``
        instead of the default all-reduce (PyTorch DDP's ``register_comm_hook``).

        ``bucket.buffer()`` holds the packed, pre-scaled gradients; after the
        returned handle completes it must hold what every rank agrees on (the
        average is finished by the post-scale on unpack). Hooks compose by
        wrapping: ``dp_plugin.hooks.compression_wrapper(allreduce_hook, "bf16")``.
        Replaces ``compression`` (wrap the hook to compress). Every rank must
        register the same hook before the first step.
        """
        if not callable(hook):
            raise TypeError(
                f"register_comm_hook expects a callable hook(state, bucket) -> Handle, got "
                f"{type(hook).__name__}; see dp_plugin.hooks.allreduce_hook"
            )
        self._dp_check_idle("register_comm_hook()")
        self._dp.comm_hook = hook
        self._dp_register()

    def refresh_parameters(self) -> None:
        """Re-plan which parameters are reduced after ``requires_grad`` changed.

        A parameter that did not require a gradient when the optimizer was
        wrapped has no hook and no bucket; unfreezing it later makes
        ``synchronize()`` raise until this is called. Collective: every rank
        calls it at the same point, between steps (the new layout is checked
        across ranks). Freezing needs no refresh: a frozen parameter keeps
        being reduced, contributing zeros.
        """
        check_open(self._dp, "refresh_parameters()")
        self._dp_check_idle("refresh_parameters()")
        self._dp_register()

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate ``passes`` backward passes per step from now on (all ranks alike)."""
        passes = check_int("backward_passes_per_step", passes, minimum=1)
        self._dp_check_idle("set_backward_passes_per_step()")
        self._dp.passes = passes
        self._dp_register()

    def synchronize(self) -> None:
        """Wait for this step's gradient reduction; ``.grad`` then holds the result.

        Synchronization point: every rank calls it once per step (``step()``
        does, unless inside ``skip_synchronize()``).
        """
        st = self._dp
        check_open(st, "synchronize()")
        if st.reducer is None:
            st.pending = False
            check_requires_grad(unfrozen(st, self.param_groups))
            st.synchronized = True
            return
        if not st.pending:  # no hook fired this step: look for unfrozen parameters now
            self._dp_note_unfrozen()
        sched, flags = st.reducer.scheduler, st.reducer.flags
        for i, p in enumerate(st.params):
            if not st.marked[i] and p.grad is not None:
                # Horovod reduces an existing gradient whose hook did not fire.
                self._dp_note_finite(p.grad)
                dense = self._dp_dense(i, p.grad)
                if dense is not None:
                    sched.mark_ready(i, dense)
        if st.sparse.changed:  # before the last bucket starts: for a joined rank
            st.reducer.sparse_news.mark()
        results = sched.synchronize()
        st.sparse.reduce(st.params, st.names, st.op, st.engine, st.reducer.sparse_news)
        try:  # after this step's collectives, before any update
            self._dp_check_unfrozen()
        except DPPluginError:  # the step is dropped: the next one starts clean
            flags.keep()
            if st.reducer.finite is not None:
                st.reducer.finite.reset()
            self._dp_reset_step()
            raise
        for i, p in enumerate(st.params):
            if st.sparse.owns(p):
                continue  # reduced above, outside the buckets
            reduced = results[i]
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
        finite = st.reducer.finite
        if finite is not None:  # may raise (on every rank alike)
            st.skip_step = finite.decide([(st.names[p], p.grad) for p in st.params])
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
        if st.skip_step:  # DP_PLUGIN_CHECK_FINITE=skip: every rank skips this step
            st.skip_step = False
            return None
        try:
            return super().step(closure)  # type: ignore[misc]
        except SkippedStep as skipped:
            return skipped.loss

    # torch wraps a class's step() for profiling and step hooks unless it is
    # marked; the user's class's step() is already wrapped, so hooks run once.
    step.hooked = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._dp.pending:
            raise SynchronizationError(_RACE_MESSAGE)
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but the loaded groups and state go into the objects this
        optimizer shares with the one it wraps: torch rebinds ``param_groups``
        and ``state``, which would leave an LR scheduler built on the plain
        optimizer setting learning rates nobody reads any more."""
        self._dp_check_idle("load_state_dict()")
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
            if self._dp.skip_step:  # abort the user's step before it updates anything
                self._dp.skip_step = False
                raise SkippedStep(loss)
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
        reducer = build_reducer(self._dp, params, names)
        for handle in st.hooks:
            handle.remove()
        st.names.update(names)
        st.params, st.reducer, st.hooks = params, reducer, []
        reduced = {id(p) for p in params}
        st.frozen = [(gi, pj) for gi, group in enumerate(self.param_groups)
                     for pj, p in enumerate(group["params"]) if id(p) not in reduced]
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
                new_names[p] = default_name(group, gi, pj)
        return params, new_names

    def _dp_grad_ready(self, index: int, param: torch.Tensor) -> None:
        st = self._dp
        if st.closed:
            return  # a wrapper left over from before hvd.shutdown(): step() raises
        if not st.pending:  # the step's first gradient: before any bucket launches
            self._dp_note_unfrozen()
        st.pending = True
        grad = param.grad
        if st.reducer is None or grad is None:
            return
        self._dp_note_finite(grad)
        dense = self._dp_dense(index, grad)
        if dense is not None:
            sched = st.reducer.scheduler
            if dense is grad and _viewable(grad, st.engine):
                # gradient_as_bucket_view: .grad becomes its slice of the fusion
                # buffer (one copy now, if it was not already); the bucket then
                # needs no pack or unpack copy, and a gradient zeroed in place
                # (zero_grad(set_to_none=False)) stays the view: no copy at all.
                dense = sched.adopt(index, grad)
                if dense is not grad:
                    param.grad = dense
            sched.mark_ready(index, dense)
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

def _viewable(grad: torch.Tensor, engine: Any) -> bool:
    """May ``grad`` become a view of the fusion buffer? Not when the user
    turned it off, nor for a gradient that is part of a graph
    (``backward(create_graph=True)``: autograd replaces it out of place), nor
    for one laid out unlike a flat slice (a channels-last parameter's):
    docs/torch.md, "Gradients as views of the fusion buffer"."""
    return bool(engine is not None and engine.config.gradient_as_bucket_view
                and not grad.requires_grad and grad.layout == torch.strided
                and grad.is_contiguous())


def _make_hook(ref: weakref.ref[Any], index: int) -> Callable[[torch.Tensor], None]:
    # Weak: a dropped optimizer must not keep reducing through old hooks.
    def hook(param: torch.Tensor) -> None:
        optimizer = ref()
        if optimizer is not None:
            optimizer._dp_grad_ready(index, param)

    return hook


