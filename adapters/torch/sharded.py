"""Sharded optimizer state: ``DistributedOptimizer(shard_optimizer_state=True)``.

ZeRO stage 1 on the optimizer's own gradient buckets (the plan and the
reduce-scatter hook are ``dp_plugin.reduce.sharding``'s). Each rank owns the
``Piece`` s of the parameters that fall in its range of every bucket. Its
``step()``:

1. ``synchronize()`` as always, with each bucket reduce-scattered instead of
   all-reduced: afterwards ``.grad`` holds the averaged gradient on this
   rank's pieces (elsewhere it is undefined);
2. the wrapped optimizer's own ``step()`` runs with each param group's
   ``params`` swapped, for the call only, for 1-D views of this rank's
   pieces (``p.view(-1)[start:stop]``: they share the parameters' memory),
   each given the matching slice of the gradient; the optimizer makes and
   keeps its state (momentum, Adam's moments) for those views only, in its
   own ``optimizer.state``;
3. one all-gather per bucket (all started, then waited for) brings every
   rank's updated pieces into every rank's parameters.

Only an element-wise update (each element's new value reads only that
element's parameter, gradient and state) gives the same result on a slice
as on the whole tensor; ``check_shardable`` admits torch's element-wise
optimizers (and their subclasses) and refuses the rest. ``full_state``
gathers the pieces' state into the unsharded form (``state_dict()``), and
``split`` cuts an unsharded state into this rank's pieces (``load_state_dict``,
and a re-plan of the buckets).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from dp_plugin.api.objects import allgather_object
from dp_plugin.engines.base import Engine
from dp_plugin.reduce.fusion import PlanEntry
from dp_plugin.reduce.reducer import Reducer
from dp_plugin.reduce.sharding import Piece, gather_rows, shard_pieces

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
    torch.optim.Adadelta, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD,
)
"""torch optimizers whose update is element-wise, so that stepping slices of
the parameters gives the unsharded result bitwise. LBFGS (its line search
and history span every parameter), Adafactor (row and column statistics of
each matrix), SparseAdam (sparse gradients only) and any optimizer whose
update reads across elements (orthogonalizing ones such as Muon) are not."""


GATHERS_IN_FLIGHT = 2
"""Parameter all-gathers in flight at once: the next bucket's transfer
overlaps the previous one's unpack. Each returns a whole bucket: all at once
would add a copy of the model to the peak memory that sharding lowers."""


def check_shardable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose update is not element-wise (see ``ELEMENTWISE``)."""
    if isinstance(optimizer, ELEMENTWISE):
        return
    names = ", ".join(f"torch.optim.{c.__name__}" for c in ELEMENTWISE)
    raise ValueError(
        f"shard_optimizer_state=True cannot shard {type(optimizer).__name__}: each rank steps "
        "only a slice of every parameter, which gives the unsharded result only for an "
        "element-wise update, and its update reads across elements or parameters (LBFGS, "
        "Adafactor, SparseAdam and optimizers with cross-parameter state are refused). "
        f"Shardable: {names} and their subclasses. Fix: pass shard_optimizer_state=False "
        "(and unset DP_PLUGIN_SHARD_OPTIMIZER_STATE), or use one of those optimizers"
    )


