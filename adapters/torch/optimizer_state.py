"""What a ``DistributedOptimizer`` keeps and does for its gradients.

``OptimizerState`` is the wrapper's one attribute, ``_dp`` (not torch's
``optimizer.state``, which holds the user's momentum buffers): the
parameters it reduces and their names, a post-accumulate-grad hook on each,
the core's ``Reducer`` on the optimizer's own channel, the ``Marks`` read
from its per-rank flags (``control_slot.py``) and the step in
progress. The wrapper (``optimizer.py``) calls it, and ``hvd.join()``
(``joining.py``) runs its zero steps on it.

A step: each hook reports its gradient ready (``grad_ready``) and complete
fusion buckets are all-reduced while backward still runs; ``synchronize``
reduces what no hook reported, waits, writes the results into ``.grad`` and
reads the control slot, alike on every rank.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from dp_plugin.agree.edge import calling
from dp_plugin.api.horovod_names import require_sum_or_average
from dp_plugin.api.process_sets import ProcessSet, engine_or_none
from dp_plugin.api.timeline import shared_timeline
from dp_plugin.engines.base import Engine, ReduceOp
from dp_plugin.errors import DPPluginError
from dp_plugin.reduce.compression import Compressor
from dp_plugin.reduce.fusion import TensorSpec, group_indices
from dp_plugin.reduce.hooks import ReducePolicy, compression_wrapper
from dp_plugin.reduce.reducer import Reducer
from dp_plugin.reduce.sharding import reducescatter_hook
from dp_plugin.torch.control_slot import FiniteFlags, RankMarks
from dp_plugin.torch.sharded import ShardedStep
from dp_plugin.torch.sparse import SparseGradients, sparse_embedding_weights

Groups = list[dict[str, Any]]
"""``optimizer.param_groups``."""


class JoinFlags(RankMarks):
    """The "join" flags of one optimizer's reducer: one element per rank of
    its process set, marked by a rank that has joined (``joining.join``).

    A training step only keeps a device-side copy of the reduced elements
    (``keep``: no host synchronization, nothing for a GPU to wait on); a
    join step reads them on the host (``decide``).
    """

    def __init__(self, reducer: Any, *, op: ReduceOp, like: torch.Tensor) -> None:
        super().__init__(reducer, "join", op=op, like=like)
        self._previous = torch.empty_like(self._elements())
        self._has_previous = False

    def fill(self, joined: bool) -> None:
        """Write this rank's flags for the next step."""
        self.reset()
        self.mark(joined)

    def keep(self) -> None:
        """After a training step: remember its reduced flags (for a later
        ``decide``), then reset them to idle for the next step."""
        self._previous.copy_(self._elements())
        self._has_previous = True
        self.reset()

    def anyone(self) -> bool:
        """After the reduction, before ``keep``/``decide``: has any rank
        joined in this step? (The reducer's ``postpone_rebuild``.)"""
        return any(self.flags(self._elements()))

    def decide(self) -> tuple[bool, int]:
        """After a join step: (has every rank joined?, global rank that joined last).

        The last joiners are the ranks that joined in this step; of several,
        the highest rank is returned (they joined in the same step).
        """
        joined = self.flags(self._elements())
        before = self.flags(self._previous) if self._has_previous else [False] * len(joined)
        self.keep()
        if not all(joined):
            return False, -1
        self._has_previous = False  # the next join() round starts afresh
        newest = [i for i, (now, was) in enumerate(zip(joined, before, strict=True))
                  if now and not was]
        return True, self.ranks[max(newest) if newest else len(joined) - 1]


@dataclass(frozen=True, eq=False)
class Marks:
    """What an optimizer writes into and reads from its reducer's flag groups."""

    join: JoinFlags
    unfrozen: RankMarks
    """Ranks that found a parameter unfrozen after wrapping (``unfrozen``)."""
    sparse: RankMarks
    """Ranks that got a sparse gradient for a parameter not wrapped as sparse."""
    finite: FiniteFlags | None = None
    """The ``DP_PLUGIN_CHECK_FINITE`` flags; None when the check is off."""


