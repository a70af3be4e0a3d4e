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
import json
import os
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
    fds = sorted(fd for fd in _open_fds() if fd != conn.fileno())
    payload = json.dumps({"argv": script_argv, "env": dict(os.environ), "cwd": os.getcwd(),
                          "fds": fds, "pid": os.getpid()}).encode()
    message = struct.pack("!I", len(payload)) + payload
    sent = conn.sendmsg([message[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                         array.array("i", fds).tobytes())])
    conn.sendall(message[sent:])
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
    while True:
        try:
            line = reader.readline().split()
            break
        except InterruptedError:
            continue
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