class ShardedStep:
    """This rank's pieces of one optimizer's parameters, their views, the
    step on them and the all-gather after it (see the module docstring)."""

    def __init__(self, params: Sequence[torch.Tensor], reducer: Reducer, engine: Engine,
                 label: str, groups: list[dict[str, Any]]) -> None:
        self.params = list(params)
        self.reducer = reducer
        self.engine = engine
        self.label = label
        self.plan: list[PlanEntry] = []
        """The plan the pieces were cut from: the one this step's gradients were
        reduced with, even when ``synchronize()`` re-planned at its end."""
        self.pieces: list[Piece] = []
        self.views: list[torch.Tensor] = []
        self.group_views: list[list[torch.Tensor]] = []
        self.version = -1
        self._build(groups)

    def _build(self, groups: list[dict[str, Any]]) -> None:
        """Pieces and views for the reducer's current plan."""
        for p in self.params:
            if not p.is_contiguous():
                raise ValueError(
                    f"shard_optimizer_state=True needs contiguous parameters, but one of shape "
                    f"{tuple(p.shape)} has strides {p.stride()} (channels_last?); its slices "
                    "would not be flat. Fix: make the model's parameters contiguous before "
                    "wrapping (model.to(memory_format=torch.contiguous_format)), or pass "
                    "shard_optimizer_state=False"
                )
        eng = self.engine
        self.plan = list(self.reducer.plan)
        self.pieces = shard_pieces(self.plan, [p.numel() for p in self.params],
                                   eng.rank, eng.size)
        self.views = [self.params[pc.index].detach().view(-1)[pc.start:pc.stop]
                      for pc in self.pieces]
        group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
        self.group_views = [[] for _ in groups]
        for pc, view in zip(self.pieces, self.views, strict=True):
            self.group_views[group_of[id(self.params[pc.index])]].append(view)
        self.version = self.reducer.plan_version

    # -- a step ----------------------------------------------------------------------
    def step(self, optimizer: Any, grads: Sequence[torch.Tensor | None]) -> None:
        """Step this rank's pieces with ``optimizer``'s own update (``grads``:
        the reduced gradient of each parameter, by index), then all-gather
        the updated pieces. Collective: every rank of the channel calls it
        once per step, after the same ``synchronize()``."""
        with torch.no_grad():
            for pc, view in zip(self.pieces, self.views, strict=True):
                grad = grads[pc.index]
                view.grad = None if grad is None else grad.reshape(-1)[pc.start:pc.stop]
        groups = optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g, views in zip(groups, self.group_views, strict=True):
                g["params"] = views
            optimizer._plain_step()
        finally:
            for g, params in zip(groups, saved, strict=True):
                g["params"] = params
            for view in self.views:
                view.grad = None
        self.gather()
        self.follow(optimizer)

    def follow(self, optimizer: Any) -> None:
        """After a step (or a skipped one): if that ``synchronize()`` re-planned
        the buckets (the first step's rebuild, autotune), move the state to
        the new pieces. Collective, like the step."""
        if self.reducer.plan_version != self.version:
            self.reshard(optimizer)

    def gather(self) -> None:
        """Every rank's updated pieces into every rank's parameters: one
        all-gather per bucket, ``GATHERS_IN_FLIGHT`` at a time."""
        eng, size = self.engine, self.engine.size
        started: list[tuple[PlanEntry, Any, Any]] = []
        for b in self.plan:
            if b.numel == 0:
                continue  # alike on every rank (one plan)
            if len(started) == GATHERS_IN_FLIGHT:
                self._unpack(*started.pop(0))
            mine = [v for pc, v in zip(self.pieces, self.views, strict=True)
                    if pc.bucket == b.index]
            like = self.params[b.members[0]]
            shard = torch.cat(mine) if mine else like.new_empty(0)
            handle, result = eng.allgather_async(shard, gather_rows(b, size),
                                                 name=f"{self.label}.gather{b.index}")
            started.append((b, handle, result))
        for item in started:
            self._unpack(*item)

    def _unpack(self, b: PlanEntry, handle: Any, result: Any) -> None:
        handle.wait()
        full = result()
        with torch.no_grad():
            for index, offset in zip(b.members, b.offsets, strict=True):
                p = self.params[index]
                p.detach().view(-1).copy_(full[offset:offset + p.numel()])

    # -- the state, sharded and whole -----------------------------------------------
    def full_state(self, optimizer: Any) -> dict[torch.Tensor, dict[str, Any]]:
        """The optimizer state of every parameter, unsharded (as the plain
        optimizer would hold it), on every rank. Collective (one
        ``allgather_object`` of every rank's pieces)."""
        whole = self._whole(optimizer, list(zip(self.pieces, self.views, strict=True)),
                            f"{self.label}.state")
        return {self.params[index]: state for index, state in whole.items()}

    def _whole(self, optimizer: Any, mine: list[tuple[Piece, torch.Tensor]],
               name: str) -> dict[int, dict[str, Any]]:
        """The unsharded state, by parameter index, of the parameters whose
        pieces this rank gives as ``mine`` (and the other ranks as theirs).
        Collective (one ``allgather_object``)."""
        held: dict[int, list[tuple[int, int, dict[str, Any]]]] = {}
        for pc, view in mine:
            state = optimizer.state.get(view)
            if state:
                held.setdefault(pc.index, []).append((pc.start, pc.stop, {
                    k: (v.detach().cpu(), str(v.device)) if torch.is_tensor(v) else (v, None)
                    for k, v in state.items()}))
        everyone = allgather_object(self.engine, held, name)
        whole: dict[int, dict[str, Any]] = {}
        for index in sorted({index for theirs in everyone for index in theirs}):
            parts = sorted((part for theirs in everyone if index in theirs
                            for part in theirs[index]), key=lambda part: part[0])
            whole[index] = {key: _joined(self.params[index], parts, key) for key in parts[0][2]}
        return whole

    def split(self, optimizer: Any, full: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Replace ``optimizer.state`` by this rank's slices of ``full`` (the
        unsharded state, keyed by parameter)."""
        optimizer.state.clear()
        self._place(optimizer, lambda index: full.get(self.params[index]))

    def _place(self, optimizer: Any, whole: Callable[[int], dict[str, Any] | None]) -> None:
        """Give each of this rank's pieces its slice of ``whole(index)``, the
        unsharded state of its parameter (None or empty: no state)."""
        for pc, view in zip(self.pieces, self.views, strict=True):
            state = whole(pc.index)
            if state:
                p = self.params[pc.index]
                optimizer.state[view] = {k: _sliced(v, p, pc) for k, v in state.items()}

    def reshard(self, optimizer: Any) -> None:
        """The buckets were re-planned: move the state to the new pieces, one
        bucket of the old plan at a time (a parameter lies in one bucket, so
        its pieces' state is whole once that bucket's is gathered). At most
        one bucket's state is whole at once, not the model's: the first
        step's re-plan must not need the memory that sharding saves."""
        old = list(zip(self.pieces, self.views, strict=True))
        old_plan = self.plan
        self._build(optimizer.param_groups)
        for b in old_plan:
            mine = [(pc, view) for pc, view in old if pc.bucket == b.index]
            whole = self._whole(optimizer, mine, f"{self.label}.state{b.index}")
            for _, view in mine:
                optimizer.state.pop(view, None)
            self._place(optimizer, whole.get)


def _joined(p: torch.Tensor, parts: list[tuple[int, int, dict[str, Any]]], key: str) -> Any:
    """One state entry of ``p``, whole: the pieces' slices put together when
    the entry is per element (1-D, one value per element of the piece), else
    the first piece's value (a step count, alike on every piece)."""
    values = [part[2][key] for part in parts]
    first, device = values[0]
    per_element = all(torch.is_tensor(v) and v.dim() == 1 and v.numel() == stop - start
                      for (start, stop, _), (v, _) in zip(parts, values, strict=True))
    if per_element and sum(stop - start for start, stop, _ in parts) == p.numel():
        return torch.cat([v for v, _ in values]).view(p.shape).to(device)
    return first.to(device) if torch.is_tensor(first) else first


def _sliced(value: Any, p: torch.Tensor, pc: Piece) -> Any:
    """This piece's part of one unsharded state entry of ``p``."""
    if not torch.is_tensor(value):
        return value
    if value.shape == p.shape and p.dim() > 0:
        return value.detach().reshape(-1)[pc.start:pc.stop].clone()
    return value.detach().clone()
