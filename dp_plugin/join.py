"""Join's wire protocol: what a rank that called ``join()`` answers on the wire.

A rank that has run out of data calls ``join()``; until every rank has, the
others may still run collectives. The joined rank keeps one ``Listener``
posted on each engine it belongs to: its row of the agreement table
(``dp_plugin.agreement``) marked ``JOINED``, with the number of collectives
it has answered since it joined. The others' agreement meets it, so every
rank learns who has joined; the joined rank learns, from the others'
descriptions, what they are about to run.

Distributed contract: the ranks that have not joined run their agreements
as usual; every rank, joined or not, reads the same table and draws the
same conclusion from it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dp_plugin.agreement import (
    AGREE_NAME,
    JOINED,
    WIDTH,
    Heard,
    conclude,
    read_table,
    table_buffer,
)
from dp_plugin.errors import JoinedRankError


class Listener:
    """A joined rank's standing answer to the next agreement on ``engine``.

    Posted without blocking; ``done()`` polls it; ``heard()`` returns what
    the other ranks asked for (``Heard``; every rank joined when its
    ``envelopes`` are all None). ``answered`` goes into this rank's row, so
    that once everyone has joined every rank can tell who joined last.
    """

    def __init__(self, engine: Any, answered: int) -> None:
        self.engine = engine
        row = np.zeros(WIDTH, dtype=np.int64)
        row[1], row[2] = JOINED, answered
        self._buf = table_buffer(engine, row)
        self.handle = engine.allreduce_async(self._buf, "sum", name=AGREE_NAME)

    def done(self) -> bool:
        return bool(self.handle.done())

    def heard(self) -> Heard:
        """The agreement the other ranks ran (collective: it may exchange details)."""
        self.handle.wait()
        heard = conclude(self.engine, read_table(self.engine, self._buf), b"", ())
        if not heard.same:
            raise JoinedRankError(
                f"rank {self.engine.rank} has joined, and the other ranks called "
                f"different collectives while it was joined ({heard.tags()}); they raise "
                "an error saying which"
            )
        if heard.joined and not all(heard.joined_ok):
            raise JoinedRankError(
                f"rank(s) {', '.join(map(str, heard.joined))} have called join(), and "
                f"{heard.tags()} cannot run while a rank is joined: a joined rank answers "
                "only allreduce, allgather, broadcast, reducescatter, barrier (and their "
                "grouped forms) and DistributedOptimizer steps. Call it before join(), or "
                "after join() has returned on every rank. Every rank raises this error"
            )
        return heard
