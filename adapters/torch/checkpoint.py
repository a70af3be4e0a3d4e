"""Checkpoints for data-parallel training: ``save_checkpoint`` / ``load_checkpoint``.

    hvd.save_checkpoint("ckpt/last.pt", model=model.state_dict(),
                        optimizer=opt.state_dict(), scheduler=sched.state_dict(), step=step)
    ...
    state = hvd.load_checkpoint("ckpt/last.pt")      # every rank, restores RNG states
    model.load_state_dict(state["model"]); opt.load_state_dict(state["optimizer"])

Both are collective: every rank calls them, at the same point.

Saving: every rank's RNG states (torch, numpy, Python ``random``) are
gathered, and rank 0 alone writes. It writes a temporary file in the target's
directory, fsyncs it, renames it over the target (atomic on POSIX) and fsyncs
the directory. A process killed during the write leaves the previous
checkpoint intact: the target always holds a complete checkpoint or nothing.

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

import contextlib
import hashlib
import io
import os
import random
import struct
import tempfile
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np

import torch
from dp_plugin.errors import DPPluginError
from dp_plugin.torch import basics
from dp_plugin.torch.functions import allgather_object, broadcast_object

MAGIC = b"DPCKPT"
VERSION = 1
_HEADER = struct.Struct("<6sHQ32s")
"""magic, format version, payload length, payload SHA-256."""


class CheckpointError(DPPluginError):
    """A checkpoint file is missing, truncated, corrupted or not a dp_plugin checkpoint."""


def save_checkpoint(path: str | os.PathLike[str], **state: Any) -> Path:
    """Write ``state`` (keyword arguments: state dicts, step counters, ...) to
    ``path`` atomically from rank 0, with every rank's RNG states. Collective.
    Returns the path."""
    target = Path(path)
    rngs = [rng_state()]
    if basics.is_initialized() and basics.size() > 1:
        rngs = allgather_object(rngs[0], name="dp_plugin.checkpoint.rng")
    if not basics.is_initialized() or basics.rank() == 0:
        buffer = io.BytesIO()
        torch.save({"state": state, "rng": rngs}, buffer)
        write_atomic(target, buffer.getvalue())
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
    distributed = basics.is_initialized() and basics.size() > 1
    payload: bytes | None = None
    problem: str | None = None
    if not distributed or basics.rank() == 0:
        try:
            payload = None if missing_ok and not target.exists() else read_verified(target)
        except CheckpointError as exc:
            problem = str(exc)
    if distributed:
        payload, problem = broadcast_object((payload, problem), root_rank=0,
                                            name="dp_plugin.checkpoint.load")
    if problem is not None:
        raise CheckpointError(problem)
    if payload is None:
        return None
    blob = torch.load(io.BytesIO(payload), map_location=map_location, weights_only=weights_only)
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


def set_rng_state(states: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(states["torch"])
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(_to_tuples(states["python"]))


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` with the checkpoint header to ``path``: temporary file in
    the same directory, fsync, rename over ``path``, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = _HEADER.pack(MAGIC, VERSION, len(data), hashlib.sha256(data).digest())
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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
