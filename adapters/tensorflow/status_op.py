"""A graph op that fails with the TensorFlow error code dp_plugin chose.

Inside a graph (``tf.function``, a TF1 ``Session``) each dp_plugin collective
is a ``tf.numpy_function``, and TensorFlow turns any Python exception raised
there into ``InvalidArgumentError`` (``ValueError``, ``TypeError``) or
``UnknownError``, whatever the exception's own code. Horovod's compiled ops
fail with ``FailedPreconditionError`` when ranks disagree, and scripts catch
that. So in a graph the collective's callback does not raise: it returns the
error's code and message beside its outputs, and ``DpPluginStatus``, a
kernel of a few lines (``status_op.cc``), fails the step with that code and
the message unchanged; the outputs depend on it.

The kernel is compiled on first use with the C++ compiler and TensorFlow's
own headers and flags (``tf.sysconfig``), once per TensorFlow version and
source, into ``$XDG_CACHE_HOME/dp_plugin/tf_ops`` (default ``~/.cache``);
ranks that start together build it once, under a file lock (about 10 s of
CPU). Where it cannot be built (no compiler), ``library()`` warns once and
returns None, and graph errors keep TensorFlow's own type
(``InvalidArgumentError`` / ``UnknownError``) with dp_plugin's message.

Loading a library runs its code in every rank, and its name in the cache is
predictable (a hash of public inputs). So it is loaded only from a directory
that no one but this user (or root) owns or may write, from a regular file
with the same owners and no write permission for others, opened without
following a link and loaded through that open file, so the file checked is
the file loaded. Anything else is refused with a warning naming the path,
its owner and mode and the fix, and graph errors keep TensorFlow's types.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any

import tensorflow as tf

SOURCE = Path(__file__).with_name("status_op.cc")


def _flags() -> list[str]:
    return [*tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]


def _target() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join(_flags()).encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dp_plugin"
    return cache / "tf_ops" / f"status_op-tf{tf.__version__}-{digest.hexdigest()[:16]}.so"


def _build(target: Path) -> None:
    """Compile ``SOURCE`` into ``target`` (atomically: a rename once it is whole)."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++, g++ or $CXX) on PATH")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, "-std=c++17", "-shared", "-fPIC", "-O2", "-w", str(SOURCE),
             "-o", str(built), *_flags()],
            capture_output=True, text=True, timeout=600, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr[-2000:]}")
        built.chmod(0o755)  # whatever the umask: _check refuses a file others may write
        os.replace(built, target)


class _Unsafe(Exception):
    """The cache holds a library that another user could have written."""


def _check(info: os.stat_result, path: Path, directory: bool) -> None:
    """Refuse ``path`` (its ``lstat``/``fstat`` is ``info``) unless it is a directory
    (``directory``) or a regular file owned by this user or root that no one else
    may write."""
    kind = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)
    mode = stat.S_IMODE(info.st_mode)
    if kind and info.st_uid in (os.getuid(), 0) and not mode & 0o022:
        return
    what = "a directory" if directory else "a regular file"
    raise _Unsafe(
        f"{str(path)!r} is not safe to load code from: it must be {what} owned by this user "
        f"(uid {os.getuid()}) or root that only its owner may write; it has mode {mode:o}, "
        f"owner uid {info.st_uid}{'' if kind else f', and is not {what}'}. Another user could "
        f"have planted the library. Remove {str(path)!r} (dp_plugin rebuilds the library), or "
        "set XDG_CACHE_HOME to a directory only you can write")


_LOADED: dict[Path, Any] = {}
"""Libraries this process has loaded: TensorFlow registers a library's ops
once per process, and loading it again returns a module without them."""


def _load(target: Path) -> Any:
    """Build ``target`` if it is missing, then load it after ``_check``-ing its
    directory and the open file itself (module docstring); once per process."""
    if target in _LOADED:
        return _LOADED[target]
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    _check(os.lstat(target.parent), target.parent, directory=True)
    if not target.exists():
        with open(target.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be building it
            if not target.exists():
                _build(target)
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _Unsafe(f"{str(target)!r} is a symbolic link; remove it (dp_plugin "
                          "rebuilds it)") from None
        raise
    try:
        _check(os.fstat(fd), target, directory=False)
        # dlopen the very file checked; without /proc (macOS), the path in the checked
        # directory, which only its owner can change.
        opened = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(target)
        _LOADED[target] = tf.load_op_library(opened)
        return _LOADED[target]
    finally:
        os.close(fd)


_WITHOUT = ("inside tf.function and TF1 sessions collective errors are TensorFlow's "
            "InvalidArgumentError/UnknownError instead of Horovod's "
            "FailedPreconditionError/InvalidArgumentError (same messages)")


@functools.cache
def library() -> Any | None:
    """The loaded op library (``library().dp_plugin_status``), or None (module docstring)."""
    try:
        return _load(_target())
    except _Unsafe as error:
        warnings.warn(f"dp_plugin did not load its TensorFlow status op: {error}. Without it "
                      f"{_WITHOUT}", RuntimeWarning, stacklevel=2)
    except Exception as error:  # any failure: the errors keep TensorFlow's own types
        warnings.warn(
            f"dp_plugin could not build its TensorFlow status op ({error}); {_WITHOUT}. "
            "Install a C++ compiler to get Horovod's types", RuntimeWarning, stacklevel=2)
    return None


def fail_on(code: Any, message: Any) -> Any:
    """The op that fails with ``code`` (a ``tf.errors`` code; 0: none) and ``message``."""
    lib = library()
    assert lib is not None, "status_op.fail_on: check library() first"
    return lib.dp_plugin_status(code, message)
