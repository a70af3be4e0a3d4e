"""scripts/cluster.py: the BERT example across network namespaces on a shaped link.

Two "hosts" on one bridge, each link shaped with tc's tbf: torchrun with
c10d rendezvous and ``--nnodes 2`` (Gloo: it must find the host's
interface itself through dp_plugin.netif, else rank 1 cannot connect), and
MPICH's mpiexec reaching host 2 through the script (MPI engine, through
the scripts/two_hosts.py front end). The namespaces must be gone
afterwards. Skipped where namespaces cannot be created (not root, or no
iproute2); the refusal itself is tested without namespaces.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc.harness import free_port, run_workers

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "scripts" / "cluster.py"
TWO_HOSTS = ROOT / "scripts" / "two_hosts.py"
TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "16",
        "--vocab-size", "500", "--global-batch", "8", "--steps", "4", "--warmup-steps", "1",
        "--log-every", "1", "--checkpoint-every", "0", "--no-progress"]


def _namespaces_unavailable() -> str | None:
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the `ip` or `tc` command (iproute2) is not installed"
    probe = f"dpc-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces (`ip netns add` says: {made.stderr.strip()})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _namespaces(prefix: str) -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith(prefix)}


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_bert_runs_across_two_shaped_hosts(launcher: str, tmp_path: Path) -> None:
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    example = [*TINY, "--output-dir", str(tmp_path)]
    if launcher == "torchrun":
        script, args = CLUSTER, ["--hosts", "2", "--ranks-per-host", "1", "--link", "1gbit",
                                 "--port", str(free_port()), "--timeout", "200", "--",
                                 str(ROOT / "examples" / "bert_pretrain.py"), *example]
    else:  # the two_hosts.py front end, which runs cluster.py --hosts 2
        script, args = TWO_HOSTS, ["--launcher", "mpirun", "--link", "1gbit",
                                   "--port", str(free_port()), "--timeout", "200", "--",
                                   *example]
    result = run_workers("env", 1, script, args=args, env={"DP_PLUGIN_TIMEOUT": "60"},
                         timeout=240)
    assert "link tbf 1gbit each way" in result.output, result.output
    assert "summary: workers 2" in result.output, result.output
    assert re.search(r"step 4 loss \d", result.output), result.output
    assert f"({launcher})" in result.output and "launchers exited with [0" in result.output
    # This run's namespaces (other runs may be making theirs meanwhile).
    made = re.search(r"(dpc-\d+-)h1 10\.", result.output)
    assert made, result.output
    assert _namespaces(made.group(1)) == set(), "namespaces were left behind"


def test_refuses_without_tc_and_names_it(tmp_path: Path) -> None:
    """No ``tc`` on PATH: exit 77 and a message saying what is missing and the
    way out, before anything is created."""
    ip = shutil.which("ip")
    if ip is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    (tmp_path / "ip").symlink_to(ip)
    env = {**os.environ, "PATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(CLUSTER), "--link", "1gbit", "--", "true"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 77, proc.stderr
    assert "`tc` command" in proc.stderr and "--link none" in proc.stderr, proc.stderr


def test_rejects_a_bad_rate() -> None:
    proc = subprocess.run([sys.executable, str(CLUSTER), "--link", "fast", "--", "true"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--link 'fast': expected a rate such as 1gbit" in proc.stderr, proc.stderr


def test_namespaces_of_a_killed_run_are_deleted_by_the_next() -> None:
    """SIGKILL leaves a run's namespaces (no handler sees it); the next run
    deletes those whose cluster.py pid is gone, and no one else's."""
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    sys.path.insert(0, str(CLUSTER.parent))
    import cluster  # the script under test

    dead = 1 << 22  # above the default pid_max: no such process
    mine = f"dpc-{os.getpid()}-h1"  # a live pid: must stay
    subprocess.run(["ip", "netns", "add", f"dpc-{dead}-h1"], check=True)
    subprocess.run(["ip", "netns", "add", mine], check=True)
    try:
        assert f"dpc-{dead}-h1" in cluster.reap_stale()
        assert _namespaces(f"dpc-{dead}-") == set()
        assert _namespaces(mine) == {mine}
    finally:
        subprocess.run(["ip", "netns", "del", mine], capture_output=True)
        subprocess.run(["ip", "netns", "del", f"dpc-{dead}-h1"], capture_output=True)
