"""Horovod process sets behind the horovod engine's subgroups.

``process_set_of`` returns the Horovod ``ProcessSet`` of some ranks: the
global set, one this engine added before, a new one (``hvd.add_process_set``,
collective over every Horovod rank, bounded by the engine's timeout), or the
one the user registered with the same ranks (Horovod refuses duplicates, so
its id is looked up).
"""

from __future__ import annotations

import os
from typing import Any

from dp_plugin.engines.deadline import bounded_on
from dp_plugin.errors import DPPluginError


def process_set_of(engine: Any, members: tuple[int, ...], what: str) -> Any:
    """The ``ProcessSet`` of ``members`` (the job-wide ``engine``'s ranks)."""
    hvd = engine._hvd
    if members == tuple(range(engine.size)):
        return hvd.global_process_set
    known = engine._added_sets.get(members)
    if known is not None:
        return known
    try:
        process_set = bounded_on(engine, lambda: hvd.add_process_set(list(members)),
                                 f"hvd.add_process_set({list(members)})")
    except ValueError as exc:
        if "duplicate" not in str(exc):
            # Every rank gets the same refusal (e.g. dynamic process sets off).
            raise DPPluginError(
                f"{what}: Horovod refused to add a process set of ranks {list(members)}: "
                f"{str(exc).rstrip('.')}. Under the horovod engine, process sets must be "
                "asked for when Horovod starts, as in Horovod: call "
                "hvd.init(process_sets='dynamic') (or pass the sets, "
                "hvd.init(process_sets=[hvd.ProcessSet([...])])) on every rank, or set "
                "HOROVOD_DYNAMIC_PROCESS_SETS=1 before hvd.init() (it is "
                f"{os.environ.get('HOROVOD_DYNAMIC_PROCESS_SETS')!r}); dp_plugin does not "
                "enable them unasked because Horovod then checks for new sets in every cycle"
            ) from exc
        process_set = _registered(members)
    engine._added_sets[members] = process_set
    return process_set


def _registered(members: tuple[int, ...]) -> Any:
    """The set the user registered with these ranks (hvd.init(process_sets=...)
    or hvd.add_process_set)."""
    from horovod.common.process_sets import ProcessSet
    from horovod.torch.mpi_ops import _basics

    for set_id, ranks in _basics._get_process_set_ids_and_ranks().items():
        if tuple(ranks) == members:
            found = ProcessSet(list(members))
            found.process_set_id = set_id
            return found
    raise DPPluginError(f"Horovod reported a process set of ranks {list(members)} that "
                        "it does not list; this is a Horovod bug")
