"""The grouped all-reduce that ``allreduce`` and its grouped forms start (and
a joined rank replays, ``join.replay``). The buckets themselves are the
``Reducer``'s (``dp_plugin.scheduler``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dp_plugin.arrays import ops_for, spec_of
from dp_plugin.engines.base import Handle, ReduceOp
from dp_plugin.fusion import TensorSpec
from dp_plugin.hooks import ReducePolicy
from dp_plugin.scheduler import UNBOUNDED, Reducer


def start_allreduce(engine: Any, outs: Sequence[Any], name: str | None, op: ReduceOp,
                    pre: float, post: float,
                    sources: Sequence[Any] | None = None) -> tuple[Reducer, list[Handle]]:
    """Start the agreed all-reduce of ``outs`` (torch tensors or numpy arrays)
    in place, grouped (``UNBOUNDED``): ``allreduce`` and its grouped forms,
    and a joined rank's identity contribution to them (``join.replay``).
    ``Reducer.finish()`` writes the results into ``outs``. With ``sources``
    (one per output) it is out of place: the values are read from
    ``sources``, never written, and ``outs`` may be uninitialized
    (``Reducer.start``: the copy into them is pipelined with the wire)."""
    label = name or "allreduce"
    specs = [TensorSpec(f"{label}.{i}", *spec_of(t)) for i, t in enumerate(outs)]
    reducer = Reducer(
        specs, engine=engine, name=label, fusion_threshold=UNBOUNDED, order=range(len(specs)),
        policy=ReducePolicy(op, engine.size, prescale=pre, postscale=post),
        array_ops=ops_for(outs[0]), agreed=True,
    )
    return reducer, reducer.start(outs, sources)
