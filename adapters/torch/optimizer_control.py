"""The optimizer methods that use the scheduler's control slot, outside the
gradients: ``hvd.join()``'s zero steps, the marks of parameters unfrozen
after wrapping, and the ``DP_PLUGIN_CHECK_FINITE`` flags.

``_ControlSlotMixin`` is a base of ``distributed_mixin._DistributedMixin``;
like it, everything it touches lives under ``self._dp``
(``optimizer_state.OptimizerState``).
"""

from __future__ import annotations

from typing import Any

import torch
from dp_plugin.errors import DPPluginError
from dp_plugin.torch.basics import engine
from dp_plugin.torch.misuse import check_requires_grad, unfrozen
from dp_plugin.torch.optimizer_state import OptimizerState


class SynchronizationError(DPPluginError, AssertionError):
    """The optimizer was used out of order (e.g. ``zero_grad()`` between
    ``backward()`` and ``step()``). Also an ``AssertionError``, as in Horovod."""


class _ControlSlotMixin:
    """Control-slot methods of ``DistributedOptimizer`` (see the module docstring)."""

    _dp: OptimizerState
    param_groups: list[dict[str, Any]]

    def _dp_note_unfrozen(self) -> None:
        """Mark this rank in the unfrozen marks if a parameter without a hook
        now requires a gradient (they travel with the last bucket)."""
        reducer = self._dp.reducer
        if reducer is not None and unfrozen(self._dp, self.param_groups):
            reducer.unfrozen.mark()

    def _dp_check_unfrozen(self, joined: bool = False) -> None:
        """After the reduction, on every rank alike: raise if any rank marked
        an unfrozen parameter (``misuse.check_requires_grad``). A ``joined``
        rank trains nothing, so only the others' marks count."""
        reducer = self._dp.reducer
        assert reducer is not None
        ranks = reducer.unfrozen.marked()
        if not ranks:  # the usual step: nothing marked, nothing to name
            return
        reducer.unfrozen.reset()
        check_requires_grad([] if joined else unfrozen(self._dp, self.param_groups), ranks)

    def _dp_note_finite(self, grad: torch.Tensor) -> None:
        """Mark this rank in the finite flags if ``grad`` holds inf/nan (before it
        is handed to the scheduler: the flags travel with the last bucket)."""
        reducer = self._dp.reducer
        if reducer is not None and reducer.finite is not None:
            reducer.finite.note(grad)

    def _dp_join_ready(self) -> bool:
        st = self._dp
        if st.closed:
            return False  # left over from before hvd.shutdown(); nothing to answer
        if st.pending:
            raise SynchronizationError(
                "hvd.join() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(); finish the step first, then join"
            )
        return st.reducer is not None

    def _dp_join_start(self) -> None:
        """Start a step in which this rank contributes zero gradients and its
        joined flag (``join``); poll ``_dp_join_polled``, then ``_dp_join_finish``."""
        reducer = self._dp.reducer
        assert reducer is not None  # _dp_join_ready said so
        reducer.flags.fill(joined=True)
        reducer.scheduler.launch_all()

    def _dp_join_polled(self) -> bool:
        reducer = self._dp.reducer
        return reducer is None or reducer.scheduler.all_done()

    def _dp_join_global(self) -> bool:
        eng = self._dp.engine
        return eng is not None and eng.size == engine("hvd.join()").size

    def _dp_join_finish(self) -> bool:
        """End the zero step; has every rank of the optimizer's set joined?"""
        reducer = self._dp.reducer
        assert reducer is not None
        results = reducer.scheduler.synchronize()  # every gradient: zeros; results dropped
        st = self._dp
        st.sparse.reduce(st.params, st.names, st.op, st.engine, reducer.sparse_news,
                         contribute=False)
        self._dp_check_unfrozen(joined=True)  # raise where the training ranks raise
        if reducer.finite is not None:  # raise where the training ranks raise
            reducer.finite.decide([(st.names[p], g) for p, g in zip(st.params, results,
                                                                     strict=True)])
        everyone = reducer.flags.decide()[0]
        if st.sparse.changed:  # the others' gradients turned sparse: re-plan as they do
            st.sparse.changed = False
            self._dp_register()  # type: ignore[attr-defined]
        return everyone
