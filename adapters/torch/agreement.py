"""Cross-rank agreement check run before every tensor collective.

A collective whose inputs differ between ranks (another shape, dtype,
reduce op, root or name, or another collective altogether) must fail on
*every* rank with the same clear error, never leave some ranks waiting —
Horovod's coordinator gives "Mismatched allreduce tensor shapes" there.

Before each collective (or group of them) every rank describes its request
— per tensor the fields that must agree for its kind, and a problem code for
a mistake found locally (an unsupported dtype, bad splits, a root outside
the process set) — and runs the core's one agreement exchange
(``dp_plugin.agreement.compare``): one small all-gather of a digest, plus
each rank's first dimensions (allgather needs them); the descriptions
themselves travel only when the digests differ. Every rank then runs the
same comparison on the same descriptions, so the outcome — go on, or raise
— is the same everywhere, and so is the message (the local detail of a
problem is added on the rank that has it, after "On this rank:").

The exchange is issued under one constant engine name, so that two ranks
calling different collectives still meet in it (a name-matching engine such
as Horovod's would otherwise wait for two different names forever) and see
the difference.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dp_plugin import join
from dp_plugin.agreement import Heard, compare
from dp_plugin.dtypes import SUPPORTED_DTYPES
from dp_plugin.engines.base import Engine, ReduceOp
from dp_plugin.errors import DPPluginError


class MismatchError(DPPluginError, ValueError):
    """Ranks asked for different collectives, or passed incompatible tensors.

    Raised on every rank of the collective. A ``ValueError`` (bad input) and
    a ``RuntimeError`` (like Horovod's error from ``synchronize``) both."""


class DuplicateNameError(DPPluginError, ValueError):
    """A collective was started with a name still in flight on this rank.

    Raised on that rank alone, before anything is sent (Horovod's rule): the
    other ranks are not involved and the job stays usable."""


class Problem(enum.IntEnum):
    """A mistake one rank found in its own request; every rank raises for it."""

    NONE = 0
    UNSUPPORTED_DTYPE = 1
    ZERO_DIM = 2
    BAD_ROOT = 3
    BAD_SPLITS = 4


_PROBLEM_TEXT = {
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

# Which fields must agree, per kind (kind, group size and name always must).
_CHECKS: dict[str, tuple[str, ...]] = {
    "allreduce": ("op", "dtype", "device", "shape", "scales"),
    "allgather": ("dtype", "device", "trailing"),
    "broadcast": ("dtype", "device", "shape", "root"),
    "alltoall": ("dtype", "device", "trailing"),
    "reducescatter": ("op", "dtype", "device", "shape", "scales"),
    "barrier": (),
}

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
    splits: tuple[int, ...] = ()
    """Rows to send to each rank (alltoall; empty when invalid)."""
    problem: Problem = Problem.NONE
    detail: str = ""
    """This rank's own explanation of ``problem`` (shown on this rank only)."""


Table = list[list[int]]
"""Every rank's numbers from the check: ``table[rank][i]`` is the first
dimension of rank's tensor ``i`` (-1 where there is none; 0 on a joined
rank); then the ``splits`` of each request (alltoall)."""


def check_agreement(engine: Engine, requests: Sequence[Request]) -> Table:
    """Compare the ranks' ``requests`` and raise, on every rank alike, if any
    rank reported a problem or the ranks' requests differ.

    Collective over ``engine``'s ranks: every rank must call it, once per
    collective (or group of collectives), in the same order. Returns every
    rank's numbers (``Table``).
    """
    if not requests:
        raise ValueError("a collective needs at least one tensor; got an empty list")
    mine = [_describe(r) for r in requests]
    numbers = [_first_dim(r) for r in requests] + [n for r in requests for n in r.splits]
    got = compare(engine, _CHECK_NAME, mine, numbers, joined_ok=True)
    if got.described is None and any(r.problem for r in requests):
        _raise_problems([mine] * engine.size, requests)  # the same problem everywhere
    if got.described is not None:
        _raise_problems([b for b in got.described if b is not None], requests)
        _raise_mismatch([b for b in got.described if b is not None], requests)
        if not got.joined:
            raise MismatchError(  # the digests differ, the descriptions do not
                "the agreement check's digests differ across ranks although the requests "
                "agree; the collective engine corrupted data (report this as a bug)"
            )
    join.admit(requests[0].kind, requests[0].name,
               [engine.global_ranks[r] for r in got.joined])
    return _with_joined(got.numbers, len(requests))


def joined_view(heard: Heard) -> tuple[list[dict[str, Any]] | None, Table]:
    """On a joined rank: the request the others agreed on (one description
    per tensor) and every rank's numbers; None when the others ran another
    agreement than this module's (they refuse a joined rank themselves)."""
    if any(env is not None and env[0] != _CHECK_NAME for env in heard.envelopes):
        return None, []
    blocks = [b for b in heard.described if b is not None]
    if not blocks or any(d["problem"] for b in blocks for d in b):
        return None, []  # every rank that called it raises
    return blocks[0], _with_joined(heard.numbers, len(blocks[0]))


def _with_joined(numbers: list[list[int]], count: int) -> Table:
    """The table, a joined rank's (empty) numbers as zeros: it contributes
    nothing."""
    return [row or [0] * count for row in numbers]


def first_dims(table: Table, index: int) -> list[int]:
    """Every rank's first dimension of tensor ``index`` (allgather's row counts)."""
    return [numbers[index] for numbers in table]


def _first_dim(req: Request) -> int:
    t = req.tensor
    return int(t.shape[0]) if t is not None and t.dim() else -1


def _describe(req: Request) -> dict[str, Any]:
    """The fields of ``req`` that must agree across ranks (for its kind)."""
    out: dict[str, Any] = {"kind": req.kind, "name": req.name, "problem": int(req.problem)}
    t = req.tensor
    if t is not None:
        shape: list[Any] = [int(d) for d in t.shape]
        if "trailing" in _CHECKS[req.kind] and shape:
            shape[0] = "*"  # only the first dimension may differ
        out.update(dtype=str(t.dtype).removeprefix("torch."), device=t.device.type, shape=shape)
    if req.op is not None:
        out["op"] = req.op.name.capitalize()
    if "root" in _CHECKS[req.kind]:
        out["root"] = req.root
    if "scales" in _CHECKS[req.kind]:
        out["scales"] = [req.prescale, req.postscale]
    return out


def _what(req: Request, index: int, group: int) -> str:
    """'g' or 'an unnamed tensor', plus its place in a group."""
    subject = "an unnamed tensor" if req.name is None else repr(req.name)
    member = f" (tensor {index} of the group of {group})" if group > 1 else ""
    return subject + member


Described = list[list[dict[str, Any]]]
"""``described[rank][i]``: rank's description of tensor ``i``."""


def _raise_problems(blocks: Described, requests: Sequence[Request]) -> None:
    bad = [(rank, d) for rank, block in enumerate(blocks) for d in block if d["problem"]]
    if not bad:
        return
    first = bad[0][1]
    problem = Problem(first["problem"])
    ranks = sorted({r for r, d in bad if d["problem"] == problem})
    mine = next((r for r in requests if r.problem is problem), None)
    detail = f" On this rank: {mine.detail}." if mine is not None and mine.detail else ""
    dtypes = sorted({d.get("dtype", "?") for _, d in bad if d["problem"] == problem})
    said = _PROBLEM_TEXT[problem].replace("{dtypes}", " / ".join(dtypes))
    text = (f"{first['kind']} cannot run: rank(s) {ranks} {said}. "
            f"Every rank of the collective raises this error.{detail}")
    raise (TypeError if problem is Problem.UNSUPPORTED_DTYPE else ValueError)(text)


def _raise_mismatch(blocks: Described, requests: Sequence[Request]) -> None:
    counts = [len(b) for b in blocks]
    first = requests[0]
    if len(set(counts)) > 1:
        raise MismatchError(
            f"Mismatched group sizes for grouped {first.kind}{_named(first.name)}: "
            + _by_value(counts, lambda n: f"passed {n} tensor(s)")
            + ". Every rank must pass the same number of tensors, in the same order"
        )
    for index, req in enumerate(requests):
        column = [b[index] for b in blocks]
        if len({d["kind"] for d in column}) > 1:
            raise MismatchError(
                "Mismatched collectives: at the same point in the program "
                + _by_value([(d["kind"], _name_text(d)) for d in column],
                            lambda v: f"called {v[0]} ({v[1]})")
                + ". Every rank must call the same collectives in the same order"
            )
        if len({d["name"] for d in column}) > 1:
            raise MismatchError(
                f"Mismatched names for {req.kind}: "
                + _by_value([_name_text(d) for d in column], lambda t: f"passed {t}")
                + ". Every rank must give a collective the same name (or none)"
            )
        for field in _CHECKS[req.kind]:
            key = "shape" if field == "trailing" else field
            values = [_hashable(d.get(key)) for d in column]
            if len(set(values)) > 1:
                what, fix = _FIELD_TEXT[field]
                raise MismatchError(
                    f"Mismatched {req.kind} tensor {what} for {_what(req, index, len(requests))}: "
                    + _by_value(values, _SHOW[key]) + f". {fix}"
                )


def _name_text(d: dict[str, Any]) -> str:
    return "no name" if d["name"] is None else repr(d["name"])


def _named(name: str | None) -> str:
    return "" if name is None else f" {name!r}"


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _by_value(values: Sequence[Any], show: Any) -> str:
    """'rank(s) 0, 2 <show(v)>; rank(s) 1 <show(w)>' grouped by value, in rank order."""
    groups: dict[Any, list[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    return "; ".join(f"rank(s) {', '.join(map(str, ranks))} {show(v)}"
                     for v, ranks in groups.items())


_SHOW: dict[str, Any] = {
    "op": lambda v: f"passed op={v}",
    "dtype": lambda v: f"passed a {v} tensor",
    "device": lambda v: f"passed a {v} tensor",
    "shape": lambda v: f"passed shape ({', '.join(map(str, v))}{',' if len(v) == 1 else ''})",
    "root": lambda v: f"passed root_rank={v}",
    "scales": lambda v: f"passed prescale_factor={v[0]:g}, postscale_factor={v[1]:g}",
}

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
