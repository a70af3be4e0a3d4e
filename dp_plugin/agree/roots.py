"""Horovod's root rule, the one rule of every rooted function: ``root_rank`` is
a job-wide rank that must belong to the process set the collective runs on.
"""

from __future__ import annotations

from typing import Any

from dp_plugin.agree.edge import caller


def root_of(engine: Any, root_rank: Any) -> int:
    """``root_rank`` as a rank of ``engine`` (a process set, or the whole job),
    by the module's rule. A root that is not an int raises ``TypeError`` at
    once, on this rank; one outside the set a ``ValueError`` (``check`` makes
    it a problem every rank raises for)."""
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
