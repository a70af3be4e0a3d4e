"""What a ``DistributedOptimizer`` keeps (``OptimizerState``, the ``_dp``
attribute) and how its reducer is built: one ``GradientScheduler`` on the
optimizer's own channel, with the join and finite flags in its control slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from dp_plugin.compression import Compressor
from dp_plugin.engines.base import Engine, ReduceOp
from dp_plugin.fusion import TensorSpec
from dp_plugin.process_sets import ProcessSet
from dp_plugin.scheduler import GradientScheduler
from dp_plugin.torch.basics import shared_timeline
from dp_plugin.torch.finite import FiniteFlags
from dp_plugin.torch.joining import JoinFlags
from dp_plugin.torch.rank_marks import RankMarks
from dp_plugin.torch.sparse import SparseGradients


@dataclass(frozen=True, eq=False)
class Reducer:
    """The scheduler of one optimizer and the flags in its control slot."""

    scheduler: GradientScheduler
    flags: JoinFlags
    unfrozen: RankMarks
    """Ranks that found a parameter unfrozen after wrapping (``misuse.unfrozen``)."""
    sparse_news: RankMarks
    """Ranks on which a parameter's gradient turned sparse this step
    (``SparseGradients.reduce``: a joined rank learns which)."""
    finite: FiniteFlags | None = None
    """The ``DP_PLUGIN_CHECK_FINITE`` flags; None when the check is off."""


@dataclass(eq=False)
class OptimizerState:
    """Everything the mixin adds to the optimizer, under one attribute (``_dp``)."""

    names: dict[torch.Tensor, str]
    named: bool
    compressor: Compressor
    compression: Any
    """The ``compression`` argument as the user gave it."""
    op: ReduceOp
    predivide: float
    passes: int
    sparse_as_dense: bool
    groups: Any
    process_set: ProcessSet
    engine: Engine | None
    """The optimizer's own channel of the set's engine (``Engine.channel``);
    None when this rank is outside the process set: nothing is reduced."""
    label: str = "DistributedOptimizer"
    """Names its collectives; unique per optimizer in the process."""
    params: list[torch.Tensor] = field(default_factory=list)
    frozen: list[tuple[int, int]] = field(default_factory=list)
    """(group, index) in ``param_groups`` of each parameter NOT in ``params``
    (no hook, no bucket): the only ones ``misuse.unfrozen`` must look at."""
    hooks: list[Any] = field(default_factory=list)
    comm_hook: Any = None
    """A user's ``hook(state, bucket) -> Handle`` (``register_comm_hook``), or None."""
    reducer: Reducer | None = None
    """None when nothing is reduced (one rank, outside the process set, no parameters)."""
    marked: list[bool] = field(default_factory=list)
    sparse_dims: list[int | None] = field(default_factory=list)
    sparse: SparseGradients = field(default_factory=SparseGradients)
    """Sparse gradients reduced outside the buckets (``sparse_as_dense=False``)."""
    pending: bool = False
    synchronized: bool = False
    should_synchronize: bool = True
    skip_step: bool = False
    """The last reduction held inf/nan and ``DP_PLUGIN_CHECK_FINITE=skip``."""

    @property
    def closed(self) -> bool:
        """Wrapped before an ``hvd.shutdown()``: the channel closed with that engine."""
        return self.engine is not None and self.engine.closed


def build_reducer(st: OptimizerState, params: list[torch.Tensor],
                  new_names: dict[torch.Tensor, str]) -> Reducer | None:
    """The scheduler (and its control-slot flags) for ``params`` on the
    optimizer's channel; None if nothing is reduced. Collective: runs the
    layout agreement."""
    eng = st.engine
    if eng is None or eng.size == 1 or not params:
        return None
    specs = []
    for p in params:
        name = st.names.get(p) or new_names[p]
        try:
            specs.append(TensorSpec.of(name, st.sparse.dense_stand_in(p)))
        except TypeError as exc:
            raise TypeError(
                f"DistributedOptimizer cannot reduce parameter {name!r}: {exc}"
            ) from None
    ranks = list(eng.global_ranks)
    check = eng.config.check_finite
    # The control slot: the join flags, the unfrozen marks, the sparse news,
    # then (if checked) the finite flags; one element per rank each.
    # The label is unique per optimizer: the horovod engine matches
    # collectives by name (its channel is the engine itself).
    scheduler = GradientScheduler(
        specs, engine=eng, op=st.op, compression=st.compressor,
        gradient_predivide_factor=st.predivide, backward_passes_per_step=st.passes,
        timeline=shared_timeline, name=st.label,
        control_numel=len(ranks) * (3 if check == "off" else 4),
        hook=st.comm_hook, settings={"DP_PLUGIN_CHECK_FINITE": check},
        autotune=eng.config.autotune,
    )
    # Agree on the layout here (the optimizer is made, or a group added, at
    # the same point on every rank), not in the first gradient hook, whose
    # time differs between ranks; a blocking collective there could wait
    # for a rank that is itself waiting in a SyncBatchNorm all-reduce.
    scheduler.fused.agree()
    flags = JoinFlags(scheduler, op=st.op, ranks=ranks, slot=eng.rank, like=params[0])
    unfrozen = RankMarks(scheduler, op=st.op, ranks=ranks, slot=eng.rank, offset=len(ranks),
                         like=params[0])
    news = RankMarks(scheduler, op=st.op, ranks=ranks, slot=eng.rank, offset=2 * len(ranks),
                     like=params[0])
    finite = None if check == "off" else FiniteFlags(
        scheduler, mode=check, op=st.op, ranks=ranks, slot=eng.rank, offset=3 * len(ranks),
        like=params[0])
    return Reducer(scheduler, flags, unfrozen, news, finite)
