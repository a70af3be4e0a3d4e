"""The shared-memory all-reduce (dp_plugin/engines/shm.py), its ranks as
threads of one process: each has its own mapping of the segment and its
own sockets, as separate processes would; a thread barrier stands in for
the engine's row exchange (`Engine._exchange`). Small chunks make every all-reduce cross
chunk boundaries. The gloo engine's use of it, in real processes, is
tested by tests/multiproc (the engine battery, the parity and fault tests).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from dp_plugin.engines import shm
from dp_plugin.engines.types import ReduceOp
from dp_plugin.errors import CollectiveTimeoutError, DPPluginError

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason="no /dev/shm here")

CHUNK = 4096
TIMEOUT_S = 10.0


class Exchange:
    """All-gathers one row per thread-rank, as ``Engine._exchange`` does."""

    def __init__(self, size: int) -> None:
        self.rows: list[np.ndarray | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=TIMEOUT_S)

    def for_rank(self, rank: int) -> Callable[[np.ndarray, str], np.ndarray]:
        def exchange(row: np.ndarray, what: str) -> np.ndarray:
            self.rows[rank] = row
            self.barrier.wait()
            table = np.stack([r for r in self.rows if r is not None])
            self.barrier.wait()  # nobody overwrites a row before all have read
            return table

        return exchange


def on_ranks(size: int, fn: Callable[[int], Any]) -> list[Any]:
    """Run ``fn(rank)`` on ``size`` threads; return the results, re-raise a failure."""
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 3)
        assert not t.is_alive(), "a rank hung"
    if errors:
        raise errors[0]
    return results


def transports(size: int, eligible: Callable[[int], bool] = lambda r: True,
               timeout_s: float = TIMEOUT_S) -> list[shm.ShmTransport | None]:
    ex = Exchange(size)
    return on_ranks(size, lambda r: shm.connect(ex.for_rank(r), r, size, eligible(r),
                                                timeout_s, chunk_bytes=CHUNK))


@contextlib.contextmanager
def connected(size: int, timeout_s: float = TIMEOUT_S) -> Iterator[list[shm.ShmTransport]]:
    """``size`` transports that all connected; every one closed after the block."""
    ts = [t for t in transports(size, timeout_s=timeout_s) if t is not None]
    try:
        assert len(ts) == size, "a rank did not connect"
        yield ts
    finally:
        for t in ts:
            t.close()


def reduce_on_all(ts: list[shm.ShmTransport], bufs: list[Any], op: ReduceOp,
                  postscale: float = 1.0) -> None:
    """Every rank all-reduces its buffer; wait for all of them."""
    handles = [t.allreduce_async(b, op, "test", lambda d: None, None, postscale)
               for t, b in zip(ts, bufs, strict=True)]
    on_ranks(len(ts), lambda r: handles[r].wait())


def our_files() -> list[str]:
    return [f for f in os.listdir(shm.SHM_DIR) if f.startswith("dp_plugin-")]


@pytest.fixture
def no_leftovers() -> Any:
    before = set(our_files())
    yield
    assert set(our_files()) <= before, "the segment or a socket file was left in /dev/shm"


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32",
                                   "int64", "int16", "int8", "uint8"])
def test_sum_matches_reference_across_chunks(size: int, dtype: str, no_leftovers: None) -> None:
    torch_dtype = getattr(torch, dtype)
    n = 3 * CHUNK + 5  # several chunks, the last a partial one, odd slices
    inputs = [(torch.arange(n) % 7 + r).to(torch_dtype) for r in range(size)]
    expected = inputs[0].clone()
    for x in inputs[1:]:
        expected += x
    bufs = [x.clone() for x in inputs]
    with connected(size) as ts:
        reduce_on_all(ts, bufs, ReduceOp.SUM)
    for b in bufs:
        assert torch.equal(b, expected), (dtype, b[:8], expected[:8])


@pytest.mark.parametrize(("op", "fn"), [(ReduceOp.MIN, np.minimum), (ReduceOp.MAX, np.maximum),
                                        (ReduceOp.PRODUCT, np.multiply)])
def test_min_max_product_and_many_in_flight(op: ReduceOp, fn: Any, no_leftovers: None) -> None:
    size = 3
    rng = np.random.default_rng(0)
    inputs = [[rng.uniform(0.5, 2.0, 1000 + 700 * k).astype(np.float32) for k in range(4)]
              for _ in range(size)]
    bufs = [[torch.from_numpy(a.copy()) for a in mine] for mine in inputs]
    with connected(size) as ts:

        def run(rank: int) -> None:
            hs = [ts[rank].allreduce_async(b, op, f"t{k}", lambda d: None, None)
                  for k, b in enumerate(bufs[rank])]
            for h in hs:
                h.wait()

        on_ranks(size, run)
    for k in range(4):
        expected = fn(fn(inputs[0][k], inputs[1][k]), inputs[2][k])
        for r in range(size):
            np.testing.assert_array_equal(bufs[r][k].numpy(), expected)


def test_one_ineligible_rank_makes_every_rank_fall_back(no_leftovers: None) -> None:
    assert transports(3, eligible=lambda r: r != 1) == [None, None, None]


def test_takes_cpu_tensors_of_reducible_dtypes_only() -> None:
    with connected(2) as (t, _):
        assert t.takes(torch.zeros(3))
        assert not t.takes(torch.zeros(3, dtype=torch.bool))
        assert not t.takes(torch.zeros(3, dtype=torch.complex64))


def test_a_rank_that_does_not_come_times_out_and_breaks_the_transport() -> None:
    broken: list[str] = []
    with connected(2, timeout_s=1.0) as (t0, _):
        start = time.perf_counter()
        handle = t0.allreduce_async(torch.ones(10), ReduceOp.SUM, "gloo allreduce of 'b'",
                                    broken.append, None)
        with pytest.raises(CollectiveTimeoutError, match="rank 0: gloo allreduce of 'b'"):
            handle.wait()
        assert time.perf_counter() - start < 5.0
        assert broken == ["gloo allreduce of 'b'"]
        # Later all-reduces fail at once: the ranks no longer agree on the order.
        later = t0.allreduce_async(torch.ones(10), ReduceOp.SUM, "next", broken.append, None)
        with pytest.raises(CollectiveTimeoutError):
            later.wait()


def test_a_peer_that_closes_fails_the_wait_at_once() -> None:
    with connected(2) as (t0, t1):
        t1.close()
        start = time.perf_counter()
        handle = t0.allreduce_async(torch.ones(10), ReduceOp.SUM, "gloo allreduce of 'b'",
                                    lambda d: None, None)
        with pytest.raises(DPPluginError, match="rank 1 of this shared-memory group"):
            handle.wait()
        assert time.perf_counter() - start < 2.0, "detected by the socket, not by the timeout"


def test_close_while_waiting_for_a_peer_returns_within_the_timeout() -> None:
    with connected(2, timeout_s=3.0) as (t0, _):
        t0.allreduce_async(torch.ones(10), ReduceOp.SUM, "pending", lambda d: None, None)
        time.sleep(0.2)  # the thread now waits in the barrier
        start = time.perf_counter()
        t0.close()
        assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("dtype", sorted(shm.SCALED_DTYPES))
def test_postscale_in_the_reduction_rounds_as_a_multiply_afterwards(dtype: str) -> None:
    """What the scheduler's average relies on to skip its own multiply."""
    size, post = 3, 1.0 / 3
    rng = np.random.default_rng(1)
    inputs = [torch.from_numpy(rng.standard_normal(2 * CHUNK + 3)).to(getattr(torch, dtype))
              for _ in range(size)]
    expected = (inputs[0] + inputs[1]) + inputs[2]
    torch.mul(expected, post, out=expected)
    bufs = [x.clone() for x in inputs]
    with connected(size) as ts:
        reduce_on_all(ts, bufs, ReduceOp.SUM, post)
    for b in bufs:
        assert torch.equal(b, expected)


