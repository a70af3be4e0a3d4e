"""A pre-warmed fork server: worker ranks without the start-up of a fresh interpreter.

Most of a multi-process test's time used to be each rank's start-up, not the
case it runs: ``import torch`` 1.4-2.1 s, ``import tensorflow`` 4.8-6.6 s, the
first forward/backward 1.7-2.6 s, for every rank of every launch.
This server pays that once: it imports the frameworks and dp_plugin, runs one
tiny optimizer step (never initialising an engine), then forks one child per
rank that asks. The launchers stay real: ``horovodrun`` and the harness's
``env`` launcher start :mod:`tests.multiproc.warm_client` where they would
start ``python``, and the client hands its arguments, environment, working
directory and open file descriptors to this server, which forks the rank.
Not ``mpiexec``: once every rank has called ``MPI_Finalize`` and one has
exited, MPICH's Hydra kills every rank process still running (seen here
with fresh ranks that linger 1 s after it), and with forked ranks it killed
a client still ending after its rank in about one mpirun launch of ten,
reported as a ``BAD TERMINATION``, even with the status pipe below; mpirun
launches stay fresh.

- the child takes the client's descriptors at their numbers, its environment
  (``os.environ`` replaced: C ``getenv`` sees it too), working directory and
  argv, reseeds what a fresh interpreter seeds from entropy (``random``,
  numpy's and torch's global generators), restores default signal handlers,
  and runs the script as ``__main__``, ending as the interpreter would
  (``SystemExit``, traceback and exit 1, non-daemon threads joined,
  ``atexit`` handlers, mpi4py's ``MPI_Finalize``, stdio flushed; not the
  module teardown: see ``_exit_like_python``);
- the client forwards the signals a launcher sends (SIGTERM, SIGINT, ...) to
  the child and ends as the child ended: same exit code, or killed by the same
  signal, so the launcher sees what it would have seen. The child writes its
  exit status into a pipe of the client's as its last act, so the client
  ends at once, not a reap and a message later (a launcher that ends a job
  when its first process ends sees the others end as soon as it would);
  the server's word (``signal N``) covers a rank that died;
- the child dies (SIGKILL) the moment its client dies: the server watches
  each client's connection, so a killed process tree never leaves a rank
  behind, even one stuck in a C call that holds the GIL.

The server is single-threaded (a fork from a threaded process can inherit a
held lock): one ``selectors`` loop accepts requests and reaps children,
woken by SIGCHLD through a wakeup pipe. Flavours: ``torch`` (torch and
dp_plugin's torch adapter), ``tensorflow`` (also TensorFlow, Keras and
dp_plugin's TensorFlow adapter: TF workers import both) and ``keras-torch``
(Keras 3 on the torch backend and dp_plugin's Keras adapter, never
TensorFlow: a Keras process keeps the backend it first imported, and the
workers check that TensorFlow stays out) and ``lightning`` (Lightning and
dp_plugin's strategy: ``import lightning`` alone is 5-7 s of CPU a rank).
What a fresh process
alone covers (the interpreter's own start and end, import-time side effects)
keeps a handful of fresh launches (``fresh=True`` in the harness, or
``DP_PLUGIN_TEST_FRESH=1`` for everything).

Protocol on the Unix socket, one connection per rank: the client sends one
JSON request (argv, env, cwd, its pid, the numbers of the descriptors it
passes, the one of its status pipe) with the descriptors as SCM_RIGHTS,
then reads ``pid N``; later the rank writes ``exit N`` into the status pipe,
and the server says ``exit N`` or ``signal N`` once it has reaped the rank,
each a line.
"""

from __future__ import annotations

import array
import contextlib
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import traceback
from types import TracebackType
from typing import Any

MAX_FDS = 64
"""More descriptors than any launcher hands a rank (3 stdio + MPICH's PMI_FD)."""

FLAVOURS = ("torch", "tensorflow", "keras-torch", "lightning")
_WAKE: list[int] = []
"""The SIGCHLD wakeup pipe's two ends: the server's own, closed in every child."""


