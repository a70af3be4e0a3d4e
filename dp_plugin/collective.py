"""What every fused tensor collective shares: the grouped all-reduce that
``allreduce`` and its grouped forms start (and a joined rank replays), and
Horovod's rule for a broadcast's root. The buckets themselves are the
``Reducer``'s (``dp_plugin.scheduler``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dp_plugin import agreement
from dp_plugin.arrays import ops_for, spec_of
from dp_plugin.edge import caller
from dp_plugin.engines.base import Handle, ReduceOp
from dp_plugin.fusion import TensorSpec
from dp_plugin.hooks import ReducePolicy
from dp_plugin.scheduler import UNBOUNDED, Reducer


def start_allreduce(engine: Any, outs: Sequence[Any], name: str | None, op: ReduceOp,
                    pre: float, post: float) -> tuple[Reducer, list[Handle]]:
    """Start the agreed all-reduce of ``outs`` (torch tensors or numpy arrays)
    in place, grouped (``UNBOUNDED``): ``allreduce`` and its grouped forms,
    and a joined rank's identity contribution to them (``join.replay``).
    ``Reducer.finish()`` writes the results into ``outs``."""
    label = name or "allreduce"
    specs = [TensorSpec(f"{label}.{i}", *spec_of(t)) for i, t in enumerate(outs)]
    reducer = Reducer(
        specs, engine=engine, name=label, fusion_threshold=UNBOUNDED, order=range(len(specs)),
        policy=ReducePolicy(op, engine.size, prescale=pre, postscale=post),
        array_ops=ops_for(outs[0]), agreed=True,
    )
    return reducer, reducer.start(outs)


def root_of(engine: Any, root_rank: Any) -> int:
    """Horovod's rule for every rooted function: ``root_rank`` is a job-wide
    rank that must belong to the ranks ``engine`` runs (a process set, or the
    whole job); returns its rank within ``engine``."""
    what = caller()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int):
        raise TypeError(f"{what}: root_rank={root_rank!r} must be an int (a job-wide rank)")
    members = list(engine.global_ranks)
    if root_rank not in members:
        raise ValueError(
            f"{what}: root_rank {root_rank} is not a rank of the process set (its job-wide "
            f"ranks are {members}); pass the job-wide rank of one of its members"
        )
    return members.index(root_rank)


def agreed_root(engine: Any, root_rank: Any) -> int:
    """``root_of`` checked on every rank at once (one small all-gather of each
    rank's ``root_rank``): a bad or differing root on one rank raises on every
    rank at the call, instead of leaving the others waiting in the broadcast
    until DP_PLUGIN_TIMEOUT. Collective over ``engine``'s ranks."""
    what = caller()
    try:
        root, problem = root_of(engine, root_rank), None
    except (TypeError, ValueError) as exc:
        root, problem = -1, exc
    described = agreement.compare(engine, f"{what}.root", repr(root_rank)).described
    if described is not None:
        per_rank = "; ".join(f"rank {engine.global_ranks[r]}: {value}"
                             for r, value in enumerate(described))
        raise ValueError(
            f"rank {engine.global_ranks[engine.rank]}: {what}: the ranks passed different "
            f"root_rank values ({per_rank}) (Horovod: mismatched broadcast root ranks); pass "
            "the same job-wide root_rank on every rank"
        )
    if problem is not None:
        raise problem
    return root
