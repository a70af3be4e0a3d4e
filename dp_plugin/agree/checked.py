"""Check, then move: the collectives of callers holding plain buffers.

Engines move bytes only: ``Engine.allgather`` takes the agreed rows,
``Engine.alltoall`` the agreed counts, ``Engine.subgroup`` the agreed
members and hosts. Each function here runs the one check
(``dp_plugin.agree.check``) of its request first, then hands the engine what
every rank agreed.
"""

from __future__ import annotations

from typing import Any

from dp_plugin.agree.check import check
from dp_plugin.agree.request import Request
from dp_plugin.engines.base import ReduceOp, Started


def allgather_async(engine: Any, buf: Any, name: str = "allgather") -> Started:
    """Check, then start ``engine.allgather_async`` with the agreed rows."""
    agreed = check(engine, Request.of("allgather", [buf], name=name))
    return engine.allgather_async(buf, agreed.rows(), name)


def allgather(engine: Any, buf: Any, name: str = "allgather") -> Any:
    """Concatenate every rank's ``buf`` along the first dimension (which may
    differ); dtype and the other dimensions must agree (checked first)."""
    agreed = check(engine, Request.of("allgather", [buf], name=name))
    return engine.allgather(buf, agreed.rows(), name)


def alltoall(engine: Any, buf: Any, splits: Any = None,
             name: str = "alltoall") -> tuple[Any, list[int]]:
    """Check (splits too), then ``engine.alltoall`` with the agreed counts."""
    agreed = check(engine, Request.of("alltoall", [buf], name=name, splits=splits))
    return engine.alltoall(buf, agreed.counts(), name)


def reducescatter(engine: Any, buf: Any, op: ReduceOp | str = ReduceOp.SUM,
                  name: str = "reducescatter") -> Any:
    """Check, then ``engine.reducescatter``."""
    op = ReduceOp.parse(op)
    check(engine, Request.of("reducescatter", [buf], name=name, op=op))
    return engine.reducescatter(buf, op, name)


def subgroup(engine: Any, ranks: Any, name: str = "process_set") -> Any:
    """Check every rank passed the same valid ``ranks``, then ``engine.subgroup``."""
    agreed = check(engine, Request(kind="subgroup", name=name, members=ranks))
    return engine.subgroup(agreed.members, agreed.hosts(), name)