_BASE_PATH = [p for p in sys.path[1:]
              if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
"""The interpreter's own sys.path entries: not the server's script directory
nor its PYTHONPATH (each rank gets its own)."""


def warm_up(flavour: str) -> None:
    """Import what a worker of ``flavour`` imports and run one tiny training
    step, so that the children start with the imports done and the first
    forward/backward's one-time costs (operator registration, allocator
    warm-up) paid. No engine is initialised and no thread is left running:
    the forks must inherit a quiet, single-threaded process."""
    import numpy  # noqa: F401
    import torch
    import torch.distributed

    import dp_plugin
    import dp_plugin.torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 0, 1]))
    loss.backward()
    optimizer.step()
    if flavour == "tensorflow":
        import keras  # noqa: F401
        import tensorflow  # noqa: F401

        import dp_plugin.tensorflow  # noqa: F401
    elif flavour == "keras-torch":
        os.environ["KERAS_BACKEND"] = "torch"  # before Keras is imported: it keeps it
        backend = importlib.import_module("keras").backend.backend()
        importlib.import_module("dp_plugin.keras")
        if backend != "torch" or "tensorflow" in sys.modules:
            raise RuntimeError(f"the keras-torch server has Keras on {backend} and TensorFlow "
                               f"{'' if 'tensorflow' in sys.modules else 'not '}imported; "
                               "expected torch, and TensorFlow not imported")
    elif flavour == "lightning":
        importlib.import_module("lightning.pytorch")
        importlib.import_module("dp_plugin.lightning")


