"""Checkpoints for data-parallel training: ``save_checkpoint`` / ``load_checkpoint``.

    hvd.save_checkpoint("ckpt/last.pt", model=model.state_dict(),
                        optimizer=opt.state_dict(), scheduler=sched.state_dict(), step=step)
    ...
    state = hvd.load_checkpoint("ckpt/last.pt")      # every rank, restores RNG states
    model.load_state_dict(state["model"]); opt.load_state_dict(state["optimizer"])

Both are collective: every rank calls them, at the same point.

Saving: every rank's RNG states (torch, numpy, Python ``random``) are
gathered, and rank 0 alone writes, atomically (``dp_plugin.api.atomic_file``): a
process killed during the write leaves the previous checkpoint intact. Rank
0's outcome is then broadcast, so that a checkpoint that could not be
written (a read-only or missing directory, a full disk) raises the same
``CheckpointError`` on every rank, not on rank 0 alone while the others
believe it exists.

What a save accepts, a load can read: before writing, rank 0 deserializes
the payload once as ``load_checkpoint`` will (``weights_only=True``,
tensors on the ``meta`` device: ~16 ms for 100 MB of tensors) and refuses a
value that would not load, naming it. numpy scalars and arrays of plain
dtypes (``np.float64(0.91)``, a metric kept with numpy) are allowed on both
sides (``NUMPY_SAFE_GLOBALS``): rebuilding them runs no code of the file's.

Format: ``DPCKPT`` magic and a format version, the payload's length and its
SHA-256, then the payload (``torch.save`` of the state). A truncated,
corrupted or foreign file is refused with ``CheckpointError`` naming the
problem.

Loading: rank 0 reads and verifies the file and broadcasts its bytes, and
every rank deserializes them. Why not every rank reading the file: with
node-local disks only the first host has it, and a failure (a missing or
corrupt file) would otherwise hit some ranks while the others wait in the
next collective; here every rank gets the same bytes or the same error. Then
each rank restores its own RNG states (those it saved; with a different
number of workers, rank ``r`` takes saved rank ``r % n``).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import random
import struct
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np

import torch
from dp_plugin.api import atomic_file
from dp_plugin.api.objects import first_unloadable, from_rank0
from dp_plugin.errors import DPPluginError
from dp_plugin.torch import basics
from dp_plugin.torch.functions import allgather_object

MAGIC = b"DPCKPT"
VERSION = 1
_HEADER = struct.Struct("<6sHQ32s")
"""magic, format version, payload length, payload SHA-256."""


_NP_CORE: Any = getattr(np, "_core", None) or np.core  # numpy 2 / 1

NUMPY_SAFE_GLOBALS: list[Any] = [
    np.dtype, np.ndarray,
    _NP_CORE.multiarray.scalar,
    _NP_CORE.multiarray._reconstruct,
    # The dtype classes of numbers, booleans, strings and times; never
    # object or void, whose items would be arbitrary pickled objects.
    *{type(np.dtype(code)) for code in ("?", *np.typecodes["All"]) if code not in "OV"},
]
"""Globals that rebuild numpy scalars and arrays; allowed to ``torch.load(weights_only=True)``
of a checkpoint (``torch.serialization.safe_globals``), on top of torch's own list."""


class CheckpointError(DPPluginError):
    """A checkpoint file is missing, truncated, corrupted or not a dp_plugin
    checkpoint, or a checkpoint could not be written."""


def save_checkpoint(path: str | os.PathLike[str], **state: Any) -> Path:
    """Write ``state`` (keyword arguments: state dicts, step counters, ...) to
    ``path`` atomically from rank 0, with every rank's RNG states. Collective.
    Returns the path."""
    target = Path(path)
    rngs = [rng_state()]
    if basics.is_initialized() and basics.size() > 1:
        rngs = allgather_object(rngs[0], name="dp_plugin.checkpoint.rng")
    blob = {"state": state, "rng": rngs}
    atomic_file.write_on_rank0(target, lambda: framed(serialize(blob, target)),
                               what="checkpoint", error=CheckpointError,
                               name="dp_plugin.checkpoint.saved")
    return target


@overload
def load_checkpoint(path: str | os.PathLike[str], *, map_location: Any = ...,
                    restore_rng: bool = ..., weights_only: bool = ...,
                    missing_ok: Literal[False] = ...) -> dict[str, Any]: ...
@overload
def load_checkpoint(path: str | os.PathLike[str], *, map_location: Any = ...,
                    restore_rng: bool = ..., weights_only: bool = ...,
                    missing_ok: bool) -> dict[str, Any] | None: ...
