"""Wait reports: when a collective fails or times out, say what every rank was doing.

Order-matched engines (gloo, nccl, mpi) cannot tell which rank is missing
from a collective: a rank that died, one that stalls outside any collective
and one waiting in a *different* collective look the same from here. Like
Horovod's stall report, a ``WaitBoard`` lets each rank leave a note in a
place every rank can read (torch.distributed's key-value store for gloo
and nccl; MPI messages on a private communicator for mpi, ``mpi_notes.py``):

- a wait that lasts longer than half of ``DP_PLUGIN_TIMEOUT`` posts "rank R
  waits in <collective> since <time>" (nothing is written for waits that end
  sooner, so a healthy job never touches the store) and clears it when the
  wait ends;
- while a wait lasts, every ``stall_warning_s`` (``DP_PLUGIN_STALL_WARNING_SECONDS``,
  a minute by default; the note is then posted at half of that) the rank
  reads the notes and logs a warning naming the collective and the ranks
  not yet waiting in it, as Horovod's stall inspector does;
- when a collective times out or fails, the rank reads every rank's note and
  the error says, per rank: waiting in the same collective, waiting in a
  different one (the ranks called collectives in different orders), stopped
  because it lost a peer (below), or no note (died, stalls outside
  dp_plugin, or cannot reach the store).

A rank that stops because a peer cannot be reached (a cross-host step whose
peer host is gone, a shared-memory peer that died) says so first
(``post_lost``), then closes its connections. A rank that only sees those
connections close (the host peer of a rank that lost its cross-host peer)
reads it (``lost_by``) and names the rank that is really gone, not the
messenger.

Every store access is bounded by ``REPORT_S``: a store that is gone (its
host died) or unreachable (a cut link) costs at most that, and the report
then says so. No framework imports: the store is duck-typed (``set``,
``check``, ``get``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

from dp_plugin.engines.deadline import bounded
from dp_plugin.errors import CollectiveTimeoutError

REPORT_S = 1.5
"""The longest a rank spends posting or reading notes."""

_PREFIX = "dp_plugin/waits/"
_LOST_PREFIX = "dp_plugin/lost/"
_NO_NOTE = ("no note: it died, stalls outside dp_plugin's collectives (data loading, a "
            "lock, a debugger) or cannot reach the store")


class WaitBoard:
    """Notes of the ranks ``ranks`` (job-wide) in ``store``; this process is ``me``.
    ``stall_warning_s``: seconds between the warnings of a long wait (0: none)."""

    def __init__(self, store: Any, me: int, ranks: Sequence[int],
                 stall_warning_s: float = 0.0) -> None:
        self._store = store
        self._me = me
        self._others = [rank for rank in ranks if rank != me]
        self._lost_said = False
        self.stall_warning_s = stall_warning_s

    def post(self, description: str) -> None:
        note = f"{time.time():.3f}|{description}"
        self._quietly(lambda: self._store.set(_PREFIX + str(self._me), note))

    def clear(self) -> None:
        self._quietly(lambda: self._store.set(_PREFIX + str(self._me), ""))

    def post_lost(self, ranks: Sequence[int], where: str) -> None:
        """Say that this rank stops because ``ranks`` (job-wide) cannot be
        reached, ``where`` saying what they are to it ("its peer on another
        host, in the cross-host step"): before it closes its connections.
        Only the first is kept: what follows from it (connections this rank
        closes itself) is no cause of its own."""
        if self._lost_said:
            return
        self._lost_said = True
        text = f"{','.join(map(str, ranks))}|{where}"
        self._quietly(lambda: self._store.set(_LOST_PREFIX + str(self._me), text))

    def lost_by(self, rank: int) -> tuple[list[int], str] | None:
        """What ``rank`` said it lost (``post_lost``): the ranks and where;
        None if it said nothing (or the store cannot be read)."""
        try:
            notes = bounded(lambda: self._read([rank])[1], what="reading the wait notes",
                            rank=self._me, timeout_s=REPORT_S)
        except Exception:
            return None
        return notes.get(rank)

    def report(self, description: str) -> str:
        """One sentence per other rank: what it was waiting in, if anything."""
        try:
            notes, lost = bounded(lambda: self._read(self._others), what="reading the wait notes",
                                  rank=self._me, timeout_s=REPORT_S)
        except Exception as exc:
            reason = ("it did not answer within "
                      f"{REPORT_S:g} s" if isinstance(exc, CollectiveTimeoutError) else str(exc))
            return (f" What the other ranks were doing is unknown: the store that carries "
                    f"their notes failed ({reason}); its host (rank 0, or the launcher) may "
                    "have died or be unreachable.")
        now = time.time()
        parts, silent, gone = [], [], []
        for rank in self._others:
            note = notes.get(rank, "")
            if rank in lost:
                ranks, where = lost[rank]
                gone += [r for r in ranks if r not in gone]
                parts.append(f"rank {rank}: stopped, as {lost_text(ranks, where)} cannot be "
                             "reached from it")
                continue
            if not note:
                silent.append(rank)
                parts.append(f"rank {rank}: {_NO_NOTE}")
                continue
            since, _, theirs = note.partition("|")
            where = ("the same collective" if theirs == description
                     else f"a different collective, {theirs}")
            parts.append(f"rank {rank}: waiting {max(0.0, now - float(since)):.1f} s in {where}")
        if not parts:
            return ""
        first = sorted(gone) or silent
        advice = (f" Check the log of rank(s) {first} first." if first else
                  " Every rank waits, in different collectives: the ranks issued "
                  "collectives in different orders; look for code that runs on some ranks "
                  "only (a rank-0-only collective, a skipped optimizer step, an early break).")
        return " What the other ranks were doing: " + "; ".join(parts) + "." + advice

    def stall_warning(self, description: str, waited_s: float, timeout_s: float) -> str:
        """The warning for a wait of ``waited_s`` in ``description``: which
        ranks wait in it too, which are not there yet, and when it will raise."""
        try:
            notes = bounded(lambda: self._read(self._others)[0], what="reading the wait notes",
                            rank=self._me, timeout_s=REPORT_S)
        except Exception:
            notes = None
        head = (f"rank {self._me}: {description} has waited {waited_s:.0f} s for the other "
                f"ranks; ")
        tail = (f" It raises after {timeout_s:g} s (DP_PLUGIN_TIMEOUT); this warning repeats "
                f"every {self.stall_warning_s:g} s (DP_PLUGIN_STALL_WARNING_SECONDS, 0: off).")
        if notes is None:
            return (head + "which ranks are missing is unknown: the store that carries the "
                    "ranks' notes did not answer." + tail)
        there, elsewhere, missing = [self._me], [], []
        for rank in self._others:
            theirs = notes.get(rank, "").partition("|")[2]
            if theirs == description:
                there.append(rank)
                continue
            missing.append(rank)
            if theirs:
                elsewhere.append(f"rank {rank} waits in {theirs}")
        if not missing:
            return head + f"every rank waits in it ({sorted(there)})." + tail
        detail = f" ({'; '.join(elsewhere)})" if elsewhere else ""
        return (head + f"ranks not there yet: {missing}{detail}; waiting in it: {sorted(there)}. "
                "Check what the missing ranks do (their log, py-spy dump): a slow rank-0-only "
                "step, a hang, or collectives called in a different order." + tail)

    def _read(self, ranks: Sequence[int]
              ) -> tuple[dict[int, str], dict[int, tuple[list[int], str]]]:
        """The wait notes and lost notes of ``ranks``."""
        notes: dict[int, str] = {}
        lost: dict[int, tuple[list[int], str]] = {}
        for rank in ranks:
            for key in (_PREFIX + str(rank), _LOST_PREFIX + str(rank)):
                if not self._store.check([key]):
                    continue
                text = bytes(self._store.get(key)).decode(errors="replace")
                if key.startswith(_PREFIX):
                    notes[rank] = text
                elif text:
                    listed, _, where = text.partition("|")
                    lost[rank] = ([int(r) for r in listed.split(",") if r], where)
        return notes, lost

    def _quietly(self, fn: Any) -> None:
        # A note is a courtesy: never fail a wait for it.
        with contextlib.suppress(Exception):
            bounded(fn, what="posting a wait note", rank=self._me, timeout_s=REPORT_S)


def lost_text(ranks: Sequence[int], where: str) -> str:
    """'rank 3 (its peer on another host, ...)', or 'one of ranks 3, 5 (...)'."""
    who = (f"rank {ranks[0]}" if len(ranks) == 1 else
           f"one of ranks {', '.join(map(str, ranks))}")
    return f"{who} ({where})" if where else who
