"""Cross-rank agreement check run before every tensor collective.

A collective whose inputs differ between ranks (another shape, dtype,
reduce op, root or name, or another collective altogether) must fail on
*every* rank with the same clear error, never leave some ranks waiting —
Horovod's coordinator gives "Mismatched allreduce tensor shapes" there.

Before each collective (or group of them) every rank describes its request
in one small fixed-width int64 row per tensor (kind, name hash and the
name's first 24 bytes, op, dtype, device, shape, root, pre/post scale
factors, and a problem code for a mistake found locally, such as a name
still in flight) and the rows are all-gathered with one engine collective.
Every rank then runs the same comparison on the same table, so the outcome
— go on, or raise — is the same everywhere, and so is the message (the
local detail of a problem is added on the rank that has it, after "On this
rank:"). Cost: one all-gather of 184 bytes (23 int64) per tensor in the call.

The all-gather is issued under one constant engine name, so that two ranks
calling different collectives still meet in it (a name-matching engine such
as Horovod's would otherwise wait for two different names forever) and see
the difference.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from dp_plugin.dtypes import SUPPORTED_DTYPES
from dp_plugin.engines.base import Engine, ReduceOp
from dp_plugin.errors import DPPluginError


class MismatchError(DPPluginError, ValueError):
    """Ranks asked for different collectives, or passed incompatible tensors.

    Raised on every rank of the collective. A ``ValueError`` (bad input) and
    a ``RuntimeError`` (like Horovod's error from ``synchronize``) both."""


class DuplicateNameError(DPPluginError, ValueError):
    """A collective was started with a name still in flight on some rank."""


class Problem(enum.IntEnum):
    """A mistake one rank found in its own request; every rank raises for it."""

    NONE = 0
    DUPLICATE_NAME = 1
    UNSUPPORTED_DTYPE = 2
    ZERO_DIM = 3
    BAD_ROOT = 4
    BAD_SPLITS = 5


_PROBLEM_TEXT = {
    Problem.DUPLICATE_NAME: (
        "started it with a name that is still in flight there (an earlier *_async call "
        "with this name was not synchronized yet); synchronize() the earlier handle first "
        "or use another name"
    ),
    Problem.UNSUPPORTED_DTYPE: (
        "passed a tensor of dtype {dtypes}, which collectives do not support (supported: "
        + ", ".join(SUPPORTED_DTYPES) + "); cast it first"
    ),
    Problem.ZERO_DIM: (
        "passed a 0-dim tensor, which has no first dimension to concatenate or split along; "
        "reshape it to (1,)"
    ),
    Problem.BAD_ROOT: "passed a root_rank that is not a rank of the process set",
    Problem.BAD_SPLITS: (
        "passed invalid splits (one non-negative row count per rank of the process set, "
        "summing to the first dimension; without splits the first dimension must divide "
        "evenly)"
    ),
}

KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier")

# Which fields must agree, per kind (kind, group size and name always must).
_CHECKS: dict[str, tuple[str, ...]] = {
    "allreduce": ("op", "dtype", "device", "shape", "scales"),
    "allgather": ("dtype", "device", "trailing"),
    "broadcast": ("dtype", "device", "shape", "root"),
    "alltoall": ("dtype", "device", "trailing"),
    "reducescatter": ("op", "dtype", "device", "shape", "scales"),
    "barrier": (),
}

# dtype codes: the reducible ones first; the others only to name them in errors.
_DTYPE_NAMES = (*SUPPORTED_DTYPES, "bool", "complex32", "complex64", "complex128", "uint16",
                "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                "float8_e5m2fnuz", "another dtype")
_OPS = tuple(ReduceOp)
_MAX_DIMS = 8
"""Dimensions stored one by one; any further ones are compared by their product."""

# Column layout of a descriptor row.
_KIND, _GROUP, _PROBLEM, _NAME, _OP, _DTYPE, _DEVICE, _NDIM = range(8)
_DIMS = 8
_TAIL = _DIMS + _MAX_DIMS
_ROOT, _PRE, _POST = _TAIL + 1, _TAIL + 2, _TAIL + 3
_TEXT = _POST + 1
_TEXT_WORDS = 3
"""The name's first 24 UTF-8 bytes travel too, so that every rank can print
every rank's name (the hash alone decides equality)."""
WIDTH = _TEXT + _TEXT_WORDS

_CHECK_NAME = "dp_plugin.torch.check"


@dataclass(frozen=True, kw_only=True)
class Request:
    """What this rank asks for, for one tensor of a collective."""

    kind: str
    name: str | None
    tensor: Any = None
    """The input tensor (None for barrier)."""
    op: ReduceOp | None = None
    root: int = -1
    """``root_rank`` as the user passed it (broadcast)."""
    prescale: float = 1.0
    postscale: float = 1.0
    problem: Problem = Problem.NONE
    detail: str = ""
    """This rank's own explanation of ``problem`` (shown on this rank only)."""


Table = list[list[list[int]]]
"""Gathered descriptors: ``table[rank][i]`` is rank's row for tensor ``i``."""


def check_agreement(engine: Engine, requests: Sequence[Request]) -> Table:
    """All-gather the descriptors of ``requests`` and raise, on every rank
    alike, if any rank reported a problem or the ranks' requests differ.

    Collective over ``engine``'s ranks: every rank must call it, once per
    collective (or group of collectives), in the same order. Returns every
    rank's descriptors (see ``first_dims``).
    """
    if not requests:
        raise ValueError("a collective needs at least one tensor; got an empty list")
    rows = torch.tensor([_row(r, len(requests)) for r in requests], dtype=torch.int64,
                        device=engine.buffer_device)  # where the engine takes buffers
    table = engine.allgather(rows, name=_CHECK_NAME).cpu().tolist()
    blocks = _split_by_rank(table, engine.size)
    _raise_problems(blocks, requests)
    _raise_mismatch(blocks, requests)
    return blocks


def first_dims(table: Table, index: int) -> list[int]:
    """Every rank's first dimension of tensor ``index`` (allgather's row counts)."""
    return [block[index][_DIMS] for block in table]


def _row(req: Request, group: int) -> list[int]:
    row = [-1] * WIDTH
    row[_KIND] = KINDS.index(req.kind)
    row[_GROUP] = group
    row[_PROBLEM] = int(req.problem)
    row[_NAME] = name_hash(req.name)
    row[_TEXT:_TEXT + _TEXT_WORDS] = _name_words(req.name)
    row[_OP] = -1 if req.op is None else _OPS.index(req.op)
    row[_ROOT] = req.root
    row[_PRE], row[_POST] = _bits(req.prescale), _bits(req.postscale)
    t = req.tensor
    if t is not None:
        dtype = str(t.dtype).removeprefix("torch.")
        row[_DTYPE] = _DTYPE_NAMES.index(dtype) if dtype in _DTYPE_NAMES else len(_DTYPE_NAMES) - 1
        row[_DEVICE] = {"cpu": 0, "cuda": 1}.get(t.device.type, 2)
        shape = [int(d) for d in t.shape]
        row[_NDIM] = len(shape)
        row[_DIMS:_DIMS + min(len(shape), _MAX_DIMS)] = shape[:_MAX_DIMS]
        tail = 1
        for d in shape[_MAX_DIMS:]:
            tail *= d
        row[_TAIL] = tail
    return row


def name_hash(name: str | None) -> int:
    """A process-independent 63-bit hash of a collective's name (0: unnamed)."""
    if name is None:
        return 0
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1 or 1


def _name_words(name: str | None) -> list[int]:
    raw = (name or "").encode()[:8 * _TEXT_WORDS].ljust(8 * _TEXT_WORDS, b"\0")
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def _name_text(row: list[int]) -> str:
    """The name as far as the row carries it: 'g', 'a-long-name'..., or 'no name'."""
    if row[_NAME] == 0:
        return "no name"
    raw = b"".join(w.to_bytes(8, "little", signed=True) for w in row[_TEXT:_TEXT + _TEXT_WORDS])
    text = raw.rstrip(b"\0").decode(errors="ignore")
    return repr(text) if len(raw.rstrip(b"\0")) < 8 * _TEXT_WORDS else f"{text!r}..."


def _bits(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", float(x)))[0])


def _float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


def _split_by_rank(table: list[list[int]], size: int) -> Table:
    """Cut the gathered rows into one block per rank (each block's rows
    carry its length)."""
    blocks: Table = []
    at = 0
    while at < len(table) and len(blocks) < size:
        n = table[at][_GROUP]
        blocks.append(table[at:at + n])
        at += n
    if len(blocks) != size or at != len(table):
        raise MismatchError(
            f"the agreement check received {len(table)} malformed descriptor rows for "
            f"{size} ranks; some rank is running another version of dp_plugin"
        )
    return blocks


def _what(req: Request, index: int, group: int) -> str:
    """'g' or 'an unnamed tensor', plus its place in a group."""
    subject = "an unnamed tensor" if req.name is None else repr(req.name)
    member = f" (tensor {index} of the group of {group})" if group > 1 else ""
    return subject + member


def _raise_problems(blocks: Table, requests: Sequence[Request]) -> None:
    bad = [(rank, row) for rank, block in enumerate(blocks) for row in block
           if row[_PROBLEM] != Problem.NONE]
    if not bad:
        return
    row = bad[0][1]
    problem = Problem(row[_PROBLEM])
    ranks = sorted({r for r, x in bad if x[_PROBLEM] == problem})
    mine = next((r for r in requests if r.problem is problem), None)
    detail = f" On this rank: {mine.detail}." if mine is not None and mine.detail else ""
    dtypes = sorted({_DTYPE_NAMES[x[_DTYPE]] for _, x in bad if x[_PROBLEM] == problem})
    said = _PROBLEM_TEXT[problem].replace("{dtypes}", " / ".join(dtypes))
    text = (f"{KINDS[row[_KIND]]} cannot run: rank(s) {ranks} {said}. "
            f"Every rank of the collective raises this error.{detail}")
    if problem is Problem.DUPLICATE_NAME:
        name = requests[0].name
        raise DuplicateNameError(f"Duplicate name {name!r}: {text}")
    if problem is Problem.UNSUPPORTED_DTYPE:
        raise TypeError(text)
    raise ValueError(text)


def _raise_mismatch(blocks: Table, requests: Sequence[Request]) -> None:
    counts = [len(b) for b in blocks]
    first = requests[0]
    if len(set(counts)) > 1:
        raise MismatchError(
            f"Mismatched group sizes for grouped {first.kind}{_named(first)}: "
            + _by_value(counts, lambda n: f"passed {n} tensor(s)")
            + ". Every rank must pass the same number of tensors, in the same order"
        )
    for index, req in enumerate(requests):
        column = [b[index] for b in blocks]
        what = _what(req, index, len(requests))
        kinds = [row[_KIND] for row in column]
        if len(set(kinds)) > 1:
            raise MismatchError(
                "Mismatched collectives: at the same point in the program "
                + _by_value([(row[_KIND], _name_text(row)) for row in column],
                            lambda v: f"called {KINDS[v[0]]} ({v[1]})")
                + ". Every rank must call the same collectives in the same order"
            )
        if len({row[_NAME] for row in column}) > 1:
            raise MismatchError(
                f"Mismatched names for {req.kind}: "
                + _by_value([_name_text(row) for row in column], lambda t: f"passed {t}")
                + ". Every rank must give a collective the same name (or none)"
            )
        for field in _CHECKS[req.kind]:
            values = [_field(row, field) for row in column]
            if len(set(values)) > 1:
                raise MismatchError(
                    f"Mismatched {req.kind} tensor {_FIELD_TEXT[field][0]} for {what}: "
                    + _by_value(values, _show(field))
                    + f". {_FIELD_TEXT[field][1]}"
                )


def _named(req: Request) -> str:
    return "" if req.name is None else f" {req.name!r}"


def _by_value(values: Sequence[Any], show: Any) -> str:
    """'rank(s) 0, 2 <show(v)>; rank(s) 1 <show(w)>' grouped by value, in rank order."""
    groups: dict[Any, list[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    return "; ".join(f"rank(s) {', '.join(map(str, ranks))} {show(v)}"
                     for v, ranks in groups.items())


def _field(row: list[int], field: str) -> Any:
    ndim = row[_NDIM]
    dims = tuple(row[_DIMS:_DIMS + min(ndim, _MAX_DIMS)])
    if field == "op":
        return row[_OP]
    if field == "dtype":
        return row[_DTYPE]
    if field == "device":
        return row[_DEVICE]
    if field == "shape":
        return (ndim, dims, row[_TAIL])
    if field == "trailing":
        return (ndim, dims[1:], row[_TAIL])
    if field == "root":
        return row[_ROOT]
    return (row[_PRE], row[_POST])  # scales


def _show(field: str) -> Any:
    def shape(v: tuple[int, tuple[int, ...], int], star: bool = False) -> str:
        ndim, dims, tail = v
        parts = (["*"] if star else []) + [str(d) for d in dims]
        if ndim > _MAX_DIMS:
            parts.append(f"... ({tail} elements)")
        return f"passed shape ({', '.join(parts)}{',' if len(parts) == 1 else ''})"

    shows: dict[str, Any] = {
        "op": lambda v: f"passed op={_OPS[v].name.capitalize() if v >= 0 else None}",
        "dtype": lambda v: f"passed a {_DTYPE_NAMES[v]} tensor",
        "device": lambda v: f"passed a {('cpu', 'cuda', 'non-CPU/CUDA')[v]} tensor",
        "shape": shape,
        "trailing": lambda v: shape(v, star=True),
        "root": lambda v: f"passed root_rank={v}",
        "scales": lambda v: (f"passed prescale_factor={_float(v[0]):g}, "
                             f"postscale_factor={_float(v[1]):g}"),
    }
    return shows[field]


_FIELD_TEXT = {
    "op": ("reduce ops", "Every rank must pass the same op"),
    "dtype": ("types", "Every rank must pass the same dtype"),
    "device": ("devices", "Every rank must pass tensors on the same kind of device"),
    "shape": ("shapes", "Every rank must pass the same shape"),
    "trailing": ("shapes", "Every rank must pass the same dimensions after the first (only "
                 "the first may differ)"),
    "root": ("root ranks", "Every rank must pass the same root_rank"),
    "scales": ("scale factors", "Every rank must pass the same prescale_factor and "
               "postscale_factor"),
}
