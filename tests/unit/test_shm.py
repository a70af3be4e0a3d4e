"""The shared-memory all-reduce (dp_plugin/engines/shm.py), its ranks as
threads of one process: each has its own mapping of the segment and its
own sockets, as separate processes would; a thread barrier stands in for
the engine's row exchange (`Engine.exchange_rows`). Small chunks make every all-reduce cross
chunk boundaries. The gloo engine's use of it, in real processes, is
tested by tests/multiproc (the engine battery, the parity and fault tests).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dp_plugin.engines import shm
from dp_plugin.engines.base import ReduceOp
from dp_plugin.errors import CollectiveTimeoutError, DPPluginError, LayoutMismatchError

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason="no /dev/shm here")

CHUNK = 4096
TIMEOUT_S = 10.0


class Exchange:
    """All-gathers one row per thread-rank, as ``Engine.exchange_rows`` does."""

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
               timeout_s: float = TIMEOUT_S, checked: bool = True) -> list[shm.ShmTransport | None]:
    ex = Exchange(size)
    return on_ranks(size, lambda r: shm.connect(ex.for_rank(r), r, size, eligible(r),
                                                timeout_s, chunk_bytes=CHUNK, checked=checked))


@contextlib.contextmanager
def connected(size: int, timeout_s: float = TIMEOUT_S,
              checked: bool = True) -> Iterator[list[shm.ShmTransport]]:
    """``size`` transports that all connected; every one closed after the block."""
    ts = [t for t in transports(size, timeout_s=timeout_s, checked=checked) if t is not None]
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


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32",
                                   "int64", "int16", "int8", "uint8"])
def test_sum_matches_reference_across_chunks(size: int, dtype: str) -> None:
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
def test_min_max_product_and_many_in_flight(op: ReduceOp, fn: Any) -> None:
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


def test_one_ineligible_rank_makes_every_rank_fall_back() -> None:
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


@pytest.mark.parametrize(("size_kib", "free_kib", "budget", "size", "chunk"), [
    (96 << 20, 96 << 20, None, 2, shm.CHUNK_BYTES),  # roomy: a quarter of 96 GiB
    (64 << 10, 64 << 10, None, 2, 2 << 20),   # Docker's 64 MiB: 2 x 3 x 2 MiB <= 16 MiB
    (64 << 10, 64 << 10, None, 8, 512 << 10),
    (64 << 10, 64 << 10, 64 << 20, 2, 8 << 20),  # the budget raised to all of it
    (64 << 10, 4 << 10, 64 << 20, 2, 512 << 10),  # ... but only 4 MiB free
    (64 << 10, 64 << 10, 384 << 10, 2, 64 << 10),  # the smallest chunk just fits
    (64 << 10, 64 << 10, 383 << 10, 2, 0),         # not even that: Gloo's TCP
])
def test_the_segment_stays_within_the_budget_and_the_room(
        monkeypatch: pytest.MonkeyPatch, size_kib: int, free_kib: int, budget: int | None,
        size: int, chunk: int) -> None:
    class Stat:
        f_blocks, f_bavail, f_frsize = size_kib, free_kib, 1024

    monkeypatch.setattr(shm.os, "statvfs", lambda path: Stat())
    assert shm._chunk_within(size, shm.CHUNK_BYTES, shm._allowed_bytes(budget)) == chunk


def test_segments_held_count_against_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second engine (an optimizer's channel) gets what the first left."""
    class Stat:
        f_blocks, f_bavail, f_frsize = 64 << 10, 64 << 10, 1024

    monkeypatch.setattr(shm.os, "statvfs", lambda path: Stat())
    first = shm._allowed_bytes(None)
    with connected(2):  # two thread-ranks: this process holds both mappings
        held = 2 * shm._segment_bytes(2, CHUNK)
        assert shm._allowed_bytes(None) == first - held
    assert shm._allowed_bytes(None) == first


def test_over_the_budget_every_rank_keeps_tcp_and_says_so_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(shm, "_fallback_said", set())
    caplog.set_level("DEBUG", logger="dp_plugin")
    def over_budget(ex: Exchange) -> list[Any]:
        return on_ranks(2, lambda r: shm.connect(ex.for_rank(r), r, 2, True, TIMEOUT_S,
                                                 chunk_bytes=CHUNK, budget_bytes=1000))

    assert over_budget(Exchange(2)) == [None, None]
    assert over_budget(Exchange(2)) == [None, None]
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    text = warned[0].getMessage()
    assert "Gloo's TCP" in text and "rank 0: 1000 bytes" in text
    assert "DP_PLUGIN_SHARED_MEMORY_BUDGET" in text


