"""A graph op that fails with the TensorFlow error code dp_plugin chose (issue 36).

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
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
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
        os.replace(built, target)


@functools.cache
def library() -> Any | None:
    """The loaded op library (``library().dp_plugin_status``), or None (module docstring)."""
    try:
        target = _target()
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be building it
                if not target.exists():
                    _build(target)
        return tf.load_op_library(str(target))
    except Exception as error:  # any failure: the errors keep TensorFlow's own types
        warnings.warn(
            f"dp_plugin could not build its TensorFlow status op ({error}); inside "
            "tf.function and TF1 sessions collective errors are TensorFlow's "
            "InvalidArgumentError/UnknownError instead of Horovod's "
            "FailedPreconditionError/InvalidArgumentError (same messages). Install a C++ "
            "compiler to get Horovod's types", RuntimeWarning, stacklevel=2)
        return None


def fail_on(code: Any, message: Any) -> Any:
    """The op that fails with ``code`` (a ``tf.errors`` code; 0: none) and ``message``."""
    lib = library()
    assert lib is not None, "status_op.fail_on: check library() first"
    return lib.dp_plugin_status(code, message)