def serve(flavour: str, path: str) -> None:
    """Warm up, listen on ``path``, print ``ready`` and fork children until
    stdin closes (the harness's end, or its death)."""
    warm_up(flavour)
    # The warm heap is shared with every fork until written: keep the
    # children's collections off it (a full collection would touch, and so
    # copy, every page of it).
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    _WAKE[:] = [wake_r, wake_w]
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "reap")
    selector.register(sys.stdin, selectors.EVENT_READ, "stop")
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "stop":
                if not sys.stdin.buffer.read1(1):
                    _stop(children)
                    return
            elif key.data == "reap":
                os.read(wake_r, 4096)
            elif key.data == "accept":
                conn, _ = listener.accept()
                try:
                    pid = _fork_rank(conn, selector)
                except Exception as exc:  # a bad request fails that client only
                    _send(conn, f"error {type(exc).__name__}: {exc}")
                    conn.close()
                    continue
                children[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
            elif isinstance(key.data, int):  # a client's connection: readable only at its end
                _client_gone(key.data, children, selector)
        _reap(children, selector)


def _fork_rank(conn: socket.socket, selector: selectors.BaseSelector) -> int:
    request, fds = _receive(conn)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            for key in list(selector.get_map().values()):
                if isinstance(key.fileobj, socket.socket) and key.fileobj is not conn:
                    key.fileobj.close()  # the listener, other ranks' clients
            selector.close()
            for fd in _WAKE:
                os.close(fd)
            code = _become_rank(conn, request, fds)
        except BaseException:
            traceback.print_exc()
            os._exit(70)  # the fork server's own failure, not the script's
        status = _exit_like_python(code)
        with contextlib.suppress(OSError):  # the client ends at once on this line
            os.write(request["status_fd"], f"exit {status}\n".encode())
        os._exit(status)
    for fd in fds:
        os.close(fd)
    _send(conn, f"pid {pid}")
    return pid


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One request: a 4-byte length, then that much JSON; the descriptors
    ride on the first message."""
    data, fds = b"", []
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        chunk, ancdata, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(MAX_FDS * 4))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received = array.array("i")
                received.frombytes(payload[: len(payload) - len(payload) % 4])
                fds.extend(received)
        if not chunk:
            raise ConnectionError("the client closed the connection mid-request")
        data += chunk
    request = json.loads(data[4:])
    if len(request["fds"]) != len(fds):
        raise ValueError(f"{len(fds)} descriptors came with a request for {request['fds']}")
    return request, fds


def _become_rank(conn: socket.socket, request: dict[str, Any], fds: list[int]) -> object:
    """In the child: take the client's identity, run its script, return its
    exit status."""
    os.setsid()
    conn.close()  # the server watches the client; the rank needs no link to it
    # Move the received descriptors out of the way of the numbers they must
    # take, then onto those numbers.
    high = [_dup_above(fd, 1000) for fd in fds]
    for fd in fds:
        os.close(fd)
    for src, dst in zip(high, request["fds"], strict=True):
        os.dup2(src, dst, inheritable=True)
        os.close(src)
    os.environ.clear()
    os.environ.update(request["env"])
    # The one variable a fresh rank would not have: the pid its launcher
    # started and knows it by (the client's), for tests that signal it.
    os.environ["DP_PLUGIN_TEST_LAUNCHED_PID"] = str(request["pid"])
    os.chdir(request["cwd"])
    # tempfile keeps the directory it first found (the warm-up asked: the
    # server's TMPDIR); a fresh rank finds its own from its environment.
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:
        tempfile.tempdir = None
    for signo in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
                  signal.SIGQUIT, signal.SIGPIPE):
        signal.signal(signo, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets it at start-up
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    _reseed()
    argv = request["argv"]
    sys.argv = list(argv)
    # sys.path as ``python script`` builds it: the script's directory, then
    # the rank's PYTHONPATH, then the interpreter's own entries.
    extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *extra, *_BASE_PATH]
    return _run_main(argv[0])


def _dup_above(fd: int, lowest: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD, lowest)


def _reseed() -> None:
    """What a fresh interpreter starts with: ``random``, numpy's global
    generator and torch's default generator seeded from entropy."""
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


def _run_main(script: str) -> object:
    """Run ``script`` as ``__main__``; what it ended with (``SystemExit``'s
    code, 1 after an uncaught exception), before the interpreter's exit."""
    import runpy

    code: object = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code  # None, a status or a message: SystemExit(code) ends alike
    except KeyboardInterrupt:
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException as exc:
        exc.__traceback__ = _script_frames(exc.__traceback__)  # the hook prints this one
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = 1
    return code


def _exit_like_python(code: object) -> int:
    """The interpreter's exit after the script, but the module teardown:
    non-daemon threads joined, ``atexit`` hooks run, then what the one
    C-level exit hook that matters here does (mpi4py's ``MPI_Finalize``, for
    a rank that used MPI as a singleton), stdio flushed; returns the exit
    status. The teardown is left
    out because it costs 4 s a rank in a fork of the warm heap (every page
    it frees is first copied; 1 s after ``gc.freeze``) against well under
    one in a fresh process: finalizers that only run at module teardown
    are the fresh canaries' to cover."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
    except SystemExit as exc:
        code = exc.code
    mpi4py = sys.modules.get("mpi4py")
    mpi = sys.modules.get("mpi4py.MPI")
    if (mpi4py is not None and mpi is not None and mpi4py.rc.finalize is not False
            and mpi.Is_initialized() and not mpi.Is_finalized()):
        mpi.Finalize()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:
        print(code, file=sys.stderr)
        status = 1
    _flush()
    return status


def _script_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the script's first frame on, as ``python script``
    prints it (without this module's and runpy's frames)."""
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")):
        tb = tb.tb_next
    return tb


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _client_gone(pid: int, children: dict[int, socket.socket],
                 selector: selectors.BaseSelector) -> None:
    """The client of rank ``pid`` ended (killed with its process tree, or by a
    launcher): the rank goes too, at once, whatever it is doing (a rank
    stuck in a C call that holds the GIL could not end itself)."""
    conn = children.pop(pid)
    selector.unregister(conn)
    conn.close()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _reap(children: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        selector.unregister(conn)
        if os.WIFSIGNALED(status):
            _send(conn, f"signal {os.WTERMSIG(status)}")
        else:
            _send(conn, f"exit {os.waitstatus_to_exitcode(status)}")
        conn.close()


def _send(conn: socket.socket, line: str) -> None:
    with contextlib.suppress(OSError):  # the client is gone; _client_gone killed its rank
        conn.sendall(line.encode() + b"\n")


def _stop(children: dict[int, socket.socket]) -> None:
    for pid in list(children):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for conn in children.values():
        conn.close()


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in FLAVOURS:
        sys.exit(f"usage: forkserver.py {{{','.join(FLAVOURS)}}} SOCKET_PATH")
    serve(sys.argv[1], sys.argv[2])
