"""Faults in the middle of training (workers/faults.py): a rank SIGKILLed, a
rank that stalls holding its sockets, ranks that issue different
collectives, the link between two network-namespace hosts cut.

For each: every surviving rank raises a dp_plugin error within
DP_PLUGIN_TIMEOUT plus a margin after the fault, naming its rank, the
collective and what to check, its engine shuts down promptly, every process
exits non-zero, and none is left behind.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from tests.multiproc.harness import RunResult, run_workers

WORKER = Path(__file__).parent / "workers" / "faults.py"
TIMEOUT_S = 4.0
MARGIN_S = 6.0
"""Slack for a loaded 2-core machine: report collection, scheduling."""


def _times(result: RunResult, what: str) -> dict[int, float]:
    return {int(r): float(t) for r, t in
            re.findall(rf"\brank (\d+) {what} at ([0-9.]+)", result.output)}


def _errors(result: RunResult) -> dict[int, str]:
    return {int(r): m for r, m in
            re.findall(r"\brank (\d+) error at [0-9.]+: (.*)", result.output)}


def _workers_alive() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if any(part.endswith("workers/faults.py") for part in cmd):
            found.append(proc)
    return found


def _run(launcher: str, engine: str, case: str, nprocs: int = 2, **kwargs: object) -> RunResult:
    assert not _workers_alive(), "a fault worker of an earlier run is still alive"
    # Fresh: _workers_alive finds ranks by their command line, which a rank
    # forked from the harness's warm server does not have. FAULT_RELEASE:
    # the files a reporting rank makes, which end the stall case's sleep.
    with tempfile.TemporaryDirectory(prefix="dp_plugin_faults_") as tmp:
        result = run_workers(
            launcher, nprocs, WORKER, args=["--case", case],
            env={"DP_PLUGIN_ENGINE": engine, "DP_PLUGIN_TIMEOUT": str(TIMEOUT_S),
                 "FAULT_RELEASE": os.path.join(tmp, "reported"),
                 **kwargs.pop("env", {})},  # type: ignore[dict-item]
            timeout=90, check=False, fresh=True, **kwargs)  # type: ignore[arg-type]
    assert all(code != 0 for code in result.returncodes), result.output
    assert not _workers_alive(), f"processes left behind:\n{result.output}"
    return result


def _check_survivors(result: RunResult, survivors: list[int], limit: float) -> dict[int, str]:
    fault = _times(result, "FAULT")
    assert len(fault) == 1, result.output
    (start,) = fault.values()
    errors, down = _errors(result), _times(result, "shut down")
    for rank in survivors:
        assert rank in errors and rank in down, f"rank {rank} did not fail:\n{result.output}"
        assert down[rank] - start < limit, (rank, down[rank] - start, result.output)
        assert f"rank {rank}" in errors[rank], errors[rank]
    return errors


def test_killed_rank_gloo() -> None:
    result = _run("env", "gloo", "kill")
    errors = _check_survivors(result, [0], TIMEOUT_S + MARGIN_S)
    assert "allreduce" in errors[0] and "check" in errors[0], errors[0]
    assert result.returncodes[1] == -9


def test_killed_rank_mpi_ends_the_job() -> None:
    # MPICH's mpiexec ends every rank when one dies ("BAD TERMINATION").
    result = _run("mpirun", "mpi", "kill")
    assert "FAULT at" in result.output
    assert "BAD TERMINATION" in result.output or "KILLED" in result.output, result.output


@pytest.mark.parametrize(("launcher", "engine"), [("env", "gloo"), ("mpirun", "mpi")])
def test_stalled_rank(launcher: str, engine: str) -> None:
    result = _run(launcher, engine, "stall")
    errors = _check_survivors(result, [0], TIMEOUT_S + MARGIN_S)
    message = errors[0]
    assert "did not finish within 4 s" in message and "allreduce" in message, message
    # The c10d store (gloo) or MPI messages (mpi_notes.py) carry every rank's wait report.
    assert "rank 1: no note" in message, message


@pytest.mark.parametrize(("launcher", "engine"), [("env", "gloo"), ("mpirun", "mpi")])
def test_ranks_issue_different_collectives(launcher: str, engine: str) -> None:
    result = _run(launcher, engine, "mismatch")
    errors = _check_survivors(result, [0, 1], TIMEOUT_S + MARGIN_S)
    # rank 0 waits in a gradient bucket, rank 1 in the metric's check
    assert "rank 1: waiting" in errors[0] and "a different collective" in errors[0], errors[0]
    assert "dp_plugin.agree" in errors[0], errors[0]  # the check every collective starts with


def test_stalled_rank_horovod() -> None:
    result = _run("horovodrun", "horovod", "stall")
    errors = _check_survivors(result, [0], TIMEOUT_S + MARGIN_S)
    assert "did not finish within 4 s" in errors[0] and "allreduce" in errors[0], errors[0]


def _netns_problem() -> str | None:
    if not sys.platform.startswith("linux") or shutil.which("ip") is None:
        return "network namespaces need Linux and iproute2's `ip`"
    made = subprocess.run(["ip", "netns", "add", "dpft-probe"], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces (`ip netns add`: {made.stderr.strip()})"
    subprocess.run(["ip", "netns", "del", "dpft-probe"], capture_output=True)
    return None


@pytest.fixture
def two_hosts() -> object:
    """Two network namespaces joined by a veth pair (10.212.0.1 <-> .2), removed after."""
    reason = _netns_problem()
    if reason:
        pytest.skip(reason)
    tag = f"dpft{os.getpid() % 100000}"
    names, links = [f"{tag}-a", f"{tag}-b"], [f"{tag}a", f"{tag}b"]
    addrs = ["10.212.0.1", "10.212.0.2"]

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    try:
        for ns in names:
            ip("netns", "add", ns)
        ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for ns, link, addr in zip(names, links, addrs, strict=True):
            ip("link", "set", link, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", link)
            ip("-n", ns, "link", "set", link, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield list(zip(names, addrs, strict=True)), links
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_link_cut_between_two_hosts_gloo(two_hosts: tuple[list[tuple[str, str]],
                                                          list[str]]) -> None:
    hosts, links = two_hosts
    result = _run("env", "gloo", "link_down", hosts=hosts,
                  env={"FAULT_IFACE": links[1], "GLOO_SOCKET_IFNAME": ""})
    errors = _check_survivors(result, [0, 1], TIMEOUT_S + MARGIN_S)
    assert "did not finish within 4 s" in errors[0], errors[0]