def load_checkpoint(path: str | os.PathLike[str], *, map_location: Any = "cpu",
                    restore_rng: bool = True, weights_only: bool = True,
                    missing_ok: bool = False) -> dict[str, Any] | None:
    """Read the checkpoint at ``path`` (rank 0 reads, every rank receives it),
    restore this rank's RNG states unless ``restore_rng=False`` and return
    the state passed to ``save_checkpoint``. Collective. Raises
    ``CheckpointError`` on every rank if rank 0 cannot use the file; with
    ``missing_ok=True`` a file that does not exist (on rank 0) returns None
    on every rank instead (a first start, before any checkpoint).
    ``weights_only`` is ``torch.load``'s (keep True unless the state holds
    arbitrary Python objects from a trusted source)."""
    target = Path(path)
    payload = from_rank0(
        lambda: None if missing_ok and not target.exists() else read_verified(target),
        CheckpointError, "dp_plugin.checkpoint.load")
    if payload is None:
        return None
    with torch.serialization.safe_globals(NUMPY_SAFE_GLOBALS):
        blob = torch.load(io.BytesIO(payload), map_location=map_location,
                          weights_only=weights_only)
    if restore_rng:
        rngs = blob["rng"]
        mine = basics.rank() if basics.is_initialized() else 0
        set_rng_state(rngs[mine % len(rngs)])
    state: dict[str, Any] = blob["state"]
    return state


def rng_state() -> dict[str, Any]:
    """This process's torch, numpy and Python ``random`` generator states
    (plain types and tensors, loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos),
                  int(has_gauss), float(gauss)],
        "python": _to_lists(random.getstate()),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(_to_tuples(state["python"]))


def serialize(blob: dict[str, Any], target: Path) -> bytes:
    """``torch.save`` of ``blob``, after checking that ``load_checkpoint``
    (``weights_only=True``) can read it back; ``CheckpointError`` naming the
    first value that could not be, otherwise."""
    data = _saved(blob)
    refusal = _load_refusal(data)
    if refusal is None:
        return data
    entry, reason = first_unloadable(blob["state"], lambda v: _load_refusal(_saved(v)), refusal)
    raise CheckpointError(
        f"checkpoint {str(target)!r}: {entry} could not be loaded back by "
        f"torch.load(weights_only=True), so a restart could not read this checkpoint "
        f"({reason}); nothing was written. Store it as a plain Python value (float(x), "
        "int(x), x.tolist()) or a tensor, or allow its class in every process with "
        "torch.serialization.add_safe_globals([...]) if rebuilding it runs no code you do "
        "not trust"
    )


def _saved(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _load_refusal(data: bytes) -> str | None:
    """Why ``torch.load(weights_only=True)`` refuses ``data`` (None: it loads).
    Tensors go to the ``meta`` device: the check reads no tensor bytes."""
    try:
        with torch.serialization.safe_globals(NUMPY_SAFE_GLOBALS):
            torch.load(io.BytesIO(data), map_location="meta", weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reasons = [line for line in lines if "allowlisted" in line or "Unsupported" in line]
        return (reasons or lines or [type(exc).__name__])[-1]
    return None


def framed(data: bytes) -> tuple[bytes, bytes]:
    """``data`` behind the checkpoint header: what ``read_verified`` checks."""
    return _HEADER.pack(MAGIC, VERSION, len(data), hashlib.sha256(data).digest()), data


def read_verified(path: Path) -> bytes:
    """The payload of the checkpoint at ``path``, after checking its header,
    length and checksum."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read: {exc}") from None
    if len(raw) < _HEADER.size or not raw.startswith(MAGIC):
        raise CheckpointError(
            f"{str(path)!r} is not a dp_plugin checkpoint (no {MAGIC.decode()} header); "
            "write checkpoints with dp_plugin.torch.save_checkpoint"
        )
    _, version, length, digest = _HEADER.unpack_from(raw)
    if version != VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format version {version}; this dp_plugin reads "
            f"version {VERSION}"
        )
    payload = raw[_HEADER.size:]
    if len(payload) != length:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is truncated or padded: {len(payload)} payload bytes, "
            f"the header says {length} (was the write interrupted?)"
        )
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupted: checksum mismatch")
    return payload


def _to_lists(obj: Any) -> Any:
    return [_to_lists(x) for x in obj] if isinstance(obj, tuple) else obj


def _to_tuples(obj: Any) -> Any:
    return tuple(_to_tuples(x) for x in obj) if isinstance(obj, list) else obj
