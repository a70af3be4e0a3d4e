"""Bandwidth arithmetic (nccl-tests' definitions) and the two reference links.

nccl-tests (doc/PERFORMANCE.md) defines, for an all-reduce of ``S`` bytes per
rank that took ``t`` seconds on ``n`` ranks:

- algorithm bandwidth ``algbw = S / t``;
- bus bandwidth ``busbw = algbw * 2 (n - 1) / n``: a ring all-reduce moves
  ``2 (n - 1) / n * S`` bytes over every link, so busbw is comparable with
  the hardware's link bandwidth whatever ``n``.

The references a sweep is read against are measured in the same process:
loopback TCP (one socket pair on 127.0.0.1, one direction) and memcpy (one
numpy copy). Their bandwidth is bytes moved per second.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth, bytes/s."""
    if seconds <= 0:
        raise ValueError(f"time must be positive, got {seconds!r} s")
    return nbytes / seconds


def bus_factor(n: int) -> float:
    """``2 (n - 1) / n``: all-reduce bus bytes per byte of buffer."""
    if n < 1:
        raise ValueError(f"world size must be at least 1, got {n!r}")
    return 2.0 * (n - 1) / n


def busbw(nbytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth, bytes/s (0 for one rank: nothing crosses a link)."""
    return algbw(nbytes, seconds) * bus_factor(n)


def median_time(fn: Callable[[], None], reps: int, warmup: int) -> float:
    """Median wall time of ``fn`` over ``reps`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_time(nbytes: int, reps: int, warmup: int) -> float:
    """Median time of one numpy copy of ``nbytes``."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return median_time(lambda: np.copyto(dst, src), reps, warmup)


def loopback_tcp_time(nbytes: int, reps: int, warmup: int) -> float:
    """Median time to send ``nbytes`` from one loopback socket to another.

    A thread drains the receiving end; each transfer ends when the receiver
    has every byte and says so (one byte back).
    """
    payload = np.ones(nbytes, dtype=np.uint8).data
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname()[:2])
        receiver, _ = server.accept()
    for s in (sender, receiver):  # no Nagle: the one-byte reply must not wait for an ACK
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sink = bytearray(min(nbytes, 4 << 20))
    rounds = warmup + reps

    def drain() -> None:
        for _ in range(rounds):
            left = nbytes
            while left:
                left -= receiver.recv_into(sink, min(left, len(sink)))
            receiver.sendall(b"k")

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()

    def one() -> None:
        sender.sendall(payload)
        sender.recv(1)

    try:
        return median_time(one, reps, warmup)
    finally:
        thread.join(timeout=30)
        sender.close()
        receiver.close()