@pytest.mark.parametrize(("room_kib", "size", "chunk"), [
    (24 << 20, 2, shm.CHUNK_BYTES),  # a roomy /dev/shm: the full chunk
    (64 << 10, 2, 4 << 20),          # Docker's default 64 MiB: 2 x 3 x 4 MiB fits in half
    (64 << 10, 8, 1 << 20),
    (768, 2, 64 << 10),              # the smallest chunk just fits
    (767, 2, 0),                     # not even that: Gloo's TCP
])
def test_the_chunk_shrinks_to_fit_half_of_dev_shm(monkeypatch: pytest.MonkeyPatch, room_kib: int,
                                                  size: int, chunk: int) -> None:
    class Stat:
        f_bavail, f_frsize = room_kib, 1024

    monkeypatch.setattr(shm.os, "statvfs", lambda path: Stat())
    assert shm._affordable_chunk(size, shm.CHUNK_BYTES) == chunk


def test_check_says_where_gloo_all_reduces(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "shared memory" in shm.describe(2)  # this machine's /dev/shm has room

    class Stat:
        f_bavail, f_frsize = 1, 1024

    monkeypatch.setattr(shm.os, "statvfs", lambda path: Stat())
    assert "Gloo's TCP" in shm.describe(2)


def test_a_full_dev_shm_at_creation_makes_every_rank_keep_tcp(monkeypatch: pytest.MonkeyPatch,
                                                               no_leftovers: None) -> None:
    """The segment's pages are reserved when it is made: a /dev/shm that cannot
    hold them fails setup on every rank, instead of a SIGBUS at first touch."""
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    assert transports(3) == [None, None, None]
