"""The engine of a horovodrun job: Horovod's engine across hosts (the per-rank
finding, the job's verdict), and the exchange that makes the choice one
answer for every rank whatever each has installed (Horovod's own rendezvous
server, ranks simulated by threads)."""

from __future__ import annotations

import itertools
import socket
import threading
import time

import pytest

import dp_plugin.engines as engines
from dp_plugin.config import Config
from dp_plugin.engines import choose_for_job, job_choice
from dp_plugin.engines import horovod_hosts as hh
from dp_plugin.engines.base import Availability
from dp_plugin.errors import EngineUnavailableError
from dp_plugin.launch.launchers import detect


def test_a_fixed_build_or_a_routable_name_is_fine() -> None:
    assert hh.local_finding(True, "node1", "127.0.0.1") == ""
    assert hh.local_finding(False, "node1", "10.0.0.5") == ""
    assert (hh.local_finding(False, "node1", "127.0.1.1")
            == "its host name 'node1' resolves to 127.0.1.1")
    assert hh.local_finding(False, "node1", "::1") == "its host name 'node1' resolves to ::1"
    assert "resolves to no address" in hh.local_finding(False, "node1", None)


def test_the_verdict_names_ranks_hosts_and_cause() -> None:
    assert hh.verdict(["", "", ""], ["a", "a", "b"]) == ""
    why = "its host name 'vm' resolves to 127.0.0.1"
    text = hh.verdict(["", "", why, why], ["a", "a", "b", "b"])
    assert "rank(s) 2, 3 on host(s) b: its host name 'vm' resolves to 127.0.0.1" in text
    assert "lacks dp_plugin's Gloo process-set fix" in text and "Connection refused" in text


def test_gloo_binds_what_the_name_resolves_to() -> None:
    assert hh.hostname_binds_to("localhost") in ("127.0.0.1", "::1")
    assert hh.hostname_binds_to("no-such-host.invalid") is None


def _horovodrun(port: int, rank: int, size: int = 3, local_size: int = 1) -> object:
    """Rank ``rank``'s topology: one host per rank, or all on one host."""
    local_rank, cross_rank = (rank, 0) if local_size == size else (0, rank)
    return detect({"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size),
                   "HOROVOD_LOCAL_RANK": str(local_rank), "HOROVOD_LOCAL_SIZE": str(local_size),
                   "HOROVOD_CROSS_RANK": str(cross_rank),
                   "HOROVOD_CROSS_SIZE": str(size // local_size),
                   "HOROVOD_HOSTNAME": f"host{cross_rank}",
                   "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                   "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port)})