@dataclass(eq=False, repr=False, kw_only=True)
class OptimizerState:
    """One optimizer's gradient reduction (see the module docstring)."""

    names: dict[torch.Tensor, str]
    named: bool
    """Names came from ``named_parameters``: a parameter added later needs one."""
    compression: Any
    """The ``compression`` argument as the user gave it; ``compressor``: what it names."""
    compressor: Compressor
    op: ReduceOp
    predivide: float
    passes: int
    sparse_as_dense: bool
    process_set: ProcessSet
    engine: Engine | None
    """The optimizer's own channel of the set's engine (``Engine.channel``);
    None when this rank is outside the process set: nothing is reduced."""
    label: str
    """Names its collectives; unique per optimizer in the process."""
    groups: int | list[list[torch.Tensor]] | None = None
    """Horovod's ``groups`` (validated): how many groups to cut the parameters
    into, or lists of parameters, each reduced as one all-reduce; None: none."""
    sharded: bool = False
    """``shard_optimizer_state``: each rank keeps the optimizer state of its
    pieces only (``sharded.py``); ``shard`` does it while a reducer exists."""
    shard: ShardedStep | None = None
    optimizer: Callable[[], Any] = lambda: None
    """The wrapper (weakly; ``register`` sets it): ``hvd.join()`` steps its pieces."""
    comm_hook: Callable[..., Any] | None = None
    """A user's ``hook(state, bucket) -> Handle`` (``register_comm_hook``)."""
    params: list[torch.Tensor] = field(default_factory=list)
    frozen: list[tuple[int, int]] = field(default_factory=list)
    """(group, index) in ``param_groups`` of each parameter NOT in ``params``
    (no hook, no bucket): the only ones ``unfrozen`` must look at."""
    hooks: list[Any] = field(default_factory=list)
    reducer: Reducer | None = None
    """None when nothing is reduced (one rank, outside the process set, no parameters)."""
    marks: Marks | None = None
    """The reducer's flags (None with it)."""
    sparse: SparseGradients = field(default_factory=lambda: SparseGradients([]))
    """Sparse gradients reduced outside the buckets (fixed by ``register``)."""
    # The step in progress.
    marked: list[bool] = field(default_factory=list)
    sparse_dims: list[int | None] = field(default_factory=list)
    pending: bool = False
    """A hook fired since the last ``synchronize``: a step is half done."""
    synchronized: bool = False
    should_synchronize: bool = True
    skip_step: bool = False
    """The last reduction held inf/nan and ``DP_PLUGIN_CHECK_FINITE=skip``."""

    @property
    def closed(self) -> bool:
        """Wrapped before an ``hvd.shutdown()``: the channel closed with that engine."""
        return self.engine is not None and self.engine.closed

    # -- checks ------------------------------------------------------------------------
    def check_open(self, what: str) -> None:
        """Raise if the engine this optimizer was wrapped under was shut down."""
        if self.closed:
            raise DPPluginError(
                f"optimizer.{what}: this DistributedOptimizer was created before "
                "hvd.shutdown(), and its communicator closed with that engine; a new "
                "hvd.init() does not reopen it. Fix: after hvd.init(), wrap again on every "
                "rank: optimizer = hvd.DistributedOptimizer(optimizer, ...) (the old wrapper "
                "may be passed; its state and param_groups are kept), then "
                "hvd.broadcast_parameters and hvd.broadcast_optimizer_state"
            )

    def check_idle(self, what: str) -> None:
        if self.pending:
            raise SynchronizationError(
                f"optimizer.{what} was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(); finish the step first "
                "(the gradients of this step are being reduced)"
            )

    def unfrozen(self, groups: Groups) -> list[str]:
        """Descriptions of the parameters without a hook (``frozen``) that now
        require a gradient: unfrozen after wrapping. Runs once per step: it
        looks only at the parameters that were frozen when the hooks were made."""
        frozen = [(gi, pj, groups[gi]["params"][pj]) for gi, pj in self.frozen]
        return [f"{self.names.get(p, default_name(gi, pj))!r} (param_groups[{gi}]['params'][{pj}], "
                f"shape {tuple(p.shape)})" for gi, pj, p in frozen if p.requires_grad]

    # -- (re)building the hooks and the scheduler -------------------------------------
    def register(self, optimizer: Any) -> None:
        """(Re)build the hooks and the scheduler for ``optimizer.param_groups``.

        Transactional: on an error (an unnamed or unsupported parameter) the
        previous hooks and scheduler stay in place. Collective: the new layout
        is agreed across ranks.
        """
        groups = optimizer.param_groups
        params, names = self._collect(groups)
        eng = self.engine
        sparse = SparseGradients(sparse_embedding_weights(params) if eng is not None
                                 and eng.size > 1 and not self.sparse_as_dense else [])
        if self.sharded and sparse.params:
            which = ", ".join(repr(self.names.get(p) or names.get(p, "?")) for p in sparse.params)
            raise ValueError(
                f"shard_optimizer_state=True cannot shard the sparse gradients of {which} "
                "(nn.Embedding with sparse=True): they are all-gathered, not reduce-scattered, "
                "and a sparse update is not element-wise. Fix: pass sparse_as_dense=True, or "
                "shard_optimizer_state=False"
            )
        # The whole state, before the pieces move with the new plan (collective,
        # as register is).
        full = None if self.shard is None else self.shard.full_state(optimizer)
        reducer, marks = self._build_reducer(params, names, sparse)
        shard = None if reducer is None or not self.sharded else ShardedStep(
            params, reducer, self.engine, self.label, groups)  # type: ignore[arg-type]
        if sparse.params:  # after the agreement: alike on every rank
            with calling("DistributedOptimizer"):
                require_sum_or_average(self.op, "cannot reduce sparse gradients", prefix="hvd.",
                                       otherwise=", or sparse_as_dense=True")
        for handle in self.hooks:
            handle.remove()
        self.names.update(names)
        self.params, self.reducer, self.marks, self.sparse = params, reducer, marks, sparse
        self.shard = shard
        if shard is not None and full:
            shard.split(optimizer, full)
        reduced = {id(p) for p in params}
        self.frozen = [(gi, pj) for gi, group in enumerate(groups)
                       for pj, p in enumerate(group["params"]) if id(p) not in reduced]
        self._reset_step()
        ref = weakref.ref(optimizer)
        self.optimizer = ref
        self.hooks = [p.register_post_accumulate_grad_hook(_make_hook(ref, index))
                      for index, p in enumerate(params)]

    def _collect(self, groups: Groups) -> tuple[list[torch.Tensor], dict[torch.Tensor, str]]:
        """The parameters to reduce (requiring grad, in group order) and names for new ones."""
        params: list[torch.Tensor] = []
        new_names: dict[torch.Tensor, str] = {}
        seen: set[int] = set()
        for gi, group in enumerate(groups):
            for pj, p in enumerate(group["params"]):
                if not p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                params.append(p)
                if p in self.names:
                    continue
                if self.named:
                    raise ValueError(
                        "named_parameters was given to DistributedOptimizer, but the parameter "
                        f"param_groups[{gi}]['params'][{pj}] (shape {tuple(p.shape)}) added "
                        "later has no name; pass every parameter in named_parameters (e.g. "
                        "model.named_parameters())"
                    )
                new_names[p] = default_name(gi, pj)
        return params, new_names

    def _build_reducer(self, params: list[torch.Tensor], new_names: dict[torch.Tensor, str],
                       sparse: SparseGradients) -> tuple[Reducer, Marks] | tuple[None, None]:
        eng = self.engine
        if eng is None or eng.size == 1 or not params:
            return None, None
        specs = []
        for p in params:
            name = self.names.get(p) or new_names[p]
            try:
                specs.append(TensorSpec.of(name, sparse.dense_stand_in(p)))
            except TypeError as exc:
                raise TypeError(
                    f"DistributedOptimizer cannot reduce parameter {name!r}: {exc}"
                ) from None
        check = eng.config.check_finite
        hook = self.comm_hook
        if hook is None and self.sharded:  # a user's hook that all-reduces is fine too
            hook = reducescatter_hook if self.compressor.name == "none" else \
                compression_wrapper(reducescatter_hook, self.compressor)
        describe = getattr(hook, "describe", None)  # a hook's settings, compared across ranks
        # The label is unique per optimizer: the horovod engine matches
        # collectives by name (its channel is the engine itself).
        # The arguments were validated by DistributedOptimizer (and the setter of
        # backward_passes_per_step), the public edge: the reducer takes them as they are.
        reducer = Reducer(
            specs, engine=eng, compression=self.compressor, passes=self.passes,
            policy=ReducePolicy(self.op, eng.size, predivide=self.predivide),
            timeline=shared_timeline, name=self.label, hook=hook,
            flags=("join", "unfrozen", "sparse", *(() if check == "off" else ("finite",))),
            settings={"DP_PLUGIN_CHECK_FINITE": check,
                      "shard_optimizer_state": self.sharded,
                      **({"comm hook": describe()} if callable(describe) else {})},
            autotune=eng.config.autotune,
            groups=group_indices(self.groups, params),
        )
        # Agree on the layout here (the optimizer is made, or a group added, at
        # the same point on every rank), not in the first gradient hook, whose
        # time differs between ranks; a blocking collective there could wait
        # for a rank that is itself waiting in a SyncBatchNorm all-reduce.
        reducer.agree()
        bind = getattr(hook, "bind", None)
        if callable(bind):  # a hook with state or communicators of its own (PowerSGD)
            bind(reducer.state, self._new_channel)
        op, like = self.op, params[0]
        marks = Marks(JoinFlags(reducer, op=op, like=like),
                      RankMarks(reducer, "unfrozen", op=op, like=like),
                      RankMarks(reducer, "sparse", op=op, like=like),
                      None if check == "off" else FiniteFlags(reducer, mode=check, op=op,
                                                              like=like))
        # A zero step of hvd.join() has no ready order to offer, and join
        # finishes its optimizers' zero steps in whatever order they complete:
        # the first step's bucket order must not cost a collective there.
        reducer.postpone_rebuild = marks.join.anyone
        return reducer, marks

    def _new_channel(self, name: str) -> Engine:
        """Another communicator over the optimizer's ranks, made from its process
        set's engine (collective), for a hook that runs collectives of its own."""
        eng = engine_or_none(self.process_set)
        assert eng is not None  # a reducer exists: this rank is in the set
        return eng.channel(f"{self.label}.{name}")

    # -- a step ----------------------------------------------------------------------
    def grad_ready(self, index: int, param: torch.Tensor, groups: Groups) -> None:
        """The hook of ``params[index]``: its gradient is accumulated."""
        if self.closed:
            return  # a wrapper left over from before hvd.shutdown(): step() raises
        if not self.pending and self.marks is not None and self.unfrozen(groups):
            self.marks.unfrozen.mark()  # before any bucket launches: it travels with the last
        self.pending = True
        grad = param.grad
        if self.marks is None or grad is None:
            return
        if self.marks.finite is not None:  # before the scheduler: travels with the last bucket
            self.marks.finite.note(grad)
        dense = self._dense(index, grad)
        if dense is not None:
            sched = self.reducer
            assert sched is not None  # with the marks
            if dense is grad and _viewable(grad, self.engine):
                # gradient_as_bucket_view: .grad becomes its slice of the fusion
                # buffer (one copy now, if it was not already); the bucket then
                # needs no pack or unpack copy, and a gradient zeroed in place
                # (zero_grad(set_to_none=False)) stays the view: no copy at all.
                dense = sched.adopt(index, grad)
                if dense is not grad:
                    param.grad = dense
            sched.mark_ready(index, dense)
        self.marked[index] = True

    def synchronize(self, optimizer: Any) -> None:
        """Wait for this step's reduction and write it into ``.grad`` (see
        ``DistributedOptimizer.synchronize``)."""
        self.check_open("synchronize()")
        groups = optimizer.param_groups
        if self.reducer is None or self.marks is None:
            self.pending = False
            self.check_unfrozen(groups)
            self.synchronized = True
            return
        sched, marks = self.reducer, self.marks
        if not self.pending and self.unfrozen(groups):  # no hook fired this step: look now
            marks.unfrozen.mark()
        for i, p in enumerate(self.params):
            if not self.marked[i] and p.grad is not None:
                # Horovod reduces an existing gradient whose hook did not fire.
                if marks.finite is not None:
                    marks.finite.note(p.grad)
                dense = self._dense(i, p.grad)
                if dense is not None:
                    sched.mark_ready(i, dense)
        results = sched.synchronize()
        self.sparse.reduce(self.names, self.op, self.engine)
        try:  # after this step's collectives, before any update
            self.check_unfrozen(groups)
            self.check_sparse()
        except DPPluginError:  # the step is dropped: the next one starts clean
            marks.join.keep()
            marks.sparse.reset()
            if marks.finite is not None:
                marks.finite.reset()
            self._reset_step()
            raise
        for p, reduced, sparse_dim in zip(self.params, results, self.sparse_dims, strict=True):
            if p in self.sparse.params:
                continue  # reduced above, outside the buckets
            if sparse_dim is not None:
                p.grad = reduced.to_sparse(sparse_dim)
            elif p.grad is None:
                p.grad = reduced
            elif p.grad is not reduced:
                with torch.no_grad():
                    p.grad.copy_(reduced)
        marks.join.keep()
        self._reset_step()
        self.synchronized = True
        finite = marks.finite
        if finite is not None:  # may raise (on every rank alike)
            self.skip_step = finite.decide([(self.names[p], p.grad) for p in self.params])

    def _dense(self, index: int, grad: torch.Tensor) -> torch.Tensor | None:
        """The gradient for the dense buckets; None if it is reduced as sparse,
        or is sparse unexpectedly (this rank is marked: ``check_sparse``)."""
        param = self.params[index]
        if param in self.sparse.params:
            self.sparse.grads[param] = grad
            return None
        if not grad.is_sparse:
            return grad
        if not self.sparse_as_dense:
            assert self.marks is not None  # with the reducer
            self.marks.sparse.mark()
            return None
        self.sparse_dims[index] = grad.sparse_dim()
        return grad.to_dense()

    def _reset_step(self) -> None:
        self.marked = [False] * len(self.params)
        self.sparse_dims = [None] * len(self.params)
        self.pending = False

    # -- the control slot, outside the join flags ---------------------------------------
    def check_unfrozen(self, groups: Groups, joined: bool = False) -> None:
        """Raise if a parameter was unfrozen after wrapping: here or, with a
        reducer, on any rank that marked one (read after the reduction, so
        every rank raises at the same ``synchronize()``). A ``joined`` rank
        trains nothing, so only the others' marks count."""
        ranks: list[int] | None = None
        if self.marks is not None:
            ranks = self.marks.unfrozen.marked()
            if not ranks:  # the usual step: nothing marked, nothing to name
                return
            self.marks.unfrozen.reset()
        mine = [] if joined else self.unfrozen(groups)
        if not mine and not ranks:
            return
        raise DPPluginError(
            f"{_which(mine, ranks)} requires a gradient now but did not when the "
            "DistributedOptimizer was wrapped, so its gradient would not be averaged "
            "across ranks and the replicas would silently diverge; this step is dropped on "
            "every rank. Fix: set requires_grad alike on every rank, then call "
            "optimizer.refresh_parameters() on every rank (between steps), or set "
            "requires_grad before wrapping (freezing later needs nothing: a frozen "
            "parameter contributes zeros)"
        )

    def check_sparse(self, joined: bool = False) -> None:
        """After the reduction, on every rank alike: raise if any rank got a
        sparse gradient for a parameter wrapped as dense (it travelled as
        zeros). A ``joined`` rank names none of its own."""
        assert self.marks is not None
        ranks = self.marks.sparse.marked()
        if not ranks:
            return
        self.marks.sparse.reset()
        mine = [] if joined else [
            repr(self.names[p]) for p in self.params
            if p.grad is not None and p.grad.is_sparse and p not in self.sparse.params]
        raise DPPluginError(
            f"{_which(mine, ranks)} has a sparse gradient, but it "
            "was not the weight of an nn.Embedding or nn.EmbeddingBag with sparse=True when "
            "the DistributedOptimizer was wrapped, so it has a dense bucket and no sparse "
            "all-gather; this step is dropped on every rank. Fix: pass sparse_as_dense=True "
            "to DistributedOptimizer, or make the gradient come from such a module (set "
            "module.sparse before wrapping, or call optimizer.refresh_parameters() on every "
            "rank after setting it)"
        )


