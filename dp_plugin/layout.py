"""First-step layout check: do all ranks reduce the same tensors, in the same order?

If one rank registered a tensor with another shape (or an extra one), its
fusion buffers would differ and the all-reduces would mismatch: a hang or,
worse, silently wrong numbers. ``check_layout`` compares a fixed-size digest
of every rank's layout with one all-gather; only on a difference does it
gather the full layouts to say which tensor differs.

Distributed contract: ``check_layout`` is a collective. Every rank calls it
at the same point; every rank then sees the same digests, so every rank
takes the same branch and, on a mismatch, every rank raises the same
``LayoutMismatchError`` — nobody is left waiting.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from dp_plugin.arrays import as_numpy, as_torch, is_torch
from dp_plugin.errors import LayoutMismatchError
from dp_plugin.fusion import TensorSpec

DIGEST_SIZE = 32


def _entries(specs: Sequence[TensorSpec]) -> list[list[Any]]:
    # Only the device *kind* is compared: 'cuda:0' on one rank and 'cuda:1'
    # on another is the normal one-GPU-per-rank layout.
    return [[s.name, list(s.shape), s.dtype, s.device.split(":")[0]] for s in specs]


def serialize_layout(specs: Sequence[TensorSpec]) -> bytes:
    """Canonical bytes of a layout (names, shapes, dtypes, device kinds, order)."""
    return json.dumps(_entries(specs), separators=(",", ":")).encode()


def layout_fingerprint(specs: Sequence[TensorSpec]) -> bytes:
    """A ``DIGEST_SIZE``-byte digest of ``serialize_layout(specs)``."""
    return hashlib.sha256(serialize_layout(specs)).digest()


def check_layout(engine: Any, specs: Sequence[TensorSpec], what: str = "gradients") -> None:
    """Raise ``LayoutMismatchError`` on every rank unless all ranks' layouts match.

    ``what`` names the tensors in the message ("the {what} registered for
    all-reduce differ across ranks") and tags the collectives' names.

    Collective (one all-gather when the layouts match, three when they differ).
    """
    if engine.size == 1:
        return
    tag = re.sub(r"[^\w.-]+", "_", what)  # collective names: no spaces or quotes
    device = control_device(specs)

    def gather(arr: np.ndarray, name: str) -> np.ndarray:
        return to_host(engine.allgather(to_device(arr, device), name=f"{tag}.{name}"))

    digest = np.frombuffer(layout_fingerprint(specs), dtype=np.uint8).copy()
    digests = gather(digest, "layout_digest").reshape(engine.size, DIGEST_SIZE)
    if (digests == digests[0]).all():
        return

    payload = np.frombuffer(serialize_layout(specs), dtype=np.uint8).copy()
    lengths = gather(np.array([payload.size], dtype=np.int64), "layout_sizes")
    blob = gather(payload, "layouts")
    layouts: list[list[list[Any]]] = []
    start = 0
    for length in lengths.tolist():
        layouts.append(json.loads(blob[start : start + length].tobytes().decode()))
        start += length
    raise LayoutMismatchError(describe_mismatch(layouts, what, engine.rank))


def describe_mismatch(layouts: list[list[list[Any]]], what: str, rank: int) -> str:
    """The message for the first position where some rank differs from rank 0."""
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
    # Digests differed but the layouts agree: only possible if the digest
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


def control_device(specs: Sequence[TensorSpec]) -> str:
    """Where the core's small control buffers (layout digests, bucket order) go.

    An engine takes buffers where the gradients live (nccl takes only CUDA
    buffers), so: the first non-CPU tensor's device, else the CPU.
    """
    return next((s.device for s in specs if s.device != "cpu"), "cpu")


def to_device(arr: np.ndarray, device: str) -> Any:
    """``arr`` itself on the CPU, else a torch copy on ``device``."""
    if device == "cpu":
        return arr
    return as_torch(arr).to(device)


def to_host(buf: Any) -> np.ndarray:
    """A numpy view (or, for a device tensor, a host copy) of a control buffer."""
    if is_torch(buf) and buf.device.type != "cpu":
        buf = buf.cpu()
    return as_numpy(buf)
