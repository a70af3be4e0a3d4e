"""Join's wire protocol: what a rank that called ``join()`` answers, what it
refuses, and how long it waits.

A rank that has run out of data calls ``join()``; until every rank has, the
others may still run collectives. Horovod 0.28.1's rule, which a script
written for Horovod relies on:

- **answered**: the all-reduce family (``allreduce``, ``grouped_allreduce``,
  their in-place forms, a metric's average, every ``DistributedOptimizer``
  step) and ``barrier``. The joined rank contributes nothing: the op's
  identity (zeros for Sum and Average; Average still divides by the full
  size, as in Horovod).
- **refused**: ``allgather``, ``broadcast``, ``reducescatter``, ``alltoall``
  and everything built on them or agreed once (``broadcast_parameters``,
  ``broadcast_object``, ``SyncBatchNorm`` statistics, ...). Every rank that
  called it raises ``JoinedRankError`` at the call (Horovod: "Allgather is
  not supported with Join at this time."); the joined rank is not
  disturbed and keeps waiting. Those ranks then call ``join()`` themselves,
  and every rank gets the rank that joined last back.

On the wire: the joined rank keeps one ``Listener`` posted on each engine it
belongs to: its row of the agreement table (``dp_plugin.agree.agreement``)
marked ``JOINED``. The others' agreement meets it, so every rank learns who
has joined, and the joined rank learns from their descriptions what they
are about to run. A collective that runs without an agreement of its own
(a cached one, agreed once: ``SyncBatchNorm``'s statistics) must run one
per call on an engine a joined rank may listen on, or its data would pair
with the ``Listener`` (the agreement refuses it instead).

Deadline: a ``Listener`` may stand for as long as the others train (their
optimizer steps run on the optimizer's channel, not on the engine it
listens on), so its all-reduce carries no deadline of its own: it is
issued inside ``dp_plugin.engines.deadline.standing()``, which every
engine reads as it issues. ``join()`` owns the deadline
(``Deadline``): ``DP_PLUGIN_TIMEOUT`` after the last progress, where
progress is any collective of the others that this rank answered, an
optimizer step among them.

Who joined last: every rank counts the rounds it answered on the global
engine since it joined; once every rank has joined, one all-reduce of the
counts (``last_joined``) names the rank with the fewest (of ranks that
joined at the same point, the highest).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dp_plugin.agree.agreement import (
    AGREE_NAME,
    JOINED,
    WIDTH,
    Heard,
    conclude,
    read_table,
    table_buffer,
)
from dp_plugin.agree.request import CHECK_TAG, Agreed
from dp_plugin.engines.base import ReduceOp
from dp_plugin.engines.deadline import standing
from dp_plugin.errors import CollectiveTimeoutError, JoinedRankError
from dp_plugin.reduce.arrays import numpy_dtype, to_device, to_host
from dp_plugin.reduce.collective import fused_collective
from dp_plugin.reduce.dtypes import is_floating
from dp_plugin.reduce.hooks import ReducePolicy

ANSWERED = frozenset({"allreduce", "barrier"})
"""The collective kinds a joined rank answers (besides optimizer steps);
every other kind is refused (the module docstring)."""


def admit(kind: str, name: str | None, joined: Sequence[int]) -> None:
    """On a rank that called ``kind`` while ``joined`` (global ranks) have joined:
    return if a joined rank answers it, else raise ``JoinedRankError``."""
    if not joined or kind in ANSWERED:
        return
    named = "" if name is None else f" {name!r}"
    raise JoinedRankError.refusing(
        joined, f"{kind}{named}", f" (Horovod: '{kind.capitalize()} is not supported with Join')")


class Listener:
    """A joined rank's standing answer to the next agreement on ``engine``.

    Posted without blocking and without a deadline of its own (``Deadline``
    bounds it); ``done()`` polls it; ``heard()`` returns what the other
    ranks ran (``Heard``; ``everyone_joined`` tells the end).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        row = np.zeros(WIDTH, dtype=np.int64)
        row[1] = JOINED
        self._buf = table_buffer(engine, row)
        with standing():
            self.handle = engine.allreduce_async(self._buf, ReduceOp.SUM, name=AGREE_NAME)

    def done(self) -> bool:
        return bool(self.handle.done())

    def heard(self) -> Heard:
        """The agreement the other ranks ran (collective: it may exchange details)."""
        self.handle.wait()
        return conclude(self.engine, read_table(self.engine, self._buf), b"", ())