class SynchronizationError(DPPluginError, AssertionError):
    """The optimizer was used out of order (e.g. ``zero_grad()`` between
    ``backward()`` and ``step()``). Also an ``AssertionError``, as in Horovod."""


def _which(mine: list[str], ranks: list[int] | None) -> str:
    """The subject of an error every rank raises: this rank's own parameters
    (``mine``) or, on the others, the one their errors name; then the ranks."""
    what = f"parameter {', '.join(mine)}" if mine else "a parameter (named in that rank's error)"
    return what + (f" on rank {', '.join(map(str, ranks))}" if ranks else "")


def parameter_names(groups: Groups, named_parameters: Iterable[tuple[str, torch.Tensor]] | None
                    ) -> dict[torch.Tensor, str]:
    """Name of each parameter: from ``named_parameters`` (validated), else Horovod's default."""
    if named_parameters is None:
        return {p: default_name(i, j)
                for i, group in enumerate(groups) for j, p in enumerate(group["params"])}
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
        for i, group in enumerate(groups) for j, p in enumerate(group["params"])
        if p not in names
    ]
    if missing:
        raise ValueError(
            "named_parameters was specified, but one or more model parameters were not "
            f"named: {', '.join(missing)}. Pass every parameter of the optimizer, e.g. "
            "named_parameters=model.named_parameters()"
        )
    return names


def default_name(i: int, j: int) -> str:
    """Horovod's name for parameter ``j`` of param group ``i`` when no
    ``named_parameters`` were given: ``allreduce.noname.<i>.<j>``. Horovod's
    rule is kept even when torch >= 2.6 has the group's ``param_names``
    (Horovod predates them), so names (and a horovod engine's collective
    names) are the same as under Horovod."""
    return f"allreduce.noname.{i}.{j}"


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
            optimizer._dp.grad_ready(index, param, optimizer.param_groups)

    return hook
