"""Cross-rank agreement: the exchange that tells whether all ranks describe the same thing.

If one rank registered a tensor with another shape (or an extra one), or
reads another fusion threshold, compression or scale factor from its
environment, its fusion buffers would differ from the others' and the
collectives would mismatch: a hang or, worse, silently wrong numbers. Every
collective therefore agrees before its data moves (a fused one once):

1. every rank all-reduces a table of fixed-size rows: a digest of its
   description (``dp_plugin.agree.request``: a tensor collective's request, or a
   fused collective's layout and settings) and a few numbers;
2. only if the digests differ do the ranks gather the full descriptions, so
   that every rank can say what differs, and on which ranks.

``compare`` is that exchange for any JSON-able description (the one check,
``dp_plugin.agree.check``, and the Keras metric average call it). A rank that
has called ``join()`` takes part in it with a row of its own (``JOINED``);
what it answers and what it refuses is ``dp_plugin.agree.join``.

Distributed contract: ``compare`` is a collective. Every rank calls it at
the same point; every rank then sees the same digests, so every rank takes
the same branch and, on a difference, every rank raises the same error —
nobody is left waiting.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from dp_plugin.errors import JoinedRankError, LayoutMismatchError
from dp_plugin.reduce.arrays import to_device, to_host

DIGEST_SIZE = 32


class Heard(NamedTuple):
    """One agreement as every rank sees it (``compare``'s result; a joined
    rank's ``dp_plugin.agree.join.Listener`` hears the same)."""

    envelopes: list[Any | None]
    """Per rank ``[tag, joined_ok, described]``; None for joined ranks,
    and for every rank when the first exchange showed agreement."""
    numbers: list[list[int]]
    joined: tuple[int, ...]
    same: bool
    """Do the active (not joined) ranks describe the same thing?"""

    @property
    def described(self) -> list[Any]:
        """Per rank its description (None where not exchanged: see ``envelopes``)."""
        return [None if env is None else env[2] for env in self.envelopes]

    @property
    def joined_ok(self) -> list[bool]:
        """Per active rank: does its caller run with joined ranks?"""
        return [bool(env[1]) for env in self.envelopes if env is not None]


AGREE_NAME = "dp_plugin.agree"
"""One engine name for every agreement, whatever the caller: two ranks in
different collectives still meet here (a name-matching engine such as
Horovod's would otherwise wait on two names forever) and see the difference."""

INLINE = 8
"""Numbers carried in the first exchange; more travel with the details."""

_HEAD = 2 + DIGEST_SIZE // 8
"""Header words per rank: count of numbers, length of the description, digest."""

WIDTH = _HEAD + INLINE
"""Words per rank in the table of the first exchange."""

JOINED = -1
"""The description length in the row of a rank that describes nothing: it
has called ``join()`` (``dp_plugin.agree.join.Listener`` writes such rows)."""


def compare(engine: Any, tag: str, described: Any, numbers: Sequence[int] = (), *,
            joined_ok: bool = False, what: str = "") -> Heard:
    """The one agreement exchange: do all ranks describe the same thing?

    ``described`` is this rank's JSON-able description of what it is about
    to do, ``tag`` names the caller; ``numbers`` are per-rank integers the
    caller needs from every rank (e.g. first dimensions of an uneven
    all-gather). The module docstring's exchange: each rank's row is
    ``[len(numbers), len(description), digest, numbers]`` (``WIDTH`` words);
    the descriptions follow only when the digests differ, a rank has joined
    or there are more than ``INLINE`` numbers.

    A joined rank (``dp_plugin.agree.join``) answers with a row of its own; unless
    ``joined_ok`` (the caller decides, with ``dp_plugin.agree.join``, what a joined
    rank means for it), every rank then raises ``JoinedRankError``, naming
    ``what`` (default: the callers' tags) as the collective that cannot run.
    Collective over ``engine``'s ranks; every rank gets the same result.
    """
    payload = json.dumps([tag, joined_ok, described], separators=(",", ":")).encode()
    if engine.size == 1:
        return Heard([None], [list(numbers)], (), True)
    digest = np.frombuffer(hashlib.sha256(payload).digest(), dtype="<i8")
    row = np.zeros(WIDTH, dtype=np.int64)
    row[:_HEAD] = [len(numbers), len(payload), *digest]
    inline = list(numbers)[:INLINE]
    row[_HEAD:_HEAD + len(inline)] = inline
    buf = table_buffer(engine, row)
    engine.allreduce_async(buf, "sum", name=AGREE_NAME).wait()
    heard = conclude(engine, read_table(engine, buf), payload, numbers)
    if heard.joined and not all(heard.joined_ok):
        tags = ", ".join(sorted({env[0] for env in heard.envelopes if env is not None}))
        raise JoinedRankError.refusing([engine.global_ranks[r] for r in heard.joined],
                                       what or tags, where=" (dp_plugin.agree.join)")
    return heard


def table_buffer(engine: Any, row: np.ndarray) -> Any:
    """A zero table, ``row`` in this rank's place, on the engine's buffer
    device: what each rank all-reduces (sum) in the first exchange."""
    table = np.zeros((engine.size, WIDTH), dtype=np.int64)
    table[engine.rank] = row
    return to_device(table.reshape(-1), engine.buffer_device)


def read_table(engine: Any, buf: Any) -> np.ndarray:
    """The exchanged table (a ``table_buffer`` after the all-reduce), one row per rank."""
    return to_host(buf).reshape(engine.size, WIDTH)


def conclude(engine: Any, table: np.ndarray, payload: bytes, numbers: Sequence[int]) -> Heard:
    """Read the table; fetch the details when some rank needs them (collective:
    every rank, joined or not, calls it on the same table)."""
    joined = tuple(r for r in range(engine.size) if table[r, 1] == JOINED)
    active = [r for r in range(engine.size) if r not in joined]
    counts = [0 if r in joined else int(table[r, 0]) for r in range(engine.size)]
    if any(c < 0 for c in counts) or any(table[r, 1] < 0 for r in active):
        raise LayoutMismatchError(
            f"rank {engine.job_rank}: the agreement received a malformed table from ranks "
            f"{[engine.global_ranks[r] for r in active]}; some rank runs another version of "
            "dp_plugin"
        )
    numbers_of = [table[r, _HEAD:_HEAD + min(c, INLINE)].tolist() for r, c in enumerate(counts)]
    same = all((table[r, 1:_HEAD] == table[active[0], 1:_HEAD]).all() for r in active)
    if not active or (same and not joined and max(counts) <= INLINE):
        return Heard([None] * engine.size, numbers_of, joined, same)
    extra = np.asarray(list(numbers)[INLINE:], dtype="<i8").view(np.uint8)
    mine = np.concatenate([extra, np.frombuffer(payload, dtype=np.uint8)])
    n_extra = [8 * max(c - INLINE, 0) for c in counts]
    rows = [0 if r in joined else n_extra[r] + int(table[r, 1]) for r in range(engine.size)]
    blob = to_host(engine.allgather(to_device(mine, engine.buffer_device), rows,
                                    f"{AGREE_NAME}.detail"))
    envelopes: list[Any | None] = [None] * engine.size  # None stays for joined ranks
    at = 0
    for r in active:  # joined ranks sent no bytes (rows[r] == 0)
        numbers_of[r] += blob[at:at + n_extra[r]].copy().view("<i8").tolist()
        envelopes[r] = json.loads(blob[at + n_extra[r]:at + rows[r]].tobytes())
        at += rows[r]
    tags = {envelopes[r][0] for r in active}  # type: ignore[index]
    if len(tags) > 1:
        raise LayoutMismatchError(
            f"rank {engine.job_rank}: ranks called different collectives at the same point: "
            + "; ".join(f"rank {engine.global_ranks[r]} in {envelopes[r][0]}"  # type: ignore[index]
                        for r in active)
            + ". Every rank must call the same collectives in the same order"
        )
    return Heard(envelopes, numbers_of, joined, same)

