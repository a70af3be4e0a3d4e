"""The messages of the one check (``dp_plugin.agree.check``): one table of problems,
of fields and of how each value reads, and the two raisers every rank runs on
the same descriptions, so every rank raises the same text.

A difference (``raise_mismatch``) names each value with the ranks that
passed it. A fused collective's layout and settings have their own texts
(``layout_text``, ``settings_text``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dp_plugin.agree.request import CHECKS, Request
from dp_plugin.errors import MismatchError, Problem
from dp_plugin.reduce.dtypes import SUPPORTED_DTYPES

PROBLEM_TEXT = {
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
        "passed invalid splits (one non-negative row count per rank of the process set, summing "
        "to the first dimension; without splits the first dimension must divide evenly)"
    ),
    Problem.BAD_MEMBERS: (
        "passed an invalid list of ranks (sorted, unique ints of the process set, at least one)"
    ),
}

Described = dict[int, list[dict[str, Any]]]
"""``described[rank][i]``: job rank ``rank``'s description of tensor ``i``,
for the active ranks, in rank order (``check._by_job_rank``)."""


def raise_problems(blocks: Described, detail: str, *, every_rank: bool = False) -> None:
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
    said = PROBLEM_TEXT[problem].replace("{dtypes}", " / ".join(dtypes))
    roots = {rank: block[0].get("root") for rank, block in blocks.items()}
    if problem is Problem.BAD_ROOT and len(set(roots.values())) > 1:
        said += f" ({_DIFFERENT_ROOTS}: {_by_value(roots, _SHOW['root'])})"
    mine = f" On this rank: {detail}." if detail else ""
    who = "every rank" if every_rank else f"rank(s) {ranks}"
    text = (f"{first['kind']}{named(first['name'])} cannot run: {who} {said}. "
            f"Every rank of the collective raises this error.{mine}")
    raise MismatchError.of(problem, text)


def raise_mismatch(blocks: Described, req: Request, rank: int) -> None:
    """Raise for the first field where the ranks' requests differ (``rank``:
    this rank's job-wide rank)."""
    counts = {r: len(b) for r, b in blocks.items()}
    if len(set(counts.values())) > 1:
        raise MismatchError(
            f"Mismatched group sizes for grouped {req.kind}{named(req.name)}: "
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
        for check_field in CHECKS[req.kind]:
            key = "shape" if check_field == "trailing" else check_field
            values = {r: _hashable(d.get(key)) for r, d in column.items()}
            if len(set(values.values())) > 1:
                what, fix = FIELD_TEXT[check_field]
                subject = "an unnamed tensor" if req.name is None else repr(req.name)
                member = f" (tensor {index} of the group of {group})" if group > 1 else ""
                raise MismatchError(
                    f"Mismatched {req.kind} {what} for {subject}{member}: "
                    + _by_value(values, _SHOW[key]) + f". {fix}"
                )
        if req.kind == "fused":
            what = str(req.name)
            text = layout_text({r: d["layout"] for r, d in column.items()}, what, rank)
            raise MismatchError.of(Problem.LAYOUT, text or settings_text(
                {r: d["settings"] for r, d in column.items()}, what, rank))


def _name_text(d: dict[str, Any]) -> str:
    return "no name" if d["name"] is None else repr(d["name"])


def named(name: str | None) -> str:
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

FIELD_TEXT = {
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


def layout_text(layouts: Mapping[int, list[list[Any]]], what: str, rank: int) -> str | None:
    """The message for the first position where some rank's fused layout
    differs from the first rank's (None when every layout is the same);
    ``layouts`` by job rank, ``rank`` this rank's."""
    first = next(iter(layouts))
    longest = max(len(layout) for layout in layouts.values())
    padded = {r: layout + [None] * (longest - len(layout)) for r, layout in layouts.items()}
    for pos in range(longest):
        reference = padded[first][pos]
        differing = [r for r, layout in padded.items() if layout[pos] != reference]
        if not differing:
            continue
        theirs = padded[differing[0]][pos]
        counts = ", ".join(f"rank {r}: {len(layout)}" for r, layout in layouts.items())
        return (
            f"rank {rank}: the {what} registered for all-reduce differ across ranks. "
            f"First difference at position {pos}: rank {first} has {_entry_text(reference)}, but "
            f"rank(s) {', '.join(map(str, differing))} have {_entry_text(theirs)} "
            f"(tensor counts: {counts}). Every rank must build the same model and register the "
            "same parameters, with the same names, shapes and dtypes, in the same order."
        )
    return None


def settings_text(settings: Mapping[int, dict[str, str]], what: str, rank: int) -> str:
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


def _entry_text(entry: list[Any] | None) -> str:
    if entry is None:
        return "no tensor there (fewer tensors registered)"
    name, shape, dtype, device = entry
    return f"tensor {name!r} shape {tuple(shape)} {dtype} on {device}"