def _every_rank(port: int, requested: str, monkeypatch: pytest.MonkeyPatch, *,
                fixed_on: set[int] = frozenset(), without_horovod: set[int] = frozenset(),
                picks: tuple[str, ...] = ("horovod",) * 3, gpus: bool = True,
                local_size: int = 1) -> list[object]:
    """choose_for_job on 3 ranks (threads) whose host name is loopback:
    ranks in ``fixed_on`` have the fixed build, those in ``without_horovod``
    cannot import Horovod; rank r's own ``auto`` pick is ``picks[r]``.
    Returns each rank's outcome (``(name, reason)`` or the exception)."""
    local = threading.local()

    def available(name: str, topology: object) -> Availability:
        if name == "horovod" and local.rank in without_horovod:
            return Availability(False, "Horovod is not installed (`make install` builds it)")
        return Availability(name != "nccl" or gpus, f"{name} (faked)")

    monkeypatch.setattr(engines, "availability", available)
    monkeypatch.setattr(engines, "choose_engine",
                        lambda topology: (picks[local.rank], f"rank {local.rank}'s own pick"))
    monkeypatch.setattr(hh, "has_process_set_iface_fix", lambda: local.rank in fixed_on)
    monkeypatch.setattr(hh, "hostname_binds_to", lambda name: "127.0.0.1")
    monkeypatch.setattr(socket, "gethostname", lambda: "vm")
    # One choice per rank process; the threads here share a module: the same key.
    monkeypatch.setattr(job_choice, "_rounds", itertools.repeat(0))
    outcomes: list[object] = [None] * 3
    config = Config(timeout_s=20.0)

    def rank(r: int) -> None:
        local.rank = r
        try:
            topology = _horovodrun(port, r, local_size=local_size)
            outcomes[r] = choose_for_job(requested, topology, config)  # type: ignore[arg-type]
        except Exception as exc:  # the outcome under test
            outcomes[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "the exchange hung"
    return outcomes


def test_auto_picks_gloo_on_every_rank_when_one_host_cannot_be_reached(
        kv_server: int, monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes = _every_rank(kv_server, "auto", monkeypatch, fixed_on={0, 1})
    assert [o[0] for o in outcomes] == ["gloo"] * 3, outcomes  # type: ignore[index]
    assert all("rank(s) 2 on host(s) host2" in o[1] for o in outcomes), outcomes  # type: ignore[index]


def test_auto_keeps_horovod_when_every_rank_picks_it_and_connects(
        kv_server: int, monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes = _every_rank(kv_server, "auto", monkeypatch, fixed_on={0, 1, 2})
    assert outcomes == [("horovod", "rank 0's own pick")] * 3, outcomes


def test_explicit_horovod_fails_on_every_rank_with_cause_and_fix(
        kv_server: int, monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes = _every_rank(kv_server, "horovod", monkeypatch)
    for r, outcome in enumerate(outcomes):
        assert isinstance(outcome, EngineUnavailableError), outcomes
        text = str(outcome)
        assert text.startswith(f"rank {r}: engine 'horovod' cannot run this job"), text
        assert "rank(s) 0, 1, 2 on host(s) host0, host1, host2" in text, text
        assert "dp-plugin build-horovod --force" in text and "DP_PLUGIN_ENGINE=gloo" in text


@pytest.mark.parametrize("local_size", [1, 3])
def test_explicit_horovod_with_one_rank_lacking_horovod_fails_at_once_on_every_rank(
        kv_server: int, monkeypatch: pytest.MonkeyPatch, local_size: int) -> None:
    """Rank 1 cannot import Horovod: it still takes part, and every rank gets
    the same error naming it, long before the 20 s timeout (on one host and
    across hosts)."""
    began = time.monotonic()
    outcomes = _every_rank(kv_server, "horovod", monkeypatch, fixed_on={0, 1, 2},
                           without_horovod={1}, local_size=local_size)
    assert time.monotonic() - began < 10, f"a rank waited for the others: {outcomes}"
    for r, outcome in enumerate(outcomes):
        assert isinstance(outcome, EngineUnavailableError), outcomes
        text = str(outcome)
        assert text.startswith(f"rank {r}: engine 'horovod' cannot run this job: rank(s) 1: "
                               "Horovod is not installed"), text
        assert "make install" in text and "auto" in text, text


@pytest.mark.parametrize(("gpus", "expected"), [(True, "nccl"), (False, "gloo")])
def test_auto_where_the_ranks_own_picks_differ_runs_what_every_rank_can(
        kv_server: int, monkeypatch: pytest.MonkeyPatch, gpus: bool, expected: str) -> None:
    """Rank 1 has no Horovod, so its own pick differs: every rank runs the
    same engine, nccl where every rank has GPUs, else gloo."""
    own = ("horovod", "nccl" if gpus else "gloo", "horovod")
    outcomes = _every_rank(kv_server, "auto", monkeypatch, fixed_on={0, 1, 2},
                           without_horovod={1}, picks=own, gpus=gpus)
    assert [o[0] for o in outcomes] == [expected] * 3, outcomes  # type: ignore[index]
    for outcome in outcomes:
        assert "the ranks' own picks differ (rank(s) 0, 2: horovod; rank(s) 1: " in outcome[1]  # type: ignore[index]


def test_the_choice_is_rank_0s_and_never_asks_horovod_where_it_is_not_wanted() -> None:
    """Pure ``decide``: gloo everywhere needs no Horovod finding; one host
    (no ``unreachable`` finding) keeps Horovod's engine."""
    cpu = [job_choice.Finding(host="a", pick="gloo")] * 2
    assert job_choice.decide("auto", cpu, "why") == ("gloo", "why", "")
    one_host = [job_choice.Finding(host="a", pick="horovod", nccl=True)] * 2
    assert job_choice.decide("horovod", one_host, "asked") == ("horovod", "asked", "")
    assert job_choice.decide("auto", one_host, "why") == ("horovod", "why", "")
    finding = job_choice.Finding(host="h", pick="nccl", nccl=True, horovod="x", unreachable="y")
    assert job_choice.Finding.from_text(finding.to_text()) == finding
