"""Agreement checks that precede allgather, alltoall, reducescatter and subgroup.

This is the engines' one encoding of "what every rank passed": no engine
has its own.

A mistake on one rank (wrong splits, another dtype, another member list)
must raise on *every* rank, never leave the others waiting in a collective.
So each of those collectives first all-gathers a small fixed-size int64
header per rank that describes the input — or says what is wrong with it —
and every rank validates the same table with the same code: the outcome
(result or exception) is identical everywhere. The rank that made the
mistake also gets the local detail in its message.

Header layout (one int64 row per rank):
``[problem, dtype code, ndim, dim 0, dims 1..8 (-1 padded), extras...]``.
"""

from __future__ import annotations

import numbers
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from dp_plugin.dtypes import SUPPORTED_DTYPES, canonical_dtype
from dp_plugin.launch import Topology

MAX_DIMS = 9
"""Inputs may have at most this many dimensions (the header holds them all)."""
_FIXED = 3 + MAX_DIMS
_DTYPES = tuple(SUPPORTED_DTYPES)

# Problem codes carried in column 0, with the wording other ranks see.
OK = 0
_ZERO_DIM = 1
_TOO_MANY_DIMS = 2
_BAD_DTYPE = 3
BAD_SPLITS = 4
BAD_MEMBERS = 5
_PROBLEMS = {
    _ZERO_DIM: "passed a 0-d buffer",
    _TOO_MANY_DIMS: f"passed a buffer with more than {MAX_DIMS} dimensions",
    _BAD_DTYPE: "passed an unsupported dtype",
    BAD_SPLITS: "passed invalid splits",
    BAD_MEMBERS: "passed an invalid list of ranks",
}


class Header:
    """This rank's header row and, if its input is bad, the local detail.

    ``buf`` None makes a header without a buffer description (subgroup)."""

    def __init__(self, buf: Any | None, n_extras: int) -> None:
        self.row = np.full(_FIXED + n_extras, -1, dtype=np.int64)
        self.row[0] = OK
        self.detail: str | None = None
        if buf is None:
            return
        shape = tuple(int(d) for d in buf.shape)
        self.row[2] = len(shape)
        try:
            self.row[1] = _DTYPES.index(canonical_dtype(buf.dtype))
        except TypeError as exc:
            self.fail(_BAD_DTYPE, str(exc))
        if not shape:
            self.fail(_ZERO_DIM, "a 0-d buffer has no first dimension to split or "
                      "concatenate along; reshape it to (1,)")
        elif len(shape) > MAX_DIMS:
            self.fail(_TOO_MANY_DIMS, f"the buffer has shape {shape}, more than {MAX_DIMS} "
                      "dimensions; reshape it")
        else:
            self.row[3:3 + len(shape)] = shape

    @property
    def ok(self) -> bool:
        return bool(self.row[0] == OK)

    def put_extras(self, values: Sequence[int]) -> None:
        self.row[_FIXED:] = list(values)

    def fail(self, code: int, detail: str) -> None:
        """Record the first problem of this rank's input (later ones are
        consequences of it)."""
        if self.ok:
            self.row[0] = code
            self.detail = detail


def check_problems(table: np.ndarray, header: Header, what: str) -> None:
    """Raise, identically on every rank, if any rank reported a problem.

    ``TypeError`` for a bad dtype, ``ValueError`` otherwise; the message
    names the ranks, and on a rank at fault also its own detail."""
    bad = [r for r in range(len(table)) if table[r, 0] != OK]
    if not bad:
        return
    first = int(table[bad[0], 0])
    error = TypeError if first == _BAD_DTYPE else ValueError
    summary = f"rank(s) {bad} {_PROBLEMS.get(first, 'passed an invalid input')}"
    if header.detail:
        raise error(f"{what}: {header.detail} ({summary}; every rank raises this error)")
    raise error(
        f"{what}: {summary}; see the error on rank {bad[0]} for the details and the fix "
        "(every rank raises this error)"
    )


def check_table(table: np.ndarray, header: Header, what: str, *,
                same_first_dim: bool) -> tuple[str, tuple[int, ...]]:
    """Validate every rank's header, identically on every rank.

    Returns the common dtype and dimensions after the first. Raises ``TypeError`` for a
    bad dtype and ``ValueError`` for every other problem, naming the ranks.
    """
    check_problems(table, header, what)
    layouts = [_layout(row) for row in table]
    skip = 0 if same_first_dim else 1
    if any((d, s[skip:]) != (layouts[0][0], layouts[0][1][skip:]) for d, s in layouts):
        expect = ("the same shape" if same_first_dim else
                  "the same dimensions after the first (only the first may differ)")
        per_rank = ", ".join(f"rank {r}: {d}{list(s)}" for r, (d, s) in enumerate(layouts))
        raise ValueError(
            f"{what}: ranks passed different buffers ({per_rank}); every rank must pass the "
            f"same dtype and {expect}"
        )
    dtype, dims = layouts[0]
    return dtype, dims[1:]


def _layout(row: np.ndarray) -> tuple[str, tuple[int, ...]]:
    return _DTYPES[int(row[1])], tuple(int(d) for d in row[3:3 + int(row[2])])


def first_dims(table: np.ndarray) -> list[int]:
    """Every rank's first dimension, from a validated header table."""
    return [int(d) for d in table[:, 3]]


