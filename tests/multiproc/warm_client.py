"""Stand-in for ``python SCRIPT ARGS...``: the rank is forked by a warm server.

Usage: ``python -S warm_client.py SOCKET SCRIPT [ARGS...]`` where a launcher
would run ``python SCRIPT [ARGS...]`` (see tests/multiproc/forkserver.py).
Standard library only, started without ``site`` (about 20 ms): it passes its
argv, environment, working directory and every open descriptor to the server,
forwards the signals a launcher sends to the forked rank, and exits as the
rank exited - the same code, or killed by the same signal.
"""

from __future__ import annotations

import array
import contextlib
import io
import json
import os
import select
import signal
import socket
import struct
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGCONT)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: warm_client.py SOCKET SCRIPT [ARGS...]")
    path, script_argv = argv[0], argv[1:]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError as exc:
        sys.exit(f"warm_client: cannot reach the fork server at {path!r}: {exc}")
    # The rank writes its exit status into this pipe just before it exits:
    # this process must end at once after its rank (mpiexec kills what still
    # runs once every rank has finalized MPI and one has exited), sooner
    # than the server can reap the rank and say so.
    status_r, status_w = os.pipe()
    fds = sorted(fd for fd in _open_fds() if fd not in (conn.fileno(), status_r))
    payload = json.dumps({"argv": script_argv, "env": dict(os.environ), "cwd": os.getcwd(),
                          "fds": fds, "pid": os.getpid(), "status_fd": status_w}).encode()
    message = struct.pack("!I", len(payload)) + payload
    sent = conn.sendmsg([message[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                         array.array("i", fds).tobytes())])
    conn.sendall(message[sent:])
    os.close(status_w)  # the rank holds the only writer: EOF when it is gone
    reader = conn.makefile("r")
    first = reader.readline().split()
    if len(first) != 2 or first[0] != "pid":
        sys.exit(f"warm_client: the fork server refused {script_argv[0]!r}: {' '.join(first)}")
    child = int(first[1])

    def forward(signo: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signo)

    for signo in FORWARDED:
        signal.signal(signo, forward)
    line = _outcome(status_r, conn, reader)
    if len(line) == 2 and line[0] == "exit":
        sys.stdout.flush()
        os._exit(int(line[1]))
    if len(line) == 2 and line[0] == "signal":
        signo = int(line[1])
        for other in FORWARDED:
            signal.signal(other, signal.SIG_DFL)
        if signo not in (signal.SIGKILL, signal.SIGSTOP):  # these have no handler to reset
            signal.signal(signo, signal.SIG_DFL)
        os.kill(os.getpid(), signo)
        signal.pause()
    sys.exit(f"warm_client: lost the fork server before {script_argv[0]!r} ended")


def _outcome(status_r: int, conn: socket.socket, reader: io.TextIOWrapper) -> list[str]:
    """``exit N`` from the rank itself (its last act), or what the server
    says once it has reaped the rank (``signal N`` when it was killed; also
    when a process the rank forked still holds the pipe open)."""
    said = b""
    while True:
        ready, _, _ = select.select([status_r, conn], [], [])
        if status_r in ready:
            chunk = os.read(status_r, 64)
            said += chunk
            if said.endswith(b"\n"):
                return said.decode().split()
            if chunk:
                continue
            if conn not in ready:  # EOF without a word: the rank died; ask the server
                return reader.readline().split()
        if conn in ready:
            return reader.readline().split()


def _open_fds() -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            os.fstat(fd)
        except OSError:
            continue  # the directory listing's own descriptor, closed by now
        fds.append(fd)
    return fds


if __name__ == "__main__":
    main(sys.argv[1:])
