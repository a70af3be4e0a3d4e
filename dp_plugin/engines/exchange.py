"""Agreement checks that precede allgather, alltoall, reducescatter and subgroup.

A mistake on one rank (wrong splits, another dtype, another member list)
must raise on *every* rank, never leave the others waiting in a collective.
So each of those collectives first runs the core's one agreement exchange,
``dp_plugin.agreement.compare``: every rank describes its input (dtype, the
dimensions that must match, the problem it found in it, if any) and sends
the numbers the collective needs from every rank (first dimension, splits,
host); the descriptions themselves travel only when they differ. Every rank
validates the same descriptions with the same code: the outcome (result or
exception) is identical everywhere. The rank that made the mistake also
gets the local detail in its message.
"""

from __future__ import annotations

import numbers
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from dp_plugin.agreement import compare
from dp_plugin.dtypes import canonical_dtype
from dp_plugin.launch import Topology

# Problem codes, with the wording other ranks see.
OK = 0
_ZERO_DIM = 1
_BAD_DTYPE = 3
BAD_SPLITS = 4
BAD_MEMBERS = 5
_PROBLEMS = {
    _ZERO_DIM: "passed a 0-d buffer",
    _BAD_DTYPE: "passed an unsupported dtype",
    BAD_SPLITS: "passed invalid splits",
    BAD_MEMBERS: "passed an invalid list of ranks",
}


class Check:
    """This rank's input as the agreement describes it and, if it is bad,
    the first problem found and its local detail.

    ``buf`` None describes no buffer (subgroup)."""

    def __init__(self, buf: Any | None) -> None:
        self.problem = OK
        self.detail: str | None = None
        self.dtype: str | None = None
        self.shape: tuple[int, ...] = ()
        if buf is None:
            return
        self.shape = tuple(int(d) for d in buf.shape)
        try:
            self.dtype = canonical_dtype(buf.dtype)
        except TypeError as exc:
            self.fail(_BAD_DTYPE, str(exc))
        if not self.shape:
            self.fail(_ZERO_DIM, "a 0-d buffer has no first dimension to split or "
                      "concatenate along; reshape it to (1,)")

    @property
    def ok(self) -> bool:
        return self.problem == OK

    @property
    def rows(self) -> int:
        """The first dimension (0 for a 0-d buffer)."""
        return self.shape[0] if self.shape else 0

    def fail(self, code: int, detail: str) -> None:
        """Record the first problem of this rank's input (later ones are
        consequences of it)."""
        if self.ok:
            self.problem = code
            self.detail = detail

    def agree(self, engine: Any, kind: str, what: str, numbers: Sequence[int] = (),
              **fields: Any) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """The agreement (collective): every rank's description (dtype,
        dimensions after the first, problem, ``fields``) and ``numbers``.
        Raises, identically on every rank, if any rank found a problem."""
        mine = {"problem": self.problem, "dtype": self.dtype,
                "trailing": list(self.shape[1:]), **fields}
        got = compare(engine, f"engine {kind}", mine, numbers)
        described = got.described or [mine] * engine.size
        check_problems(described, self, what)
        return described, got.numbers


def check_problems(described: list[dict[str, Any]], check: Check, what: str) -> None:
    """Raise, identically on every rank, if any rank reported a problem.

    ``TypeError`` for a bad dtype, ``ValueError`` otherwise; the message
    names the ranks, and on a rank at fault also its own detail."""
    bad = [r for r, d in enumerate(described) if d["problem"] != OK]
    if not bad:
        return
    first = described[bad[0]]["problem"]
    error = TypeError if first == _BAD_DTYPE else ValueError
    summary = f"rank(s) {bad} {_PROBLEMS.get(first, 'passed an invalid input')}"
    if check.detail:
        raise error(f"{what}: {check.detail} ({summary}; every rank raises this error)")
    raise error(
        f"{what}: {summary}; see the error on rank {bad[0]} for the details and the fix "
        "(every rank raises this error)"
    )


def check_buffers(described: list[dict[str, Any]], rows: Sequence[int], what: str) -> None:
    """Raise, identically on every rank, unless every rank passed the same
    dtype and dimensions after the first, and the same first dimension where
    the descriptions carry it (reducescatter). ``rows[r]``: rank r's first
    dimension."""
    layouts = [(d["dtype"], d["trailing"], d.get("rows")) for d in described]
    if all(layout == layouts[0] for layout in layouts):
        return
    expect = ("the same shape" if "rows" in described[0] else
              "the same dimensions after the first (only the first may differ)")
    per_rank = ", ".join(f"rank {r}: {d['dtype']}{[rows[r], *d['trailing']]}"
                         for r, d in enumerate(described))
    raise ValueError(
        f"{what}: ranks passed different buffers ({per_rank}); every rank must pass the "
        f"same dtype and {expect}"
    )