def joined_view(heard: Heard) -> tuple[list[dict[str, Any]] | None, Agreed]:
    """On a joined rank: the request the others agreed on (one description
    per tensor) and what they agreed; None when they ran another agreement
    than ``check`` or reported a problem (they raise, this rank listens on)."""
    other = any(env is not None and env[0] != CHECK_TAG for env in heard.envelopes)
    blocks = [b for b in heard.described if b is not None]
    if other or not blocks or any(d["problem"] for b in blocks for d in b):
        return None, Agreed([], 0)
    width = max(len(n) for n in heard.numbers)
    count = len(blocks[0]) if blocks[0][0]["kind"] != "barrier" else 0
    return blocks[0], Agreed(with_joined(heard.numbers, width), count, heard.joined)


def with_joined(numbers: list[list[int]], width: int) -> list[list[int]]:
    """The table, a joined rank's (empty) numbers as zeros: it contributes nothing."""
    return [row or [0] * width for row in numbers]


def everyone_joined(heard: Heard, size: int) -> bool:
    return len(heard.joined) == size


def answerable(heard: Heard, kind: str) -> bool:
    """Did the others run something this rank answers? (False: they raise:
    an agreement that refuses joined ranks, a refused kind, or ranks that
    disagree among themselves; this rank just keeps listening.)"""
    return heard.same and all(heard.joined_ok) and kind in ANSWERED


def replay(engine: Any, described: list[dict[str, Any]]) -> None:
    """Run, contributing nothing, the collective the other ranks agreed on
    (``described``: one description per tensor, ``joined_view``; blocks).
    All-reduce: the same grouped all-reduce on the op's identity (the module
    docstring; +inf/-inf/1 for Min/Max/Product). Barrier: the agreement was
    all of it."""
    kind, name = described[0]["kind"], described[0]["name"]
    if kind == "barrier":
        return
    if kind != "allreduce":  # answerable said no first
        raise AssertionError(f"a joined rank cannot answer {kind}")
    op = ReduceOp.parse(described[0]["op"])
    pre, post = described[0]["scales"]
    fused_collective([_identity_like(d, op) for d in described], engine=engine,
                     name=name or "allreduce",
                     policy=ReducePolicy(op, engine.size, prescale=pre, postscale=post)).finish()


def _identity_like(d: dict[str, Any], op: ReduceOp) -> Any:
    """A buffer shaped like the others' tensor, on this rank's device of its
    kind, holding the value that leaves ``op``'s reduction unchanged."""
    dtype = numpy_dtype(d["dtype"])
    value: Any = 1 if op is ReduceOp.PRODUCT else 0
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        info = None if is_floating(d["dtype"]) else np.iinfo(dtype)
        high, low = (np.inf, -np.inf) if info is None else (info.max, info.min)
        value = high if op is ReduceOp.MIN else low
    arr = np.full(tuple(d["shape"]), value, dtype=dtype)
    kind = str(d["device"]).split(":")[0]  # the current device of that kind here
    return arr if kind == "cpu" else to_device(arr, kind)


class Deadline:
    """``join()``'s one deadline: ``timeout_s`` after the last progress."""

    def __init__(self, timeout_s: float, rank: int) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self.progressed()

    def progressed(self) -> None:
        self._until = time.perf_counter() + self.timeout_s

    def check(self) -> None:
        if time.perf_counter() >= self._until:
            raise CollectiveTimeoutError(
                f"rank {self.rank}: hvd.join() heard nothing from the other ranks for "
                f"{self.timeout_s:g} s (DP_PLUGIN_TIMEOUT): a rank that has not joined "
                "neither stepped a DistributedOptimizer nor called a collective in that "
                "time; check that every rank calls hvd.join() when its data runs out"
            )


def last_joined(engine: Any, answered: int) -> int:
    """Once every rank has joined (collective over ``engine``, the global one):
    the rank that joined last, by the module docstring's count."""
    counts = np.zeros(engine.size, dtype=np.int64)
    counts[engine.rank] = answered
    buf = to_device(counts, engine.buffer_device)
    engine.allreduce_async(buf, "sum", name=f"{AGREE_NAME}.join").wait()
    got = to_host(buf)
    fewest = int(got.min())
    return max(r for r in range(engine.size) if got[r] == fewest)
