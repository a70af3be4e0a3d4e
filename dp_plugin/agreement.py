"""Cross-rank agreement: do all ranks run the same collective on the same tensors?

If one rank registered a tensor with another shape (or an extra one), or
reads another fusion threshold, compression or scale factor from its
environment, its fusion buffers would differ from the others' and the
collectives would mismatch: a hang or, worse, silently wrong numbers. Every
fused collective therefore agrees once, before its first data moves:

1. every rank all-gathers a fixed-size digest of its *layout* (names,
   shapes, dtypes, device kinds, order) and its *settings* (the values that
   decide bucket sizes and scaling);
2. only if the digests differ do the ranks gather the full descriptions, to
   say which tensor or which setting differs, and on which ranks.

``compare`` is that exchange for any JSON-able description (the tensor
collectives of the adapters describe their requests with it); ``agree`` is
it for a fused collective's layout and settings.

Distributed contract: ``agree`` is a collective. Every rank calls it at the
same point; every rank then sees the same digests, so every rank takes the
same branch and, on a difference, every rank raises the same
``LayoutMismatchError`` — nobody is left waiting.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from dp_plugin.arrays import as_numpy, as_torch, is_torch
from dp_plugin.errors import LayoutMismatchError
from dp_plugin.fusion import TensorSpec

DIGEST_SIZE = 32

Settings = Mapping[str, Any]
"""Values every rank must share (fusion threshold, compression, scales ...),
by name; compared as their ``repr``."""


def _entries(specs: Sequence[TensorSpec]) -> list[list[Any]]:
    # Only the device *kind* is compared: 'cuda:0' on one rank and 'cuda:1'
    # on another is the normal one-GPU-per-rank layout.
    return [[s.name, list(s.shape), s.dtype, s.device.split(":")[0]] for s in specs]


def _described(specs: Sequence[TensorSpec], settings: Settings | None) -> list[Any]:
    return [_entries(specs), {k: repr(v) for k, v in sorted((settings or {}).items())}]


def serialize(specs: Sequence[TensorSpec], settings: Settings | None = None) -> bytes:
    """Canonical bytes of a layout and its settings (what ``agree`` digests)."""
    return json.dumps(_described(specs, settings), separators=(",", ":")).encode()


def fingerprint(specs: Sequence[TensorSpec], settings: Settings | None = None) -> bytes:
    """A ``DIGEST_SIZE``-byte digest of ``serialize(specs, settings)``."""
    return hashlib.sha256(serialize(specs, settings)).digest()


class Compared(NamedTuple):
    """What ``compare`` found: every rank's numbers, and every rank's
    description when (and only when) the descriptions differ."""

    described: list[Any] | None
    numbers: list[list[int]]


_HEAD = 2 + DIGEST_SIZE // 8
"""Header words per rank: count of numbers, length of the description, digest."""


def compare(engine: Any, tag: str, described: Any, numbers: Sequence[int] = ()) -> Compared:
    """The one agreement exchange: do all ranks describe the same thing?

    ``described`` is this rank's JSON-able description of what it is about
    to do; ``numbers`` are per-rank integers the caller needs from every rank
    (e.g. first dimensions of an uneven all-gather), carried in the same
    message. One all-gather of ``[len(numbers), len(description), digest,
    numbers]`` per rank; only when the digests differ, a second all-gather of
    the descriptions themselves, so the caller can say who differs and how.
    Collective over ``engine``'s ranks; every rank gets the same result.
    """
    payload = json.dumps(described, separators=(",", ":")).encode()
    if engine.size == 1:
        return Compared(None, [list(numbers)])
    tag = re.sub(r"[^\w.-]+", "_", tag)  # collective names: no spaces or quotes
    device = engine.buffer_device
    digest = np.frombuffer(hashlib.sha256(payload).digest(), dtype="<i8")
    head = np.array([len(numbers), len(payload), *digest, *numbers], dtype=np.int64)
    table = to_host(engine.allgather(to_device(head, device), name=f"{tag}.agree"))
    rows: list[np.ndarray] = []
    at = 0
    while at + _HEAD <= len(table) and len(rows) < engine.size:
        rows.append(table[at:at + _HEAD + int(table[at])])
        at += len(rows[-1])
    if len(rows) != engine.size or at != len(table):
        raise LayoutMismatchError(
            f"the agreement of {tag} received {len(table)} malformed words from "
            f"{engine.size} ranks; some rank runs another version of dp_plugin"
        )
    numbers_of = [row[_HEAD:].tolist() for row in rows]
    if all((row[1:_HEAD] == rows[0][1:_HEAD]).all() for row in rows):
        return Compared(None, numbers_of)
    mine = np.frombuffer(payload, dtype=np.uint8).copy()
    blob = to_host(engine.allgather(to_device(mine, device), name=f"{tag}.detail"))
    described_of: list[Any] = []
    start = 0
    for row in rows:
        described_of.append(json.loads(blob[start:start + int(row[1])].tobytes().decode()))
        start += int(row[1])
    return Compared(described_of, numbers_of)


def agree(engine: Any, specs: Sequence[TensorSpec], what: str = "gradients",
          settings: Settings | None = None) -> None:
    """Raise ``LayoutMismatchError`` on every rank unless all ranks' layouts
    and settings match.

    ``what`` names the tensors in the message ("the {what} registered for
    all-reduce differ across ranks") and tags the collectives' names.
    Collective: one all-gather when everything matches, two otherwise.
    """
    described = compare(engine, what, _described(specs, settings)).described
    if described is None:
        return
    message = describe_mismatch([d[0] for d in described], what, engine.rank)
    if message is None:
        message = describe_settings([d[1] for d in described], what, engine.rank)
    raise LayoutMismatchError(message)


def describe_mismatch(layouts: list[list[list[Any]]], what: str, rank: int) -> str | None:
    """The message for the first position where some rank differs from rank 0
    (None when every layout is the same)."""
    longest = max(len(layout) for layout in layouts)
    for pos in range(longest):
        reference = _at(layouts[0], pos)
        differing = [r for r, layout in enumerate(layouts) if _at(layout, pos) != reference]
        if not differing:
            continue
        theirs = _at(layouts[differing[0]], pos)
        counts = ", ".join(f"rank {r}: {len(layout)}" for r, layout in enumerate(layouts))
        return (
            f"rank {rank}: the {what} registered for all-reduce differ across ranks. "
            f"First difference at position {pos}: rank 0 has {_describe(reference)}, but "
            f"rank(s) {', '.join(map(str, differing))} have {_describe(theirs)} "
            f"(tensor counts: {counts}). Every rank must build the same model and "
            "register the same parameters, with the same names, shapes and dtypes, "
            "in the same order."
        )
    return None


def describe_settings(settings: list[dict[str, str]], what: str, rank: int) -> str:
    """The message for settings that differ across ranks (layouts agree)."""
    keys = sorted({k for s in settings for k in s})
    for key in keys:
        values = [s.get(key, "<unset>") for s in settings]
        if len(set(values)) > 1:
            per_rank = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
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


def _at(layout: list[list[Any]], pos: int) -> list[Any] | None:
    return layout[pos] if pos < len(layout) else None


def _describe(entry: list[Any] | None) -> str:
    if entry is None:
        return "no tensor there (fewer tensors registered)"
    name, shape, dtype, device = entry
    return f"tensor {name!r} shape {tuple(shape)} {dtype} on {device}"


def to_device(arr: np.ndarray, device: str) -> Any:
    """``arr`` itself for the CPU, else a torch copy on ``device`` (control buffers)."""
    if device == "cpu":
        return arr
    return as_torch(arr).to(device)


def to_host(buf: Any) -> np.ndarray:
    """A numpy view (or, for a device tensor, a host copy) of a control buffer."""
    if is_torch(buf) and buf.device.type != "cpu":
        buf = buf.cpu()
    return as_numpy(buf)
