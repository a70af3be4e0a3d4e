"""Replace a file so that a crash leaves either the old or the new one, never a torn one;
and the job's one write of a file, by rank 0, whose outcome every rank learns.

Used by the torch checkpoints / elastic commits and the TensorFlow elastic
commits alike.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path

from dp_plugin import objects, request, runtime


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
    """Rank 0 writes ``chunks()`` to ``path`` (``write_atomic``) for the whole
    job, then broadcasts its outcome (under ``name``): if it failed, every
    rank raises ``error``, with the failure's own message when it is an
    ``error`` already, else one naming the ``what`` ("checkpoint") and the
    fix. So no rank goes on believing a failed write succeeded, and none
    waits for a rank 0 that has already raised (issue 32). Collective when
    the job has several ranks; otherwise this process writes alone."""
    engine = runtime.engine() if runtime.is_initialized() else None
    problem: str | None = None
    failure: BaseException | None = None
    if engine is None or engine.rank == 0:
        try:
            write_atomic(path, chunks())
        except Exception as exc:  # every rank must hear of it, whatever it is
            failure = exc
            problem = (str(exc) if isinstance(exc, error) else
                       f"rank 0 could not write the {what} {str(path)!r} "
                       f"({type(exc).__name__}: {exc}); a previous {what} there is "
                       "unchanged. Check that its directory can be created and written by "
                       "this user on rank 0's host, and that the disk has room")
    if engine is not None and engine.size > 1:
        problem = objects.broadcast_object(engine, problem, request.agreed_root(engine, 0), name)
    if problem is not None:
        raise error(problem) from failure
