"""Horovod's engine across hosts: the per-rank finding, the job's verdict, and
the exchange that makes it one answer for every rank (Horovod's own
rendezvous server, ranks simulated by threads)."""

from __future__ import annotations

import itertools
import socket
import threading

import pytest

from dp_plugin.config import Config
from dp_plugin.engines import choose_for_job
from dp_plugin.engines import horovod_hosts as hh
from dp_plugin.errors import EngineUnavailableError
from dp_plugin.launch import detect


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
    return detect({"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size),
                   "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": str(local_size),
                   "HOROVOD_CROSS_RANK": str(rank), "HOROVOD_CROSS_SIZE": str(size),
                   "HOROVOD_HOSTNAME": f"host{rank}",
                   "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                   "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port)})


def _every_rank(port: int, requested: str, fixed_on: set[int],
                monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """choose_for_job on 3 'hosts' (threads) whose host name is loopback;
    ranks in ``fixed_on`` have the fixed build. Returns each rank's outcome."""
    local = threading.local()
    monkeypatch.setattr(hh, "has_process_set_iface_fix", lambda: local.rank in fixed_on)
    monkeypatch.setattr(hh, "hostname_binds_to", lambda name: "127.0.0.1")
    monkeypatch.setattr(socket, "gethostname", lambda: "vm")
    # One check per rank process; the threads here share a module: the same key.
    monkeypatch.setattr(hh, "_checks", itertools.repeat(0))
    outcomes: list[object] = [None] * 3
    config = Config(timeout_s=20.0)

    def rank(r: int) -> None:
        local.rank = r
        try:
            outcomes[r] = choose_for_job(requested, _horovodrun(port, r), config)  # type: ignore[arg-type]
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
    pytest.importorskip("horovod.torch")
    outcomes = _every_rank(kv_server, "auto", fixed_on={0, 1}, monkeypatch=monkeypatch)
    assert [o[0] for o in outcomes] == ["gloo"] * 3, outcomes  # type: ignore[index]
    assert all("rank(s) 2 on host(s) host2" in o[1] for o in outcomes), outcomes  # type: ignore[index]


def test_auto_keeps_horovod_when_every_build_is_fixed(
        kv_server: int, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("horovod.torch")
    outcomes = _every_rank(kv_server, "auto", fixed_on={0, 1, 2}, monkeypatch=monkeypatch)
    assert [o[0] for o in outcomes] == ["horovod"] * 3, outcomes  # type: ignore[index]


def test_explicit_horovod_fails_on_every_rank_with_cause_and_fix(
        kv_server: int, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("horovod.torch")
    outcomes = _every_rank(kv_server, "horovod", fixed_on=set(), monkeypatch=monkeypatch)
    for r, outcome in enumerate(outcomes):
        assert isinstance(outcome, EngineUnavailableError), outcomes
        text = str(outcome)
        assert text.startswith(f"rank {r}: engine 'horovod' cannot run this job"), text
        assert "rank(s) 0, 1, 2 on host(s) host0, host1, host2" in text, text
        assert "dp-plugin build-horovod --force" in text and "DP_PLUGIN_ENGINE=gloo" in text


def test_one_host_needs_no_exchange() -> None:
    """All ranks on one host: loopback reaches everyone; no server is asked."""
    topo = _horovodrun(1, 0, size=2, local_size=2)  # port 1: nothing listens there
    assert hh.job_problem(topo, Config(timeout_s=1.0)) == ""  # type: ignore[arg-type]
