"""When the gloo engine goes hierarchical, and the layout it reads
(dp_plugin/engines/hierarchical.py); the path itself runs in real
processes in tests/multiproc/test_hierarchical.py."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from dp_plugin.config import Config
from dp_plugin.engines import hierarchical
from dp_plugin.errors import ConfigError
from dp_plugin.launch.launchers import Topology, detect


def topo(size: int, local_size: int, cross_size: int) -> Topology:
    return Topology(launcher="torchrun", rank=0, size=size, local_rank=0,
                    local_size=local_size, cross_rank=0, cross_size=cross_size)


@pytest.mark.parametrize(("env", "t", "expect"), [
    ({}, topo(4, 2, 2), hierarchical.AUTOMATIC),  # 2 hosts x 2
    ({}, topo(2, 1, 2), hierarchical.NO),         # one rank per host: nothing inside a host
    ({}, topo(4, 4, 1), hierarchical.NO),         # one host: flat shared memory
    ({}, topo(5, 3, 2), hierarchical.AUTOMATIC),  # uneven hosts: the job's layout says no
    ({"DP_PLUGIN_SHARED_MEMORY": "0"}, topo(4, 2, 2), hierarchical.NO),
    ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}, topo(4, 2, 2), hierarchical.NO),
    ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}, topo(4, 4, 1), hierarchical.FORCED),
    ({"DP_PLUGIN_HIERARCHICAL_ALLREDUCE": "0", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1"},
     topo(4, 2, 2), hierarchical.NO),             # ours wins
    ({"DP_PLUGIN_HIERARCHICAL_ALLREDUCE": "1"}, Topology.single(), hierarchical.NO),
])
def test_a_ranks_vote_follows_its_topology_and_the_switch(env: dict[str, str], t: Topology,
                                                          expect: int) -> None:
    assert hierarchical.vote(t, Config.from_env(env)) == expect


@pytest.mark.parametrize(("votes", "expect", "why"), [
    ([1, 1, 1, 1], True, ""),
    ([2, 1, 2, 1], True, ""),
    ([0, 0, 0, 0], False, ""),                   # nobody wants it: nothing to say
    ([1, 0, 1, 1], False, "rank(s) 1 do not want it"),
])
def test_the_job_decides_once_from_every_ranks_vote(votes: list[int], expect: bool,
                                                    why: str) -> None:
    grid = [[0, 0, 2], [0, 1, 2], [1, 0, 2], [1, 1, 2]]
    table = np.array([[v, *where] for v, where in zip(votes, grid, strict=True)])
    got, said = hierarchical.decide(table)
    assert (got is not None) is expect
    assert why in said and bool(said) is bool(why), said


@pytest.mark.parametrize(("env", "expect"), [
    ({"DP_PLUGIN_HIERARCHICAL_ALLREDUCE": "", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}, True),
    ({"DP_PLUGIN_HIERARCHICAL_ALLREDUCE": " ", "HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}, False),
    ({"DP_PLUGIN_HIERARCHICAL_ALLREDUCE": ""}, None),
    ({"HOROVOD_HIERARCHICAL_ALLREDUCE": ""}, None),
])
def test_an_empty_switch_counts_as_unset(env: dict[str, str], expect: bool | None) -> None:
    """``DP_PLUGIN_HIERARCHICAL_ALLREDUCE=`` (a launcher template's blank)
    used to force the flat ring, over ``HOROVOD_HIERARCHICAL_ALLREDUCE=1``."""
    assert Config.from_env(env).hierarchical_allreduce is expect


def test_a_bad_switch_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="HOROVOD_HIERARCHICAL_ALLREDUCE='maybe'"):
        Config.from_env({"HOROVOD_HIERARCHICAL_ALLREDUCE": "maybe"})
    with pytest.raises(ConfigError, match="DP_PLUGIN_SHARED_MEMORY_BUDGET"):
        Config.from_env({"DP_PLUGIN_SHARED_MEMORY_BUDGET": "-1"})
    assert Config.from_env({"DP_PLUGIN_SHARED_MEMORY_BUDGET": "16777216"}
                           ).shared_memory_budget == 16 << 20


def test_layout_of_round_robin_placement() -> None:
    # mpirun --map-by node: ranks go round the hosts in turn
    table = np.array([[0, 0, 3], [1, 0, 3], [0, 1, 3], [1, 1, 3], [0, 2, 3], [1, 2, 3]])
    layout, why = hierarchical.layout(table)
    assert layout is not None, why
    assert layout.hosts == ((0, 2, 4), (1, 3, 5))
    assert layout.host_of(3) == (1, 3, 5)
    assert layout.peer_groups() == [(0, 1), (2, 3), (4, 5)]


@pytest.mark.parametrize(("table", "why"), [
    ([[0, 0, 2], [0, 1, 2], [1, 0, 1]],
     "different numbers of ranks (ranks on its host: ranks 0, 1: 2; rank 2: 1)"),
    ([[0, 0, 2], [0, 1, 2], [0, 2, 2], [1, 0, 2]],
     "different numbers of ranks (host 0: ranks 0, 1, 2; host 1: rank 3)"),
    ([[0, 0, 2], [0, 0, 2]], "ranks 0 and 1 both say they are local rank 0 of host 0"),
    ([[0, 0, 1], [1, 0, 1]], "every host runs one rank"),
    ([[0, 0, 2], [0, 2, 2]], "host 0's local ranks are [0, 2], not 0..1"),
])
def test_layouts_that_are_not_a_grid_keep_the_flat_ring(table: list[list[int]], why: str) -> None:
    layout, said = hierarchical.layout(np.array(table))
    assert layout is None and why in said, said


# -- the job-wide choice, with hosts of unequal rank counts -----------------------------
# Every rank builds its Topology from its own launcher variables, then runs
# GlooEngine's constructor (the process group stubbed out) on a thread, with an
# exchange that, as Gloo's all-gather does, needs every rank to send the same
# kind of row at the same point: different choices on different ranks show up
# as a mismatch, not as gloo's abort.
def hosts_env(launcher: str, counts: list[int], rank: int) -> dict[str, str]:
    """The variables ``launcher`` gives rank ``rank`` of hosts running ``counts`` ranks."""
    size = sum(counts)
    host = next(h for h in range(len(counts)) if rank < sum(counts[:h + 1]))
    local, local_size = rank - sum(counts[:host]), counts[host]
    if launcher == "env":  # torchrun, one agent per host
        return {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(local_size), "GROUP_RANK": str(host),
                "GROUP_WORLD_SIZE": str(len(counts)), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500"}
    if launcher == "slurm":
        return {"SLURM_PROCID": str(rank), "SLURM_STEP_ID": "0", "SLURM_NTASKS": str(size),
                "SLURM_LOCALID": str(local), "SLURM_NODEID": str(host),
                "SLURM_STEP_NUM_NODES": str(len(counts)),
                "SLURM_STEP_TASKS_PER_NODE": ",".join(map(str, counts)),
                "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": f"node[1-{len(counts)}]"}
    # horovodrun: cross rank/size count the ranks of the same local rank, so
    # they differ between the ranks of one host when the hosts are unequal.
    peers = [h for h in range(len(counts)) if counts[h] > local]
    return {"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size), "HOROVOD_LOCAL_RANK": str(local),
            "HOROVOD_LOCAL_SIZE": str(local_size), "HOROVOD_CROSS_RANK": str(peers.index(host)),
            "HOROVOD_CROSS_SIZE": str(len(peers)), "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
            "HOROVOD_GLOO_RENDEZVOUS_PORT": "29500"}


class JobExchange:
    """``Engine.exchange_rows`` over thread-ranks that, like Gloo, fails every
    rank when they do not all send the same kind of row at the same point."""

    def __init__(self, size: int) -> None:
        self.rows: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=10.0)
        self.said: list[list[str]] = [[] for _ in range(size)]

    def for_rank(self, rank: int) -> Any:
        def exchange(row: np.ndarray, what: str) -> np.ndarray:
            self.said[rank].append(what)
            self.rows[rank] = (what, row)
            self.barrier.wait()
            rows = list(self.rows)
            self.barrier.wait()
            kinds = {(w, len(r)) for w, r in rows}
            if len(kinds) > 1:
                raise AssertionError(f"rank {rank}: the ranks exchanged different rows at the "
                                     f"same point: {[(w, len(r)) for w, r in rows]}")
            return np.stack([r for _, r in rows])

        return exchange


def gloo_engines(monkeypatch: pytest.MonkeyPatch, topologies: list[Topology],
                 configs: list[Config]) -> tuple[list[Any], JobExchange]:
    """One GlooEngine per thread-rank, made by its real constructor with
    the process group stubbed out (its ``exchange_rows`` is a ``JobExchange``)."""
    from dp_plugin.engines.base import Engine
    from dp_plugin.engines.gloo_nccl import GlooEngine
    from dp_plugin.engines.torch_dist import TorchDistEngine

    job = JobExchange(len(topologies))

    def no_group(self: Any, topology: Topology, config: Config, *, parent: Any = None,
                 group: Any = None) -> None:
        Engine.__init__(self, topology, config, parent=parent)
        self.exchange_rows = job.for_rank(topology.rank)

    monkeypatch.setattr(TorchDistEngine, "__init__", no_group)
    engines = on_ranks(len(topologies), lambda r: GlooEngine(topologies[r], configs[r]))
    return engines, job


def test_the_budget_fallback_names_the_job_rank_that_is_short(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """2 hosts x 2; job rank 3 (local rank 1 of host 1) has a 1000-byte
    budget: every rank keeps the flat ring, and every log line blames rank
    3 with its own number. It used to say, on host 0, 'rank 0: ... bytes;
    rank 1: ... bytes' (the wrong host, host-local ranks), and on host 1
    'rank 1: 1000 bytes'."""
    monkeypatch.setattr(shm, "_fallback_said", set())
    caplog.set_level("DEBUG", logger="dp_plugin")
    topologies = [detect(hosts_env("env", [2, 2], r)) for r in range(4)]
    configs = [Config(shared_memory_budget=1000 if r == 3 else None) for r in range(4)]
    engines, _ = gloo_engines(monkeypatch, topologies, configs)
    assert [e.hierarchical for e in engines] == [False] * 4
    said = [r.getMessage() for r in caplog.records if "less than the" in r.getMessage()]
    assert len(said) == 4, said  # every rank says it (one as a warning)
    for line in said:
        assert "within their budget (rank 3: 1000 bytes)" in line, line


@pytest.mark.parametrize("launcher", ["env", "slurm", "horovodrun"])
@pytest.mark.parametrize("counts", [[3, 1, 2], [2, 1]], ids=["3,1,2", "2,1"])
def test_unequal_hosts_take_the_flat_ring_on_every_rank(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, launcher: str,
        counts: list[int]) -> None:
    size = sum(counts)
    caplog.set_level("INFO", logger="dp_plugin")
    topologies = [detect(hosts_env(launcher, counts, r)) for r in range(size)]
    assert [t.launcher for t in topologies] == [launcher.replace("env", "torchrun")] * size
    engines, job = gloo_engines(monkeypatch, topologies, [Config()] * size)
    assert [e.hierarchical for e in engines] == [False] * size
    assert all(said == job.said[0] for said in job.said), job.said
    said = " ".join(r.getMessage() for r in caplog.records)
    if counts == [3, 1, 2]:  # some ranks' own variables looked like a grid: said why not
        assert ("flat Gloo ring, not the hierarchical path: the hosts run different numbers "
                "of ranks (ranks on its host: ranks 0, 1, 2: 3; rank 3: 1; ranks 4, 5: 2)") in said


# -- the pipelined all-reduce, its ranks as threads of one process ----------------------
# Each "host" of two thread-ranks has its two segments (tests/unit/test_shm.py's
# helpers); a Wire stands in for Gloo between the peers of one local rank: the
# k-th cross-host all-reduce of every member pairs up, and completes after a
# random delay, so that what is in flight at a given moment differs from rank
# to rank while the result must not.
torch = pytest.importorskip("torch")

import random  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402

from dp_plugin.engines import deadline, shm  # noqa: E402
from dp_plugin.engines.base import ReduceOp  # noqa: E402
from dp_plugin.errors import CollectiveTimeoutError, DPPluginError, LayoutMismatchError  # noqa: E402
from tests.unit.test_shm import (  # noqa: E402
    CHUNK,
    TIMEOUT_S,
    Exchange,
    on_ranks,
    outcomes_of,
    started_on_all,
)


class WireHandle:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self.event.is_set()

    def wait(self) -> None:
        if not self.event.wait(TIMEOUT_S):
            raise CollectiveTimeoutError("the wire's all-reduce did not finish")
        if self.error is not None:
            raise self.error


class Wire:
    """Cross-host all-reduces among ``members`` thread-ranks (one per host)."""

    def __init__(self, members: int, seed: int) -> None:
        self.members, self.lock, self.rng = members, threading.Lock(), random.Random(seed)
        self.fails: set[int] = set()
        """The k-th all-reduces that fail on every member (a peer host gone)."""
        self.cut_from: int | None = None
        """From the k-th all-reduce on, each fails at once on the member that
        starts it, without waiting for the others (a cut link: Gloo fails
        every operation on a pair whose connection is gone)."""
        self.parts: dict[int, list[Any]] = {}
        self.handles: dict[int, WireHandle] = {}
        self.ops: list[str] = []  # (member, name) in the order they were started
        self.standing: list[bool] = []  # per all-reduce: issued without a deadline?

    def engine(self, member: int, ranks: list[int]) -> Any:
        """Member ``member``'s end; ``ranks``: every member's job rank."""
        wire, count = self, [0]

        class Cross:
            global_ranks = tuple(ranks)
            job_rank = ranks[member]

            def allreduce_async(self, part: Any, op: ReduceOp, name: str) -> WireHandle:
                count[0] += 1
                wire.standing.append(deadline.is_standing())  # as an engine reads it
                return wire.post(member, count[0], part, op, name)

            def shutdown(self) -> None:
                pass

        return Cross()

    def post(self, member: int, k: int, part: Any, op: ReduceOp, name: str) -> WireHandle:
        with self.lock:
            self.ops.append(f"{member}: {name}")
            parts = self.parts.setdefault(k, [None] * self.members)
            handle = self.handles.setdefault(k, WireHandle())
            if self.cut_from is not None and k >= self.cut_from:
                handle.error = DPPluginError(f"cross-host all-reduce #{k} failed: Connection "
                                             "reset by peer")
                handle.event.set()
                return handle
            parts[member] = part
            if any(p is None for p in parts):
                return handle
            delay = self.rng.uniform(0, 3e-3)

        def finish() -> None:
            if k in self.fails:
                handle.error = DPPluginError(f"cross-host all-reduce #{k} failed: "
                                             "Connection reset by peer")
                handle.event.set()
                return
            total = parts[0].clone()
            shm._reduce(parts, total, op)
            for p in parts:
                p.copy_(total)
            handle.event.set()

        threading.Timer(delay, finish).start()
        return handle


@contextmanager
def pipelined(hosts: int, per_host: int, gather: bool = True, timeout_s: float = TIMEOUT_S,
              wires: list[Wire] | None = None) -> Iterator[list[Any]]:
    """``hosts x per_host`` thread-ranks (rank = host * per_host + local rank),
    each with its HierarchicalAllreduce; every one closed after the block."""
    size = hosts * per_host
    reduce_ex = [Exchange(per_host) for _ in range(hosts)]
    gather_ex = [Exchange(per_host) for _ in range(hosts)]
    wires = [Wire(hosts, seed=j) for j in range(per_host)] if wires is None else wires

    def setup(rank: int) -> Any:
        host, local = divmod(rank, per_host)
        ranks = [host * per_host + j for j in range(per_host)]
        made = [shm.connect(ex[host].for_rank(local), local, per_host, True, timeout_s,
                            chunk_bytes=CHUNK, ranks=ranks) for ex in (reduce_ex, gather_ex)]
        assert made[0] is not None and made[1] is not None
        if not gather:
            made[1].close()
        peers = [h * per_host + local for h in range(hosts)]
        cross = wires[local].engine(host, peers) if hosts > 1 else None
        return hierarchical.HierarchicalAllreduce(made[0], cross, made[1] if gather else None)

    hiers = on_ranks(size, setup)
    try:
        yield hiers
    finally:
        on_ranks(size, lambda r: hiers[r].close())


def mixed(rank: int) -> list[Any]:
    """Many tensors of mixed sizes and dtypes, integer-valued (sums exact in
    every dtype), and random float32 ones."""
    out = []
    for k, n in enumerate((1, 3, 100, 1001, 3 * CHUNK // 4 + 7, 5000)):
        for dtype in ("float32", "float64", "int64", "float16", "int8", "int32"):
            out.append((torch.arange(n) % 7 + rank + k).to(getattr(torch, dtype)))
        gen = torch.Generator().manual_seed(100 * rank + k)
        out.append(torch.randn(n, generator=gen))
    return out


@pytest.mark.parametrize("piece", [1000, 3 * CHUNK + 8])
@pytest.mark.parametrize(("hosts", "per_host", "standing"),
                         [(2, 2, False), (2, 2, True), (3, 2, False), (1, 3, False)])
def test_pipelined_pieces_of_many_tensors_match_the_sum_bitwise_equal_on_every_rank(
        monkeypatch: pytest.MonkeyPatch, piece: int, hosts: int, per_host: int,
        standing: bool) -> None:
    monkeypatch.setattr(hierarchical, "PIECE_BYTES", piece)
    size = hosts * per_host
    inputs = [mixed(r) for r in range(size)]
    bufs = [[t.clone() for t in ts] for ts in inputs]
    wires = [Wire(hosts, seed=j) for j in range(per_host)]
    with pipelined(hosts, per_host, wires=wires) as hiers:
        assert all(h.pipelined for h in hiers)

        def run(rank: int) -> None:
            with deadline.standing(standing):
                hs = [hiers[rank].allreduce_async(b, ReduceOp.SUM, f"t{k}", lambda d: None, None)
                      for k, b in enumerate(bufs[rank])]  # all in flight at once
            for h in hs:
                h.wait()

        on_ranks(size, run)
    # The cross-host steps, issued later on the transports' threads, are
    # standing exactly when the all-reduce was issued so.
    crossed = [flag for w in wires for flag in w.standing]
    assert crossed == [standing] * len(crossed) and (hosts == 1 or crossed)
    for k in range(len(inputs[0])):
        want = sum(inputs[r][k].double() for r in range(size))
        got = bufs[0][k]
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5), (k, got.dtype)
        for r in range(1, size):
            assert torch.equal(bufs[r][k], got), f"rank {r} differs from rank 0 on tensor {k}"


def test_unpipelined_fallback_gives_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hierarchical, "PIECE_BYTES", 1000)
    got = []
    for gather in (True, False):
        bufs = [[t.clone() for t in mixed(r)] for r in range(4)]
        with pipelined(2, 2, gather=gather) as hiers:
            assert [h.pipelined for h in hiers] == [gather] * 4
            on_ranks(4, lambda r, b=bufs, hs=hiers: [
                h.wait() for h in [hs[r].allreduce_async(x, ReduceOp.SUM, "t", lambda d: None,
                                                         None) for x in b[r]]])
        got.append(bufs[0])
    # The pieces are reduced in the same order as the whole: the same bytes.
    assert all(torch.equal(a, b) for a, b in zip(*got, strict=True))


def test_a_mismatch_mid_pipeline_raises_on_every_rank_and_breaks_later_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hierarchical, "PIECE_BYTES", 256)
    with pipelined(1, 2) as hiers:
        got = started_on_all(hiers, [[torch.ones(1000), torch.ones(300 if r else 301),
                                      torch.ones(500)] for r in range(2)])
    for rank, other in ((0, 1), (1, 0)):
        assert got[rank][0] is None, "the all-reduce before the mismatch completes"
        exc = got[rank][1]
        assert isinstance(exc, LayoutMismatchError), got
        text = str(exc)
        assert f"rank {rank}: gloo allreduce of 'b1' does not match what rank {other}" in text
        # Found at the first piece (256 bytes each side), not only at the last.
        mine, theirs = (300, 301) if rank else (301, 300)
        for who, n in ((rank, mine), (other, theirs)):  # b0 took operations #1-#16
            assert (f"rank {who} has operation #17: reducescatter (sum) of 64 float32 "
                    f"(elements 0.. of an all-reduce of {n})") in text, text
        assert isinstance(got[rank][2], DPPluginError), "the transport is broken after it"


def test_a_peer_that_dies_mid_pipeline_fails_every_rank_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 3 (host 1) dies while pieces are in flight: its sockets close (what
    the kernel does for a killed process). Its host peer fails naming it; the
    other host's ranks fail by their deadline; nobody hangs."""
    monkeypatch.setattr(hierarchical, "PIECE_BYTES", 256)
    with pipelined(2, 2, timeout_s=2.0) as hiers:
        def run(rank: int) -> list[Any]:
            bufs = [torch.ones(20_000) for _ in range(4)]
            hs = [hiers[rank].allreduce_async(b, ReduceOp.SUM, f"gloo allreduce of 'b{k}'",
                                              lambda d: None, None) for k, b in enumerate(bufs)]
            if rank == 3:
                time.sleep(0.05)  # mid-pipeline
                for t in (hiers[3]._transport, hiers[3]._gather):
                    for sock in t._socks.values():
                        sock.shutdown(2)
                return []
            return outcomes_of(hs)

        started = time.perf_counter()
        got = on_ranks(4, run)
        assert time.perf_counter() - started < 2.0 * 3
    assert isinstance(got[2][-1], DPPluginError)
    # Job ranks, not host-local ones: rank 2 names rank 3 (local rank 1 of its host).
    assert any(str(e).startswith("rank 2: ") and "rank 3 of this shared-memory group" in str(e)
               for e in got[2] if e), got[2]
    for rank in (0, 1):
        assert isinstance(got[rank][-1], DPPluginError), got[rank]


@pytest.mark.parametrize("gather", [False, True], ids=["unpipelined", "pipelined"])
def test_shutdown_ends_a_standing_allreduce_waiting_in_its_cross_host_step_at_once(
        gather: bool) -> None:
    """join's listener: a standing all-reduce (no deadline of its own) that
    the other host never starts. ``close()`` ends it at once, with an error
    on its handle; the unpipelined path used to wait the whole timeout in
    ``close()`` while its thread kept polling the cross-host step for ever."""
    def listen(rank: int) -> Any:
        with deadline.standing():
            return hiers[rank].allreduce_async(torch.ones(1000), ReduceOp.SUM, "listener",
                                               lambda d: None, None)

    with pipelined(2, 2, gather=gather, timeout_s=4.0) as hiers:
        handles = on_ranks(2, listen)
        time.sleep(0.3)  # host 0 is in its cross-host step, waiting for host 1
        assert not any(h.done() for h in handles)
        started = time.perf_counter()
        on_ranks(2, lambda r: hiers[r].close())
        assert time.perf_counter() - started < 1.0, "close() waited for the thread"
        for h in handles:
            with pytest.raises(DPPluginError, match="still waiting when the engine shut down"):
                h.wait()
        assert time.perf_counter() - started < 1.0, "the thread kept waiting"


@pytest.mark.parametrize("gather", [False, True], ids=["unpipelined", "pipelined"])
def test_after_a_cross_host_failure_no_stage_touches_a_buffer_whose_handle_failed(
        monkeypatch: pytest.MonkeyPatch, gather: bool) -> None:
    """Local rank 0's second cross-host all-reduce fails (its peer host's
    link gone). That all-reduce and every later one raise on every rank, and
    once a handle has raised, nothing writes into its buffer any more (the
    contract: a buffer is free once ``wait()`` returns or raises). It used
    to break only the gather stage: the reduce stage went on
    reduce-scattering later buffers in place after their handles failed."""
    monkeypatch.setattr(hierarchical, "PIECE_BYTES", 256)
    wires = [Wire(2, seed=j) for j in range(2)]
    wires[0].fails.add(2)
    timeout_s = 3.0
    with pipelined(2, 2, gather=gather, wires=wires, timeout_s=timeout_s) as hiers:
        def run(rank: int) -> list[Any]:
            bufs = [torch.full((20_000,), float(rank + 1)) for _ in range(4)]
            hs = [hiers[rank].allreduce_async(b, ReduceOp.SUM, f"b{k}", lambda d: None, None)
                  for k, b in enumerate(bufs)]
            seen = []
            for h, b in zip(hs, bufs, strict=True):
                try:
                    h.wait()
                    seen.append(None)
                except DPPluginError:
                    seen.append(b.clone())  # what it holds when its handle raised
            time.sleep(0.3)  # whatever still runs in the stages
            return [None if was is None else torch.equal(was, b)
                    for was, b in zip(seen, bufs, strict=True)]

        started = time.perf_counter()
        got = on_ranks(4, run)
        # Nobody hangs: a cross-host all-reduce this rank started and its peer
        # did not is waited for (it may still write) to its deadline at most.
        assert time.perf_counter() - started < 3 * timeout_s
    for rank, unchanged in enumerate(got):
        assert unchanged[-1] is not None, f"rank {rank}: the last all-reduce did not fail"
        assert all(u in (None, True) for u in unchanged), (
            f"rank {rank}: buffers written after their handle failed: {unchanged}")


def test_a_second_segment_over_the_budget_leaves_every_rank_unpipelined_said_once(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline's second segment counts against the budget with the
    first (the engine asks for it with this ``instead`` text)."""
    monkeypatch.setattr(shm, "_fallback_said", set())
    caplog.set_level("DEBUG", logger="dp_plugin")
    instead = "the hierarchical all-reduce runs its steps one after another, not pipelined"
    one = shm._segment_bytes(2, CHUNK)
    budget = 3 * one - 1  # both thread-ranks' first mappings are this process's: 2 held

    def setup(ex: list[Exchange]) -> list[Any]:
        return on_ranks(2, lambda r: [shm.connect(e.for_rank(r), r, 2, True, TIMEOUT_S,
                                                  chunk_bytes=CHUNK, budget_bytes=budget,
                                                  instead=instead) for e in ex])

    for _ in range(2):
        made = setup([Exchange(2), Exchange(2)])
        assert [m[0] is not None for m in made] == [True, True]
        assert [m[1] for m in made] == [None, None]
        for m in made:
            m[0].close()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and instead in warned[0], warned
    assert "DP_PLUGIN_SHARED_MEMORY_BUDGET" in warned[0]


def test_each_sub_engine_of_two_hosts_of_two_sees_its_own_topology(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """2 hosts x 2, the real GlooEngine constructor on thread-ranks: each
    host's shared-memory transport holds that host's job ranks, and each
    cross-host group (one per local rank) is one rank on each of two hosts.
    The groups' host keys used to be the ranks' votes, the same on every
    rank: every cross group saw 'local_size 2, cross_size 1'."""
    from dp_plugin.engines.gloo_nccl import GlooEngine

    made: dict[int, tuple[tuple[int, ...], Topology]] = {}

    class Cross:
        def shutdown(self) -> None:
            pass

    def record(self: Any, members: tuple[int, ...], topology: Topology | None,
               name: str) -> Any:
        if topology is None:
            return None
        made[self.rank] = (members, topology)
        return Cross()

    monkeypatch.setattr(GlooEngine, "_subgroup", record)
    topologies = [detect(hosts_env("env", [2, 2], r)) for r in range(4)]
    engines, _ = gloo_engines(monkeypatch, topologies, [Config()] * 4)
    try:
        assert [e.hierarchical for e in engines] == [True] * 4
        for rank in range(4):
            host, local = divmod(rank, 2)
            assert engines[rank]._hier._transport.ranks == (2 * host, 2 * host + 1)
            members, seen = made[rank]
            assert members == (local, local + 2)
            assert (seen.rank, seen.size, seen.local_rank, seen.local_size, seen.cross_rank,
                    seen.cross_size) == (host, 2, 0, 1, host, 2), seen
    finally:
        on_ranks(4, lambda r: engines[r]._hier.close())


def test_a_cut_cross_host_link_is_named_by_every_rank_in_dp_plugins_words(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """2 hosts x 2; the cross-host step between ranks 1 and 3 fails (their
    link is cut). Ranks 1 and 3 name each other; their host peers, which
    only see their shared-memory connection close, name the rank that cannot
    be reached too (read from the wait board), not the host peer that
    passed the failure on. It used to reach them as the cross engine's own
    message, its description nested in the all-reduce's."""
    from dp_plugin.engines.waits import WaitBoard
    from tests.unit.test_waits import DictStore

    monkeypatch.setattr(hierarchical, "PIECE_BYTES", 256)
    wires = [Wire(2, seed=j) for j in range(2)]
    wires[1].cut_from = 2
    store = DictStore()
    boards = [WaitBoard(store, r, range(4)) for r in range(4)]
    with pipelined(2, 2, wires=wires, timeout_s=5.0) as hiers:
        def run(rank: int) -> Any:
            hs = [hiers[rank].allreduce_async(torch.ones(2_000), ReduceOp.SUM,
                                              f"gloo allreduce of 'b{k}'", lambda d: None,
                                              boards[rank]) for k in range(3)]
            return next(e for e in outcomes_of(hs) if e is not None)

        errors = on_ranks(4, run)
    gone = {0: 3, 1: 3, 2: 1, 3: 1}  # the rank each one cannot reach, itself or via its peer
    for rank, exc in enumerate(errors):
        text = str(exc)
        assert text.startswith(f"rank {rank}: gloo allreduce of 'b"), text
        assert f"rank {gone[rank]} (its peer on another host, in the cross-host step" in text, text
        assert "cannot be reached" in text and "allreduce of \"" not in text, text
    for rank, peer in ((0, 1), (2, 3)):
        assert f"rank {peer} of this shared-memory group stopped, as rank {gone[rank]}" in str(
            errors[rank])
    assert "(the cross-host library said: cross-host all-reduce #2 failed: Connection reset by " \
           "peer)" in str(errors[1])
