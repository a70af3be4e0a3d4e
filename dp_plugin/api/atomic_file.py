"""Replace a file so that a crash leaves either the old or the new one, never a torn one;
and the job's one write of a file, by rank 0, whose outcome every rank learns
(torch checkpoints, TensorFlow elastic commits).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path

from dp_plugin.api import objects


def write_atomic(path: Path, chunks: Iterable[bytes]) -> None:
    """Write ``chunks`` to ``path``: a temporary file in the same directory,
    fsync, rename over ``path``, fsync the directory; the temporary file is
    removed if anything fails. The file is created with mode 0666 less the
    umask (``mkstemp``'s 0600 would make it private whatever the umask says)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
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


def write_on_rank0(path: Path, chunks: Callable[[], Iterable[bytes]], *, what: str,
                   error: type[Exception], name: str) -> None:
    """Rank 0 writes ``chunks()`` to ``path`` for the whole job and every rank
    learns the outcome (``objects.from_rank0``): a failure raises ``error`` on
    every rank, naming the ``what`` ("checkpoint") and the fix."""
    objects.from_rank0(lambda: write_atomic(path, chunks()), error, name, lambda exc: (
        f"rank 0 could not write the {what} {str(path)!r} ({type(exc).__name__}: {exc}); a "
        f"previous {what} there is unchanged. Check that its directory can be created and "
        "written by this user on rank 0's host, and that the disk has room"))
