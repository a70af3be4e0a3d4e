"""One description of a tensor collective, and the one check that the ranks agree on it.

A collective whose inputs differ between ranks (another shape, dtype, reduce
op, root, splits or name, or another collective altogether) must fail on
*every* rank with the same clear error, never leave some ranks waiting —
Horovod's coordinator gives "Mismatched allreduce tensor shapes" there.

Both adapters and the core describe what they are about to run as a
``Request`` (a fused collective's layout and settings too: ``Request.fused``)
and call ``check``: every rank looks for its own mistakes (``_local_problem``),
then all ranks run the one agreement exchange (``dp_plugin.agreement.compare``,
which also carries the numbers the collective needs from every rank). Every
rank runs the same comparison on the same descriptions, so the outcome — an
``Agreed`` to run, or a ``MismatchError`` carrying its ``Problem`` — is the
same everywhere, and so is the message (a problem's local detail is added on
the rank that has it, after "On this rank:"). The messages come from one
table (``_PROBLEM_TEXT``, ``_FIELD_TEXT``, and the layout's ``_layout_text``,
``_settings_text``).

Engines then move bytes only: ``Engine.allgather`` takes the agreed rows,
``Engine.alltoall`` the agreed counts. ``allgather``, ``alltoall``,
``reducescatter`` and ``subgroup`` below are check-then-move for callers
holding plain buffers.
"""

from __future__ import annotations

import socket
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dp_plugin import join
from dp_plugin.agreement import Heard, compare
from dp_plugin.dtypes import SUPPORTED_DTYPES, canonical_dtype
from dp_plugin.edge import caller
from dp_plugin.engines.base import ReduceOp, Started
from dp_plugin.errors import MismatchError, Problem
from dp_plugin.fusion import TensorSpec
from dp_plugin.validate import is_int

