"""The one check that the ranks agree on a collective before its data moves.

A collective whose inputs differ between ranks (another shape, dtype, reduce
op, root, splits or name, or another collective altogether) must fail on
*every* rank with the same clear error, never leave some ranks waiting —
Horovod's coordinator gives "Mismatched allreduce tensor shapes" there.

``check`` takes this rank's ``Request`` (``dp_plugin.agree.request``): every rank
looks for its own mistakes (``_local_problem``), then all ranks run the one
agreement exchange (``dp_plugin.agree.agreement.compare``, which also carries the
numbers the collective needs from every rank). Every rank runs the same
comparison on the same descriptions, so the outcome — an ``Agreed`` to run,
or a ``MismatchError`` carrying its ``Problem`` — is the same everywhere, and
so is the message (``dp_plugin.agree.check_messages``; a problem's local detail is
added on the rank that has it, after "On this rank:").
"""

from __future__ import annotations

import socket
import zlib
from typing import Any

from dp_plugin.agree import join
from dp_plugin.agree.agreement import Heard, compare
from dp_plugin.agree.check_messages import Described, named, raise_mismatch, raise_problems
from dp_plugin.agree.edge import caller
from dp_plugin.agree.request import CHECK_TAG, CHECKS, Agreed, Request
from dp_plugin.agree.roots import root_of
from dp_plugin.errors import MismatchError, Problem
from dp_plugin.reduce.dtypes import SUPPORTED_DTYPES, canonical_dtype
from dp_plugin.validate import is_int

REDUCING = frozenset({"allreduce", "reducescatter"})
"""Kinds that add values up: their dtypes must be reducible (``dtypes.py``)."""

MOVABLE = frozenset({*SUPPORTED_DTYPES, "bool", "uint16"})
"""What the other kinds take: Horovod's dtypes (the engines move the ones
they do not reduce as raw bytes)."""

_NEEDS_FIRST_DIM = frozenset({"allgather", "alltoall", "reducescatter"})

_NEEDS_TENSORS = REDUCING | _NEEDS_FIRST_DIM
"""Kinds over a tensor list (a broadcast without a tensor checks its root alone)."""


def check(engine: Any, request: Request, *, accept_joined: bool = False) -> Agreed:
    """Compare the ranks' requests and raise, on every rank alike, if any
    rank found a problem in its own or the ranks' requests differ.

    Collective over ``engine``'s ranks: every rank calls it once per
    collective (or group of collectives), in the same order.
    ``accept_joined``: the caller's ranks may run with joined ranks (the
    torch adapter, whose ``hvd.join()`` answers); ``dp_plugin.agree.join`` then
    says which kinds run and raises ``JoinedRankError`` for the others.
    """
    if request.kind in _NEEDS_TENSORS and not request.shapes:
        raise ValueError("a collective needs at least one tensor; got an empty list")
    problem, detail, extra, members, root = _local_problem(engine, request)
    mine = [_describe(request, i, problem, members) for i in range(max(1, len(request.shapes)))]
    numbers = [shape[0] if shape else -1 for shape in request.shapes] + extra
    got = compare(engine, CHECK_TAG, mine, numbers, joined_ok=accept_joined,
                  what=f"{request.kind}{named(request.name)}")
    blocks = _by_job_rank(engine, got, mine)
    # Equal digests: every active rank described the same request, its problem
    # included, and only this rank's copy is at hand (it stands for each of them).
    raise_problems(blocks, detail, every_rank=got.same and not got.joined and engine.size > 1)
    if not got.same:
        raise_mismatch(blocks, request, engine.job_rank)
        if not got.joined:
            raise MismatchError(  # the digests differ, the descriptions do not
                "the agreement check's digests differ across ranks although the requests "
                "agree; the collective engine corrupted data (report this as a bug)"
            )
    join.admit(request.kind, request.name, [engine.global_ranks[r] for r in got.joined])
    return Agreed(join.with_joined(got.numbers, len(numbers)), len(request.shapes), got.joined,
                  members, root)


def agreed_root(engine: Any, root_rank: Any) -> int:
    """Check that every rank passed the same valid ``root_rank`` (job-wide,
    Horovod's rule: ``root_of``) and return it as a rank of ``engine``, for a
    broadcast that runs no ``check`` of its own (objects, parameters): a bad
    or differing root on one rank raises on every rank at the call, instead
    of leaving the others waiting in the broadcast. Collective."""
    return check(engine, Request(kind="broadcast", name=caller(), root=root_rank),
                 accept_joined=True).root  # dp_plugin.agree.join refuses a broadcast


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
    checks = CHECKS[req.kind]
    if index < len(req.shapes):
        shape: list[Any] = list(req.shapes[index])
        if "trailing" in checks and shape:
            shape[0] = "*"  # only the first dimension may differ
        out.update(dtype=req.dtypes[index], device=req.devices[index], shape=shape)
    if req.op is not None:
        out["op"] = req.op.name.capitalize()
    fields = {"root": req.root, "scales": list(req.scales), "members": list(members)}
    out.update((k, v) for k, v in fields.items() if k in checks)
    return out


def _by_job_rank(engine: Any, got: Heard, mine: list[dict[str, Any]]) -> Described:
    """Every active rank's description by its job-wide rank (what the user
    sees in the logs, whatever process set runs the collective); joined
    ranks are left out: they describe nothing and are never blamed. Where
    the digests agreed, ``mine`` stands for every active rank's."""
    return {rank: mine if got.same else got.described[r]
            for r, rank in enumerate(engine.global_ranks) if r not in got.joined}