def as_splits(splits: Any, rows: int, size: int, check: Check) -> list[int]:
    """This rank's send counts; records a problem in ``check`` if invalid.

    ``None`` divides ``rows`` evenly (an error if it does not divide, as in
    Horovod). Accepts any sequence of ints, or a 1-D numpy array / tensor.
    """
    if splits is None:
        if rows % size:
            check.fail(BAD_SPLITS, (
                f"no splits were given and the first dimension {rows} is not divisible by "
                f"{size} ranks; pass splits (rows to send to each rank) or pad the buffer"
            ))
            return [0] * size
        return [rows // size] * size
    values = splits.tolist() if hasattr(splits, "tolist") else splits
    try:
        counts = list(values)
    except TypeError:
        counts = [values]
    if not all(_is_int(c) for c in counts):
        check.fail(BAD_SPLITS, f"splits {counts!r} must be ints (rows to send to each rank)")
        return [0] * size
    counts = [int(c) for c in counts]
    if len(counts) != size:
        check.fail(BAD_SPLITS, (
            f"splits {counts} has {len(counts)} entries but there are {size} ranks; pass one "
            "row count per rank, in rank order"
        ))
    elif any(c < 0 for c in counts):
        check.fail(BAD_SPLITS, f"splits {counts} contains a negative row count")
    elif sum(counts) != rows:
        check.fail(BAD_SPLITS, (
            f"splits {counts} sums to {sum(counts)} but the buffer's first dimension is "
            f"{rows}; the splits must cover every row exactly once"
        ))
    return counts if check.ok else [0] * size


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def reducescatter_counts(rows: int, size: int) -> list[int]:
    """Rows each rank keeps after a reduce-scatter of ``rows`` rows.

    Horovod 0.28.1's rule (``ReducescatterOp::ComputeOutputShapeForRank``):
    ``rows // size`` each, and ranks ``0 .. rows % size - 1`` one more.
    """
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


def check_members(ranks: Any, size: int, check: Check) -> tuple[int, ...]:
    """Validate a subgroup's member list (records problems in ``check``)."""
    try:
        members = tuple(ranks)
    except TypeError:
        check.fail(BAD_MEMBERS, f"ranks {ranks!r} is not a sequence of ints")
        return ()
    if not all(_is_int(r) for r in members):
        check.fail(BAD_MEMBERS, f"ranks {list(members)!r} must be ints")
        return ()
    members = tuple(int(r) for r in members)
    if not members:
        check.fail(BAD_MEMBERS, "ranks is empty; a process set needs at least one rank")
    elif list(members) != sorted(set(members)):
        check.fail(BAD_MEMBERS, (
            f"ranks {list(members)} must be sorted and unique; pass {sorted(set(members))}"
        ))
    elif members[0] < 0 or members[-1] >= size:
        check.fail(BAD_MEMBERS, f"ranks {list(members)} must lie in 0..{size - 1}")
    return members if check.ok else ()


def host_key(topology: Topology) -> int:
    """A number that is equal for processes on the same host."""
    import socket

    host = topology.hostname or socket.gethostname()
    return zlib.crc32(host.encode())


def group_topology(parent: Topology, members: Sequence[int], me: int,
                   hosts: Sequence[int]) -> Topology:
    """The topology of parent-rank ``me`` inside the group ``members``.

    ``hosts[r]`` is parent rank r's host key. Local rank and size count the
    members on this host; cross rank and size follow Horovod's meaning
    (position among the members with the same local rank).
    """
    mine = hosts[me]
    same_host = [m for m in members if hosts[m] == mine]
    local_of = {m: sum(1 for n in members if n < m and hosts[n] == hosts[m]) for m in members}
    peers = [m for m in members if local_of[m] == local_of[me]]
    return Topology(
        launcher=parent.launcher,
        rank=list(members).index(me),
        size=len(members),
        local_rank=local_of[me],
        local_size=len(same_host),
        cross_rank=peers.index(me),
        cross_size=len(peers),
        rendezvous_addr=parent.rendezvous_addr,
        rendezvous_port=parent.rendezvous_port,
        hostname=parent.hostname,
    )


# -- the exchanges themselves (called by ``Engine``'s public methods) ----------------


def agreed_rows(engine: Any, buf: Any, what: str) -> list[int]:
    """Every rank's first dimension, once dtypes and shapes agree (allgather)."""
    check = Check(buf)
    described, numbers = check.agree(engine, "allgather", what, [check.rows])
    rows = [n[0] for n in numbers]
    check_buffers(described, rows, what)
    return rows


def agreed_splits(engine: Any, buf: Any, splits: Any, what: str) -> np.ndarray:
    """``counts[i, j]``: rows rank i sends to rank j, once valid and agreed (alltoall)."""
    check = Check(buf)
    counts = as_splits(splits, check.rows, engine.size, check)
    described, numbers = check.agree(engine, "alltoall", what, [check.rows, *counts])
    check_buffers(described, [n[0] for n in numbers], what)
    return np.array([n[1:] for n in numbers], dtype=np.int64)


def agreed_op(engine: Any, buf: Any, op: str, what: str) -> str:
    """The common dtype, once shapes, dtypes and the reduce op agree (reducescatter)."""
    check = Check(buf)
    described, _ = check.agree(engine, "reducescatter", what, rows=check.rows, op=op)
    check_buffers(described, [d["rows"] for d in described], what)
    names = [d["op"] for d in described]
    if len(set(names)) > 1:
        raise ValueError(
            f"{what}: ranks passed different reduce ops ({', '.join(names)} for ranks 0.."
            f"{engine.size - 1}); every rank must pass the same op"
        )
    return str(described[0]["dtype"])


def agreed_members(engine: Any, ranks: Any,
                   what: str) -> tuple[tuple[int, ...], Topology | None]:
    """The subgroup's members and this rank's place in it (None outside it),
    once every rank passed the same valid list."""
    check = Check(None)
    members = check_members(ranks, engine.size, check)
    described, numbers = check.agree(engine, "subgroup", what, [host_key(engine.topology)],
                                     members=list(members))
    if any(d["members"] != described[0]["members"] for d in described):
        per_rank = "; ".join(f"rank {r}: {d['members']}" for r, d in enumerate(described))
        raise ValueError(
            f"{what}: ranks asked for different members ({per_rank}); every rank must "
            "pass the same ranks"
        )
    hosts = [n[0] for n in numbers]
    topology = (group_topology(engine.topology, members, engine.rank, hosts)
                if engine.rank in members else None)
    return members, topology