_PROBLEM_TEXT = {
    Problem.UNSUPPORTED_DTYPE: (
        "passed a tensor of dtype {dtypes}, which collectives do not support (supported: "
        + ", ".join(SUPPORTED_DTYPES) + "; allgather, alltoall and broadcast also move "
        "bool and uint16); cast it first"
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
    Problem.BAD_MEMBERS: (
        "passed an invalid list of ranks (sorted, unique ints of the process set, at least one)"
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
    "subgroup": ("members",),
    "fused": (),  # its layout, then its settings (_layout_text, _settings_text)
}

REDUCING = frozenset({"allreduce", "reducescatter"})
"""Kinds that add values up: their dtypes must be reducible (``dtypes.py``)."""

MOVABLE = frozenset({*SUPPORTED_DTYPES, "bool", "uint16"})
"""What the other kinds take: Horovod's dtypes (the engines move the ones
they do not reduce as raw bytes)."""

_NEEDS_FIRST_DIM = frozenset({"allgather", "alltoall", "reducescatter"})

_NEEDS_TENSORS = REDUCING | _NEEDS_FIRST_DIM
"""Kinds over a tensor list (a broadcast without a tensor checks its root alone)."""

CHECK_TAG = "dp_plugin.check"
"""The agreement tag of every request (one tag, so that two ranks in
different collectives compare their requests and say so)."""


@dataclass(frozen=True, kw_only=True)
class Request:
    """What this rank asks for: one collective over one or more tensors."""

    kind: str
    name: str | None = None
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    """Dtype names as the framework spells them without its prefix ("float32", "bool")."""
    devices: tuple[str, ...] = ()
    """Device kinds ("cpu", "cuda"): 'cuda:0' and 'cuda:1' are the same kind."""
    op: ReduceOp | None = None
    scales: tuple[float, float] = (1.0, 1.0)
    root: int = -1
    """``root_rank`` as the user passed it (broadcast; job-wide)."""
    splits: Any = None
    """Rows to send to each rank as the user passed them (alltoall; None: even)."""
    members: Any = None
    """The ranks of a new process set as the user passed them (subgroup)."""
    layout: tuple[TensorSpec, ...] = ()
    """A fused collective's tensors, in order (kind "fused")."""
    settings: Mapping[str, Any] | None = None
    """Values every rank of a fused collective must share (fusion threshold,
    compression, scales ...), by name; compared as their ``repr``."""

    @classmethod
    def of(cls, kind: str, bufs: Sequence[Any], **fields: Any) -> Request:
        """The request over numpy arrays, torch or TensorFlow tensors ``bufs``."""
        return cls(kind=kind, shapes=tuple(tuple(int(d) for d in b.shape) for b in bufs),
                   dtypes=tuple(dtype_name(b.dtype) for b in bufs),
                   devices=tuple(_device_kind(b) for b in bufs), **fields)

    @classmethod
    def fused(cls, layout: Sequence[TensorSpec], what: str,
              settings: Mapping[str, Any] | None = None) -> Request:
        """A fused collective over ``layout`` with ``settings``; ``what`` names
        its tensors in messages ("the {what} registered for all-reduce differ")."""
        return cls(kind="fused", name=what, layout=tuple(layout), settings=settings)


def dtype_name(dtype: Any) -> str:
    """'float32', 'bool', 'uint16' ... for a numpy, torch or TensorFlow dtype."""
    name = getattr(dtype, "name", None)
    if not isinstance(name, str):  # torch.dtype has no .name
        name = str(dtype).removeprefix("torch.")
    return name


def _device_kind(buf: Any) -> str:
    device = getattr(buf, "device", "cpu")
    kind = getattr(device, "type", None)  # torch.device
    if kind is None:  # numpy: no device (a str attribute on some versions); TF: a string
        kind = "gpu" if "GPU" in str(device).upper() else "cpu"
    return str(kind)


@dataclass(frozen=True)
class Agreed:
    """What every rank agreed to run (the same on every rank)."""

    table: list[list[int]]
    """``table[rank]``: the rank's first dimension of each tensor (0 on a
    joined rank), then its splits (alltoall) or host key (subgroup)."""
    count: int
    """Tensors in the request."""
    joined: tuple[int, ...] = ()
    members: tuple[int, ...] = ()
    """The agreed, valid member list (subgroup)."""
    root: int = -1
    """The agreed root as a rank of the engine (broadcast)."""

    def rows(self, index: int = 0) -> list[int]:
        """Every rank's first dimension of tensor ``index`` (allgather)."""
        return [numbers[index] for numbers in self.table]

    def counts(self) -> np.ndarray:
        """``counts[i, j]``: rows rank i sends to rank j (alltoall)."""
        return np.array([n[self.count:] for n in self.table], dtype=np.int64)

    def hosts(self) -> list[int]:
        """Every rank's host key (subgroup)."""
        return [n[0] for n in self.table]


def check(engine: Any, request: Request, *, accept_joined: bool = False) -> Agreed:
    """Compare the ranks' requests and raise, on every rank alike, if any
    rank found a problem in its own or the ranks' requests differ.

    Collective over ``engine``'s ranks: every rank calls it once per
    collective (or group of collectives), in the same order.
    ``accept_joined``: the caller's ranks may run with joined ranks (the
    torch adapter, whose ``hvd.join()`` answers); ``dp_plugin.join`` then
    says which kinds run and raises ``JoinedRankError`` for the others.
    """
    if request.kind in _NEEDS_TENSORS and not request.shapes:
        raise ValueError("a collective needs at least one tensor; got an empty list")
    problem, detail, extra, members, root = _local_problem(engine, request)
    mine = [_describe(request, i, problem, members) for i in range(max(1, len(request.shapes)))]
    numbers = [shape[0] if shape else -1 for shape in request.shapes] + extra
    got = compare(engine, CHECK_TAG, mine, numbers, joined_ok=accept_joined,
                  what=f"{request.kind}{_named(request.name)}")
    blocks = _by_job_rank(engine, got, mine)
    # Equal digests: every active rank described the same request, its problem
    # included, and only this rank's copy is at hand (it stands for each of them).
    _raise_problems(blocks, detail, every_rank=got.same and not got.joined and engine.size > 1)
    if not got.same:
        _raise_mismatch(blocks, request, engine.job_rank)
        if not got.joined:
            raise MismatchError(  # the digests differ, the descriptions do not
                "the agreement check's digests differ across ranks although the requests "
                "agree; the collective engine corrupted data (report this as a bug)"
            )
    join.admit(request.kind, request.name, [engine.global_ranks[r] for r in got.joined])
    return Agreed(_with_joined(got.numbers, len(numbers)), len(request.shapes), got.joined,
                  members, root)


def agreed_root(engine: Any, root_rank: Any) -> int:
    """Check that every rank passed the same valid ``root_rank`` (job-wide,
    Horovod's rule: ``root_of``) and return it as a rank of ``engine``, for a
    broadcast that runs no ``check`` of its own (objects, parameters): a bad
    or differing root on one rank raises on every rank at the call, instead
    of leaving the others waiting in the broadcast. Collective."""
    return check(engine, Request(kind="broadcast", name=caller(), root=root_rank),
                 accept_joined=True).root  # dp_plugin.join refuses a broadcast


def root_of(engine: Any, root_rank: Any) -> int:
    """Horovod's rule for every rooted function: ``root_rank`` is a job-wide
    rank that must belong to the ranks ``engine`` runs (a process set, or the
    whole job); returns its rank within ``engine``. A root that is not an int
    raises ``TypeError`` at once, on this rank; one outside the set a
    ``ValueError`` (``check`` makes it a problem every rank raises for)."""
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
    return blocks[0], Agreed(_with_joined(heard.numbers, width), count, heard.joined)


def _with_joined(numbers: list[list[int]], width: int) -> list[list[int]]:
    """The table, a joined rank's (empty) numbers as zeros: it contributes
    nothing."""
    return [row or [0] * width for row in numbers]


# -- this rank's own mistakes ----------------------------------------------------------


def _local_problem(engine: Any, req: Request
                   ) -> tuple[Problem, str, list[int], tuple[int, ...], int]:
    """The first problem of this rank's request, its detail, the numbers the
    kind sends (splits, host key), the valid member list (subgroup) and the
    root as a rank of ``engine`` (broadcast; -1 when it is not one)."""
    problem, detail, root = Problem.NONE, "", -1
    if req.kind == "broadcast":
        try:
            root = root_of(engine, req.root)
        except ValueError as exc:
            problem, detail = Problem.BAD_ROOT, str(exc)
    for shape, dtype in zip(req.shapes, req.dtypes, strict=True):
        if problem:
            break
        if req.kind in REDUCING:
            try:
                canonical_dtype(dtype)
            except TypeError as exc:
                problem, detail = Problem.UNSUPPORTED_DTYPE, str(exc)
        elif req.kind != "barrier" and dtype not in MOVABLE:
            problem, detail = Problem.UNSUPPORTED_DTYPE, (
                f"dtype {dtype} cannot be moved by {req.kind}; supported dtypes: "
                f"{', '.join(sorted(MOVABLE))}. Cast the tensor (e.g. complex -> two float "
                "tensors)")
        if not problem and req.kind in _NEEDS_FIRST_DIM and not shape:
            problem, detail = Problem.ZERO_DIM, f"the {req.kind} input is 0-dim (shape ())"
    extra: list[int] = []
    members: tuple[int, ...] = ()
    if req.kind == "alltoall":
        shape = req.shapes[0]
        counts, why = as_splits(req.splits, shape[0] if shape else 0, engine.size)
        if why and not problem:
            problem, detail = Problem.BAD_SPLITS, why
        extra = counts if not problem else [0] * engine.size
    elif req.kind == "subgroup":
        members, why = as_members(req.members, engine.size)
        if why and not problem:
            problem, detail = Problem.BAD_MEMBERS, why
        # A number equal for processes on the same host.
        extra = [zlib.crc32((engine.topology.hostname or socket.gethostname()).encode())]
    return problem, detail, extra, members, root


def as_splits(splits: Any, rows: int, size: int) -> tuple[list[int], str]:
    """This rank's send counts, and why they are invalid ("" when valid).

    ``None`` divides ``rows`` evenly (an error if it does not divide, as in
    Horovod). Accepts any sequence of ints, or a 1-D numpy array / tensor.
    """
    if splits is None:
        if rows % size:
            return [0] * size, (
                f"no splits were given and the first dimension {rows} is not divisible by "
                f"{size} ranks; pass splits (rows to send to each rank) or pad the buffer")
        return [rows // size] * size, ""
    values = splits.tolist() if hasattr(splits, "tolist") else splits
    try:
        counts = list(values)
    except TypeError:
        counts = [values]
    if not all(is_int(c) for c in counts):
        return [0] * size, f"splits {counts!r} must be ints (rows to send to each rank)"
    counts = [int(c) for c in counts]
    if len(counts) != size:
        why = (f"splits {counts} has {len(counts)} entries but there are {size} ranks; pass "
               "one row count per rank, in rank order")
    elif any(c < 0 for c in counts):
        why = f"splits {counts} contains a negative row count"
    elif sum(counts) != rows:
        why = (f"splits {counts} sums to {sum(counts)} but the buffer's first dimension is "
               f"{rows}; the splits must cover every row exactly once")
    else:
        return counts, ""
    return [0] * size, why


def as_members(ranks: Any, size: int) -> tuple[tuple[int, ...], str]:
    """A subgroup's member list, and why it is invalid ("" when valid)."""
    try:
        members = tuple(ranks)
    except TypeError:
        return (), f"ranks {ranks!r} is not a sequence of ints"
    if not all(is_int(r) for r in members):
        return (), f"ranks {list(members)!r} must be ints"
    members = tuple(int(r) for r in members)
    if not members:
        return (), "ranks is empty; a process set needs at least one rank"
    if list(members) != sorted(set(members)):
        return (), f"ranks {list(members)} must be sorted and unique; pass {sorted(set(members))}"
    if members[0] < 0 or members[-1] >= size:
        return (), f"ranks {list(members)} must lie in 0..{size - 1}"
    return members, ""


# -- what the ranks compare -----------------------------------------------------------


def _describe(req: Request, index: int, problem: Problem,
              members: tuple[int, ...]) -> dict[str, Any]:
    """The fields of tensor ``index`` of ``req`` that must agree (for its kind)."""
    out: dict[str, Any] = {"kind": req.kind, "name": req.name, "problem": int(problem)}
    if req.kind == "fused":
        # Only the device *kind* is compared: 'cuda:0' on one rank and 'cuda:1'
        # on another is the normal one-GPU-per-rank layout.
        out["layout"] = [[s.name, list(s.shape), s.dtype, s.device.split(":")[0]]
                         for s in req.layout]
        out["settings"] = {k: repr(v) for k, v in sorted((req.settings or {}).items())}
    checks = _CHECKS[req.kind]
    if index < len(req.shapes):
        shape: list[Any] = list(req.shapes[index])
        if "trailing" in checks and shape:
            shape[0] = "*"  # only the first dimension may differ
        out.update(dtype=req.dtypes[index], device=req.devices[index], shape=shape)
    if req.op is not None:
        out["op"] = req.op.name.capitalize()
    if "root" in checks:
        out["root"] = req.root
    if "scales" in checks:
        out["scales"] = list(req.scales)
    if "members" in checks:
        out["members"] = list(members)
    return out


Described = dict[int, list[dict[str, Any]]]
"""``described[rank][i]``: job rank ``rank``'s description of tensor ``i``,
for the active ranks, in rank order (``_by_job_rank``)."""


def _by_job_rank(engine: Any, got: Heard, mine: list[dict[str, Any]]) -> Described:
    """Every active rank's description by its job-wide rank (what the user
    sees in the logs, whatever process set runs the collective); joined
    ranks are left out: they describe nothing and are never blamed. Where
    the digests agreed, ``mine`` stands for every active rank's."""
    return {rank: mine if got.same else got.described[r]
            for r, rank in enumerate(engine.global_ranks) if r not in got.joined}


def _raise_problems(blocks: Described, detail: str, *, every_rank: bool = False) -> None:
    """Raise the first problem a rank found in its own request, naming the job
    ranks that have it (``every_rank``: every rank of the collective has it,
    none has joined: say so rather than list them)."""
    bad = [(rank, d) for rank, block in blocks.items() for d in block if d["problem"]]
    if not bad:
        return
    first = bad[0][1]
    problem = Problem(first["problem"])
    ranks = sorted({r for r, d in bad if d["problem"] == problem})
    dtypes = sorted({d.get("dtype", "?") for _, d in bad if d["problem"] == problem})
    said = _PROBLEM_TEXT[problem].replace("{dtypes}", " / ".join(dtypes))
    roots = {rank: block[0].get("root") for rank, block in blocks.items()}
    if problem is Problem.BAD_ROOT and len(set(roots.values())) > 1:
        said += f" ({_DIFFERENT_ROOTS}: {_by_value(roots, _SHOW['root'])})"
    mine = f" On this rank: {detail}." if detail else ""
    who = "every rank" if every_rank else f"rank(s) {ranks}"
    text = (f"{first['kind']}{_named(first['name'])} cannot run: {who} {said}. "
            f"Every rank of the collective raises this error.{mine}")
    raise MismatchError.of(problem, text)


def _raise_mismatch(blocks: Described, req: Request, rank: int) -> None:
    """Raise for the first field where the ranks' requests differ (``rank``:
    this rank's job-wide rank)."""
    counts = {r: len(b) for r, b in blocks.items()}
    if len(set(counts.values())) > 1:
        raise MismatchError(
            f"Mismatched group sizes for grouped {req.kind}{_named(req.name)}: "
            + _by_value(counts, lambda n: f"passed {n} tensor(s)")
            + ". Every rank must pass the same number of tensors, in the same order"
        )
    group = next(iter(counts.values()))
    for index in range(group):
        column = {r: b[index] for r, b in blocks.items()}
        if len({d["kind"] for d in column.values()}) > 1:
            raise MismatchError(
                "Mismatched collectives: at the same point in the program "
                + _by_value({r: (d["kind"], _name_text(d)) for r, d in column.items()},
                            lambda v: f"called {v[0]} ({v[1]})")
                + ". Every rank must call the same collectives in the same order"
            )
        if len({d["name"] for d in column.values()}) > 1:
            raise MismatchError(
                f"Mismatched names for {req.kind}: "
                + _by_value({r: _name_text(d) for r, d in column.items()},
                            lambda t: f"passed {t}")
                + ". Every rank must give a collective the same name (or none)"
            )
        for check_field in _CHECKS[req.kind]:
            key = "shape" if check_field == "trailing" else check_field
            values = {r: _hashable(d.get(key)) for r, d in column.items()}
            if len(set(values.values())) > 1:
                what, fix = _FIELD_TEXT[check_field]
                raise MismatchError(
                    f"Mismatched {req.kind} {what} for {_what(req, index, group)}: "
                    + _by_value(values, _SHOW[key]) + f". {fix}"
                )
        if req.kind == "fused":
            what = str(req.name)
            text = _layout_text({r: d["layout"] for r, d in column.items()}, what, rank)
            raise MismatchError.of(Problem.LAYOUT, text or _settings_text(
                {r: d["settings"] for r, d in column.items()}, what, rank))


def _what(req: Request, index: int, group: int) -> str:
    """'g' or 'an unnamed tensor', plus its place in a group."""
    subject = "an unnamed tensor" if req.name is None else repr(req.name)
    member = f" (tensor {index} of the group of {group})" if group > 1 else ""
    return subject + member


def _name_text(d: dict[str, Any]) -> str:
    return "no name" if d["name"] is None else repr(d["name"])


def _named(name: str | None) -> str:
    return "" if name is None else f" {name!r}"


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _by_value(values: Mapping[int, Any], show: Any) -> str:
    """'rank(s) 0, 2 <show(v)>; rank(s) 1 <show(w)>' grouped by value, in rank
    order (``values``: by job rank)."""
    groups: dict[Any, list[int]] = {}
    for rank, v in values.items():
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
    "members": lambda v: f"passed ranks {list(v)}",
}

_DIFFERENT_ROOTS = "the ranks passed different root_rank values"

_FIELD_TEXT = {
    "op": ("tensor reduce ops", "Every rank must pass the same op"),
    "dtype": ("tensor types", "Every rank must pass the same dtype"),
    "device": ("tensor devices", "Every rank must pass tensors on the same kind of device"),
    "shape": ("tensor shapes", "Every rank must pass the same shape"),
    "trailing": ("tensor shapes", "Every rank must pass the same dimensions after the first "
                 "(only the first may differ)"),
    "root": ("tensor root ranks", f"{_DIFFERENT_ROOTS.capitalize()}; every rank must pass "
             "the same job-wide root_rank"),
    "scales": ("tensor scale factors", "Every rank must pass the same prescale_factor and "
               "postscale_factor"),
    "members": ("members", "Every rank must pass the same ranks"),
}


def _layout_text(layouts: Mapping[int, list[list[Any]]], what: str, rank: int) -> str | None:
    """The message for the first position where some rank's fused layout
    differs from the first rank's (None when every layout is the same);
    ``layouts`` by job rank, ``rank`` this rank's."""
    first = next(iter(layouts))
    longest = max(len(layout) for layout in layouts.values())
    for pos in range(longest):
        reference = _entry_at(layouts[first], pos)
        differing = [r for r, layout in layouts.items() if _entry_at(layout, pos) != reference]
        if not differing:
            continue
        theirs = _entry_at(layouts[differing[0]], pos)
        counts = ", ".join(f"rank {r}: {len(layout)}" for r, layout in layouts.items())
        return (
            f"rank {rank}: the {what} registered for all-reduce differ across ranks. "
            f"First difference at position {pos}: rank {first} has {_entry_text(reference)}, but "
            f"rank(s) {', '.join(map(str, differing))} have {_entry_text(theirs)} "
            f"(tensor counts: {counts}). Every rank must build the same model and "
            "register the same parameters, with the same names, shapes and dtypes, "
            "in the same order."
        )
    return None


def _settings_text(settings: Mapping[int, dict[str, str]], what: str, rank: int) -> str:
    """The message for settings that differ across ranks (layouts agree);
    ``settings`` by job rank, ``rank`` this rank's."""
    keys = sorted({k for s in settings.values() for k in s})
    for key in keys:
        values = {r: s.get(key, "<unset>") for r, s in settings.items()}
        if len(set(values.values())) > 1:
            per_rank = "; ".join(f"rank {r}: {v}" for r, v in values.items())
            return (
                f"rank {rank}: the {what} use different settings across ranks: {key} differs "
                f"({per_rank}). Every rank must use the same {key}: set the same environment "
                "variables and arguments on every rank"
            )
    # Digests differed but everything agrees: only possible if the digest
    # itself was corrupted in transit, which an engine bug would cause.
    return (
        f"rank {rank}: the {what} layout digests differ across ranks although the full "
        "layouts agree; the collective engine corrupted data (report this as a bug)"
    )


def _entry_at(layout: list[list[Any]], pos: int) -> list[Any] | None:
    return layout[pos] if pos < len(layout) else None


def _entry_text(entry: list[Any] | None) -> str:
    if entry is None:
        return "no tensor there (fewer tensors registered)"
    name, shape, dtype, device = entry
    return f"tensor {name!r} shape {tuple(shape)} {dtype} on {device}"


# -- check, then move: for callers holding plain buffers --------------------------------


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
