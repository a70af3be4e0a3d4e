"""Horovod process sets behind the horovod engine's subgroups.

``add_process_set`` adds the Horovod ``ProcessSet`` of some ranks
(``hvd.add_process_set``, collective over every Horovod rank, bounded by the
engine's timeout), or finds the one the user registered with the same ranks
(Horovod refuses duplicates, so its id is looked up). The engine keeps the
sets it added (``HorovodEngine._process_set_of``).
"""

from __future__ import annotations

import os
from typing import Any

from dp_plugin.engines.deadline import bounded_on
from dp_plugin.errors import DPPluginError


def add_process_set(engine: Any, hvd: Any, members: tuple[int, ...], what: str) -> Any:
    """A new ``ProcessSet`` of ``members`` (ranks of the job-wide ``engine``,
    whose Horovod module is ``hvd``), or the user's with the same ranks."""
    try:
        return bounded_on(engine, lambda: hvd.add_process_set(list(members)),
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
        return _registered(members)


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