def extras(table: np.ndarray) -> np.ndarray:
    """The per-rank extra columns of a header table."""
    return table[:, _FIXED:]


def as_splits(splits: Any, rows: int, size: int, header: Header) -> list[int]:
    """This rank's send counts; records a problem in ``header`` if invalid.

    ``None`` divides ``rows`` evenly (an error if it does not divide, as in
    Horovod). Accepts any sequence of ints, or a 1-D numpy array / tensor.
    """
    if splits is None:
        if rows % size:
            header.fail(BAD_SPLITS, (
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
        header.fail(BAD_SPLITS, f"splits {counts!r} must be ints (rows to send to each rank)")
        return [0] * size
    counts = [int(c) for c in counts]
    if len(counts) != size:
        header.fail(BAD_SPLITS, (
            f"splits {counts} has {len(counts)} entries but there are {size} ranks; pass one "
            "row count per rank, in rank order"
        ))
    elif any(c < 0 for c in counts):
        header.fail(BAD_SPLITS, f"splits {counts} contains a negative row count")
    elif sum(counts) != rows:
        header.fail(BAD_SPLITS, (
            f"splits {counts} sums to {sum(counts)} but the buffer's first dimension is "
            f"{rows}; the splits must cover every row exactly once"
        ))
    return counts if header.ok else [0] * size


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def reducescatter_counts(rows: int, size: int) -> list[int]:
    """Rows each rank keeps after a reduce-scatter of ``rows`` rows.

    Horovod 0.28.1's rule (``ReducescatterOp::ComputeOutputShapeForRank``):
    ``rows // size`` each, and ranks ``0 .. rows % size - 1`` one more.
    """
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


def check_members(ranks: Any, size: int, header: Header) -> tuple[int, ...]:
    """Validate a subgroup's member list (records problems in ``header``)."""
    try:
        members = tuple(ranks)
    except TypeError:
        header.fail(BAD_MEMBERS, f"ranks {ranks!r} is not a sequence of ints")
        return ()
    if not all(_is_int(r) for r in members):
        header.fail(BAD_MEMBERS, f"ranks {list(members)!r} must be ints")
        return ()
    members = tuple(int(r) for r in members)
    if not members:
        header.fail(BAD_MEMBERS, "ranks is empty; a process set needs at least one rank")
    elif list(members) != sorted(set(members)):
        header.fail(BAD_MEMBERS, (
            f"ranks {list(members)} must be sorted and unique; pass {sorted(set(members))}"
        ))
    elif members[0] < 0 or members[-1] >= size:
        header.fail(BAD_MEMBERS, f"ranks {list(members)} must lie in 0..{size - 1}")
    return members if header.ok else ()


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
    local_of = {}
    for m in members:
        local_of[m] = sum(1 for n in members if n < m and hosts[n] == hosts[m])
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
    """Every rank's first dimension, once the headers agree (allgather)."""
    header = Header(buf, 0)
    table = engine._exchange(header.row, what)
    check_table(table, header, what, same_first_dim=False)
    return first_dims(table)


def agreed_splits(engine: Any, buf: Any, splits: Any, what: str) -> np.ndarray:
    """``counts[i, j]``: rows rank i sends to rank j, once valid and agreed (alltoall)."""
    header = Header(buf, engine.size)
    rows = int(buf.shape[0]) if len(buf.shape) else 0
    header.put_extras(as_splits(splits, rows, engine.size, header))
    table = engine._exchange(header.row, what)
    check_table(table, header, what, same_first_dim=False)
    return extras(table)


def agreed_op(engine: Any, buf: Any, op_code: int, ops: Sequence[Any], what: str) -> str:
    """The common dtype, once shapes, dtypes and the reduce op agree (reducescatter)."""
    header = Header(buf, 1)
    header.put_extras([op_code])
    table = engine._exchange(header.row, what)
    dtype, _ = check_table(table, header, what, same_first_dim=True)
    names = [ops[int(i)].value for i in extras(table)[:, 0]]
    if len(set(names)) > 1:
        raise ValueError(
            f"{what}: ranks passed different reduce ops ({', '.join(names)} for ranks 0.."
            f"{engine.size - 1}); every rank must pass the same op"
        )
    return dtype


def agreed_members(engine: Any, ranks: Any,
                   what: str) -> tuple[tuple[int, ...], Topology | None]:
    """The subgroup's members and this rank's place in it (None outside it),
    once every rank passed the same valid list."""
    header = Header(None, 1 + engine.size)
    members = check_members(ranks, engine.size, header)
    mask = [1 if r in members else 0 for r in range(engine.size)]
    header.put_extras([host_key(engine.topology), *mask])
    table = engine._exchange(header.row, what)
    check_problems(table, header, what)
    masks = extras(table)[:, 1:]
    if (masks != masks[0]).any():
        per_rank = "; ".join(
            f"rank {r}: {np.flatnonzero(m).tolist()}" for r, m in enumerate(masks)
        )
        raise ValueError(
            f"{what}: ranks asked for different members ({per_rank}); every rank must "
            "pass the same ranks"
        )
    hosts = [int(h) for h in extras(table)[:, 0]]
    topology = (group_topology(engine.topology, members, engine.rank, hosts)
                if engine.rank in members else None)
    return members, topology