def test_check_says_where_gloo_all_reduces(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "shared memory" in shm.describe(2)  # this machine's /dev/shm has room

    class Stat:
        f_blocks, f_bavail, f_frsize = 1, 1, 1024

    monkeypatch.setattr(shm.os, "statvfs", lambda path: Stat())
    assert "Gloo's TCP" in shm.describe(2)


def test_a_full_dev_shm_at_creation_makes_every_rank_keep_tcp(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The segment's pages are reserved when it is made: a /dev/shm that cannot
    hold them fails setup on every rank, instead of a SIGBUS at first touch."""
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    assert transports(3) == [None, None, None]


# -- every operation says what it is --------------------------------------------------
def outcomes_of(handles: list[Any]) -> list[Any]:
    """Wait for each handle in turn: None, or the dp_plugin error it raised."""
    out: list[Any] = []
    for h in handles:
        try:
            h.wait()
            out.append(None)
        except DPPluginError as exc:
            out.append(exc)
    return out


def started_on_all(ts: list[Any], per_rank: list[list[Any]]) -> list[list[Any]]:
    """Rank r starts all-reduces of ``per_rank[r]`` in order on ``ts[r]`` (a
    transport, or anything with its ``allreduce_async``); each handle's
    outcome (None or the exception) per rank."""
    def run(rank: int) -> list[Any]:
        return outcomes_of([ts[rank].allreduce_async(b, ReduceOp.SUM,
                                                     f"gloo allreduce of 'b{k}'",
                                                     lambda d: None, None)
                            for k, b in enumerate(per_rank[rank])])

    return on_ranks(len(ts), run)


def test_different_element_counts_raise_on_every_rank_naming_both() -> None:
    with connected(2) as ts:
        got = started_on_all(ts, [[torch.ones(10)], [torch.ones(20)]])
    for rank, other in ((0, 1), (1, 0)):
        exc = got[rank][0]
        assert isinstance(exc, LayoutMismatchError), got
        text = str(exc)
        assert f"rank {rank}: gloo allreduce of 'b0' does not match what rank {other}" in text
        mine, theirs = (10, 20) if rank == 0 else (20, 10)
        assert f"rank {rank} has operation #1: allreduce (sum) of {mine} float32" in text
        assert f"rank {other} has operation #1: allreduce (sum) of {theirs} float32" in text


def test_dtypes_in_opposite_orders_raise_and_later_operations_fail_too() -> None:
    f, i = torch.ones(8), torch.ones(16, dtype=torch.int64)
    with connected(2) as ts:
        got = started_on_all(ts, [[f.clone(), i.clone()], [i.clone(), f.clone()]])
    for rank in (0, 1):
        assert isinstance(got[rank][0], LayoutMismatchError), got
        assert "8 float32" in str(got[rank][0]) and "16 int64" in str(got[rank][0])
        assert got[rank][1] is got[rank][0], "the transport is broken after a mismatch"


def test_a_different_op_or_scale_is_a_mismatch() -> None:
    with connected(2) as ts:
        hs = [ts[0].allreduce_async(torch.ones(4), ReduceOp.SUM, "a", lambda d: None, None),
              ts[1].allreduce_async(torch.ones(4), ReduceOp.MAX, "a", lambda d: None, None)]
        with pytest.raises(LayoutMismatchError, match=r"allreduce \(sum\).*allreduce \(max\)"):
            hs[0].wait()
    with connected(2) as ts:
        hs = [ts[0].allreduce_async(torch.ones(4), ReduceOp.SUM, "a", lambda d: None, None, 0.5),
              ts[1].allreduce_async(torch.ones(4), ReduceOp.SUM, "a", lambda d: None, None)]
        with pytest.raises(LayoutMismatchError, match=r"scaled by 0\.5"):
            hs[0].wait()


def test_matching_operations_pass_with_the_check_on_and_off() -> None:
    for verify in (True, False):
        bufs = [torch.full((3 * CHUNK,), float(r + 1)) for r in range(3)]
        with connected(3, checked=verify) as ts:
            reduce_on_all(ts, bufs, ReduceOp.SUM)
        assert all(torch.equal(b, torch.full((3 * CHUNK,), 6.0)) for b in bufs)


# -- reduce-scatter, cross step, all-gather (the hierarchical all-reduce's host part) ------
@pytest.mark.parametrize("n", [5, 3 * CHUNK // 4 + 7])
@pytest.mark.parametrize("dtype", ["float32", "int64", "float16"])
def test_across_reduces_scatters_calls_back_on_the_shard_and_gathers(n: int, dtype: str) -> None:
    size = 3
    inputs = [(torch.arange(n) % 11 + r).to(getattr(torch, dtype)) for r in range(size)]
    total = (inputs[0] + inputs[1]) + inputs[2]
    bufs = [x.clone() for x in inputs]
    seen: list[tuple[int, int]] = []

    def across_for(rank: int) -> Any:
        def across(part: Any) -> None:
            lo, hi = shard(rank)
            assert torch.equal(part, total[lo:hi]), "the shard holds the host's sum"
            seen.append((lo, hi))
            part.mul_(2)  # stands in for the other hosts' sum

        return across

    def before_gather(deadline: float | None) -> None:
        assert deadline is not None and deadline > time.perf_counter()

    def shard(rank: int) -> tuple[int, int]:
        return shm.shard(n, size, rank)

    def start(t: shm.ShmTransport, buf: Any, rank: int) -> shm.ShmHandle:
        # The unpipelined hierarchical all-reduce: both stages on one transport.
        handle = shm.ShmHandle("h", t.job_rank, t.timeout_s, lambda d: None, None, parts=2)
        deadline = handle.started_at + t.timeout_s
        t.stage_async("reducescatter", buf, ReduceOp.SUM, handle, deadline,
                      after=across_for(rank))
        t.stage_async("allgather", buf, ReduceOp.SUM, handle, deadline, before=before_gather)
        assert handle.description == "h"
        return handle

    with connected(size) as ts:
        hs = [start(ts[r], bufs[r], r) for r in range(size)]
        on_ranks(size, lambda r: hs[r].wait())
        # the next operation after the gather lines up too
        reduce_on_all(ts, [x.clone() for x in inputs], ReduceOp.SUM)
    assert sorted(seen) == [shard(r) for r in range(size)]
    for b in bufs:
        assert torch.equal(b, total * 2)


# -- nothing on disk, nothing left by a crash, private to the user ----------------------
def setup_until_killed(rank: int, victim: int, phase: str, signo: int, folder: Path) -> int:
    """One rank of a two-process setup (rows exchanged through files); the
    victim kills itself once it has given its row for ``phase``."""
    def exchange(row: np.ndarray, what: str) -> np.ndarray:
        path = folder / f"{what}.{rank}.npy"
        np.save(folder / f"{what}.{rank}.tmp.npy", row)
        os.replace(folder / f"{what}.{rank}.tmp.npy", path)
        if rank == victim and what == phase:
            os.kill(os.getpid(), signo)
            time.sleep(10)
        deadline = time.monotonic() + 20
        paths = [folder / f"{what}.{r}.npy" for r in range(2)]
        while not all(p.exists() for p in paths):
            if time.monotonic() > deadline:
                os._exit(3)
            time.sleep(0.005)
        return np.stack([np.load(p) for p in paths])

    shm.connect(exchange, rank, 2, True, 20.0, chunk_bytes=1 << 20)
    time.sleep(20)
    return 0


@pytest.mark.parametrize(("victim", "phase", "signo"), [
    (0, "shm listen", signal.SIGKILL),   # rank 0 has just made the segment
    (0, "shm connect", signal.SIGTERM),  # connected and mapped, not yet returned
    (1, "shm connect", signal.SIGKILL),
])
def test_a_rank_killed_during_setup_leaves_nothing(tmp_path: Path, victim: int, phase: str,
                                                   signo: int) -> None:
    before = set(os.listdir(shm.SHM_DIR))
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            try:
                setup_until_killed(rank, victim, phase, signo, tmp_path)
            finally:
                os._exit(1)
        pids.append(pid)
    try:
        _, status = os.waitpid(pids[victim], 0)
        assert os.waitstatus_to_exitcode(status) == -signo
        token = int(np.load(tmp_path / "shm setup.0.npy")[1])
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    ours = [f for f in set(os.listdir(shm.SHM_DIR)) - before if f"{token:x}" in f]
    assert ours == [], f"left in {shm.SHM_DIR}: {ours}"
    assert f"{token:x}" not in Path("/proc/net/unix").read_text(), "a socket outlived the job"


def test_setup_creates_no_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing in /dev/shm at any moment: the sockets are abstract, the segment a memfd."""
    seen: list[str] = []
    real = shm._mesh

    def mesh(*args: Any) -> None:
        seen.extend(f for f in os.listdir(shm.SHM_DIR) if f"{args[1]:x}" in f)
        real(*args)

    monkeypatch.setattr(shm, "_mesh", mesh)
    with connected(2):
        pass
    assert seen == []


def in_child(fn: Callable[[], int], timeout_s: float = 60.0) -> int:
    """Run ``fn`` in a forked child (it may crash: the test must not); its
    exit status as ``subprocess`` reports it (-N: killed by signal N)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = fn()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the child did not finish within {timeout_s} s")


def intrude(token: int, said: Any) -> int:
    """As user nobody: dial rank 0 (its old socket file or its abstract name)
    and claim to be rank 1."""
    os.setgid(65534)
    os.setuid(65534)
    names = [f"/dev/shm/dp_plugin-{token:x}-0.sock", f"\0dp_plugin-{token:x}-0"]
    end = time.monotonic() + 8
    while time.monotonic() < end:
        for name in names:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(name)
            except OSError:
                s.close()
                continue
            os.write(said, b"connected")
            s.sendall((1).to_bytes(4, "little"))  # "I am rank 1"
            time.sleep(2)
            return 0
        time.sleep(0.002)
    return 0


@pytest.mark.skipif(os.geteuid() != 0, reason="running a process as another user needs root")
def test_another_user_cannot_take_a_rank_s_place_whatever_the_umask(
        monkeypatch: pytest.MonkeyPatch) -> None:
    token = 0x2EE_D0D0_CAFE
    monkeypatch.setattr(shm.secrets, "randbits", lambda bits: token)
    said_r, said_w = os.pipe()
    os.set_blocking(said_r, False)
    intruder = threading.Thread(target=in_child, args=(lambda: intrude(token, said_w), 30.0))
    intruder.start()
    ex = Exchange(2)

    def exchange_for(rank: int) -> Any:
        inner = ex.for_rank(rank)

        def exchange(row: np.ndarray, what: str) -> np.ndarray:
            table = inner(row, what)
            if rank == 1 and what == "shm listen":
                time.sleep(1.0)  # the intruder dials first
            return table

        return exchange

    old = os.umask(0)
    try:
        ts = on_ranks(2, lambda r: shm.connect(exchange_for(r), r, 2, True, 3.0,
                                               chunk_bytes=CHUNK))
    finally:
        os.umask(old)
    out = os.read(said_r, 100).decode()
    assert "connected" in out, "the intruder never reached the socket: the test proves nothing"
    try:
        assert all(t is not None for t in ts), "setup failed"
        bufs = [torch.ones(10), torch.ones(10)]
        reduce_on_all(ts, bufs, ReduceOp.SUM)
        assert all(torch.equal(b, torch.full((10,), 2.0)) for b in bufs)
    finally:
        for t in ts:
            if t is not None:
                t.close()
        intruder.join(30)
        os.close(said_r)
        os.close(said_w)


def close_under_a_stuck_thread() -> int:
    """Both ranks' threads stall in their reduction past the close timeout,
    then go on writing into the segment."""
    gate = threading.Event()
    real = shm._reduce

    def stalled(parts: list[Any], out: Any, op: ReduceOp) -> None:
        gate.wait()
        real(parts, out, op)

    shm._reduce = stalled
    ts = [t for t in transports(2, timeout_s=0.5) if t is not None]
    for t in ts:
        t.allreduce_async(torch.ones(1 << 12), ReduceOp.SUM, "x", lambda d: None, None)
    time.sleep(0.2)
    for t in ts:
        t.close()  # the threads are still in their reduction
    gate.set()     # ... and now write into the segment
    time.sleep(0.5)
    return 0 if len(ts) == 2 else 2


def test_close_never_unmaps_under_a_running_thread() -> None:
    assert in_child(close_under_a_stuck_thread) == 0, "-11: a segfault"
