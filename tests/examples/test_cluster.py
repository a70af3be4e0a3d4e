"""scripts/cluster.py: the BERT example across network namespaces on a shaped link.

Two "hosts" on one bridge, each link shaped with tc's tbf: torchrun with
c10d rendezvous and ``--nnodes 2`` (Gloo: it must find the host's
interface itself through dp_plugin.launch.netif, else rank 1 cannot connect), and
MPICH's mpiexec reaching host 2 through the script (MPI engine, through
the scripts/two_hosts.py front end), and horovodrun by host names through
the cluster's ssh stand-in (the BERT job at 2 hosts x 2 ranks with
the default and the horovod engine; Horovod's process-set interface fix where
the host name resolves to loopback; dp_plugin's one verdict for the job when
Horovod lacks it). The namespaces and their hosts files must be gone
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
                                 "--port", str(free_port()), "--timeout", "300", "--",
                                 str(ROOT / "examples" / "bert_pretrain.py"), *example]
    else:  # the two_hosts.py front end, which runs cluster.py --hosts 2
        script, args = TWO_HOSTS, ["--launcher", "mpirun", "--link", "1gbit",
                                   "--port", str(free_port()), "--timeout", "300", "--",
                                   *example]
    result = run_workers("env", 1, script, args=args, env={"DP_PLUGIN_TIMEOUT": "60"},
                         timeout=360)
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
    hosts_file = Path("/etc/netns") / f"dpc-{dead}-h1" / "hosts"  # as Cluster writes it
    hosts_file.parent.mkdir(parents=True, exist_ok=True)
    hosts_file.write_text("127.0.0.1 localhost\n")
    try:
        assert f"dpc-{dead}-h1" in cluster.reap_stale()
        assert _namespaces(f"dpc-{dead}-") == set()
        assert not hosts_file.parent.exists(), "the killed run's hosts file was left"
        assert _namespaces(mine) == {mine}
    finally:
        subprocess.run(["ip", "netns", "del", mine], capture_output=True)
        subprocess.run(["ip", "netns", "del", f"dpc-{dead}-h1"], capture_output=True)
        shutil.rmtree(hosts_file.parent, ignore_errors=True)


# -- horovodrun across hosts ----------------------------------------------

WORKER = ROOT / "tests" / "multiproc" / "workers" / "horovod_across_hosts.py"
# Hides build-horovod's patch marker, so dp_plugin takes this Horovod for an
# unpatched 0.28.1 (the C++ stays fixed: only dp_plugin's decision is tested).
AS_UNPATCHED = '''import importlib.abc, sys
class _AsUnpatched(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "horovod.dp_plugin_patches":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _AsUnpatched())
'''


def _cluster(args: list[str], env: dict[str, str] | None = None,
             check: bool = True) -> tuple[str, str]:
    """Run scripts/cluster.py (horovodrun, 1 Gbit/s links); (output, namespace prefix),
    after checking that this run's namespaces and hosts files are gone."""
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    result = run_workers("env", 1, CLUSTER, args=["--launcher", "horovodrun", "--link", "1gbit",
                                                  "--timeout", "400", *args],
                         env={"DP_PLUGIN_TIMEOUT": "60", **(env or {})}, timeout=460,
                         check=check)
    made = re.search(r"(dpc-\d+-)h1 10\.", result.output)
    assert made, result.output
    assert _namespaces(made.group(1)) == set(), "namespaces were left behind"
    assert not list(Path("/etc/netns").glob(f"{made.group(1)}*")), "hosts files left behind"
    return result.output, made.group(1)


def _link_bytes(output: str) -> dict[str, tuple[int, int]]:
    """Per host: (bytes sent, bytes received) through its shaped link."""
    line = re.search(r"cluster: link bytes: (.*)", output)
    assert line, output
    return {m[0]: (int(m[1]), int(m[2]))
            for m in re.findall(r"(\S+) sent (-?\d+) received (-?\d+)", line.group(1))}


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["auto", "horovod"])
def test_bert_under_horovodrun_across_two_hosts(engine: str, tmp_path: Path) -> None:
    """The main job, 2 hosts x 2 ranks under horovodrun by host names: every
    rank ends with the same parameters, the loss falls, and the gradients
    crossed the shaped links: each way, at least the 6 steps' gradients once
    (124 KB of float32 each), what the hierarchical path of auto sends
    across per host; Horovod's flat ring sends more."""
    env = {"DP_PLUGIN_ENGINE": engine} if engine != "auto" else {}
    steps = [*TINY[:TINY.index("--steps")], "--steps", "6", "--warmup-steps", "1",
             "--log-every", "1", "--checkpoint-every", "0", "--no-progress", "--report-digest"]
    output, _ = _cluster(["--hosts", "2", "--ranks-per-host", "2", "--",
                          str(ROOT / "examples" / "bert_pretrain.py"), *steps,
                          "--output-dir", str(tmp_path)], env=env)
    assert "(horovodrun)" in output and "launchers exited with [0]" in output, output
    assert "summary: workers 4" in output, output
    digests = re.findall(r"parameters sha256 (\w+) \(rank (\d) of 4\)", output)
    assert sorted(r for _, r in digests) == ["0", "1", "2", "3"], output
    assert len({d for d, _ in digests}) == 1, f"the ranks disagree: {digests}"
    losses = [float(x) for x in re.findall(r"step \d+ loss (\d+\.\d+)", output)]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    for host, (sent, received) in _link_bytes(output).items():
        assert sent > 6 * 120_000 and received > 6 * 120_000, (host, sent, received)


@pytest.mark.multiproc
@pytest.mark.slow
def test_patched_horovod_connects_hosts_whose_names_are_loopback() -> None:
    """Both hosts' names resolve to 127.0.0.1 (--loopback-hostname): Horovod
    0.28.1 as released aborts ('Connection refused'); build-horovod's build
    binds its process sets to horovodrun's interface and connects, plain and
    under dp_plugin's explicit horovod; auto runs gloo (on CPUs, by measurement)."""
    output, _ = _cluster(["--hosts", "2", "--loopback-hostname", "--", str(WORKER), "--plain"])
    assert "launchers exited with [0]" in output, output
    for rank in (0, 1):
        assert f"plain horovod rank {rank} sum 3" in output, output
        assert f"dp_plugin horovod rank {rank} engine horovod sum 3" in output, output
        assert f"dp_plugin auto rank {rank} engine gloo sum 3" in output, output
    assert "Connection refused" not in output, output


@pytest.mark.multiproc
@pytest.mark.slow
def test_unpatched_horovod_with_loopback_names_falls_back_on_every_rank(
        tmp_path: Path) -> None:
    """The same hosts with Horovod taken for unpatched: an explicit horovod is
    refused on every rank with the cause and the fix (no C++ abort, no hang),
    and auto runs gloo on every rank, which connects."""
    (tmp_path / "sitecustomize.py").write_text(AS_UNPATCHED)
    output, _ = _cluster(["--hosts", "2", "--loopback-hostname", "--", str(WORKER)],
                         env={"PYTHONPATH": str(tmp_path)})
    assert "launchers exited with [0]" in output, output
    for rank in (0, 1):
        refused = re.search(rf"refused horovod: rank {rank}: engine 'horovod' cannot run this "
                            r"job: (.*)", output)
        assert refused, output
        assert "its host name" in refused.group(1) and "127.0.0.1" in refused.group(1)
        assert "dp-plugin build-horovod --force" in refused.group(1)
        assert f"dp_plugin auto rank {rank} engine gloo sum 3" in output, output


def test_the_ssh_stand_in_parses_what_launchers_pass() -> None:
    """horovodrun's and Hydra's ssh command lines, and ssh's grammar."""
    sys.path.insert(0, str(CLUSTER.parent))
    import cluster  # the script under test

    command = ["cd", "/x", ">", "/dev/null", "2>&1", ";", "env", "A=1", "python", "t.py"]
    horovodrun = ["-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no", "h2",
                  "-p", "22", "-i", "key", "-o", "ConnectTimeout=10", *command]
    assert cluster.parse_ssh(horovodrun) == ("h2", command)
    assert cluster.parse_ssh(["-x", "10.0.0.2", "/bin/proxy", "-v"]) == (
        "10.0.0.2", ["/bin/proxy", "-v"])
    assert cluster.parse_ssh(["-xTp2222", "-oBatchMode=yes", "me@h3", "date"]) == ("h3", ["date"])
    assert cluster.parse_ssh(["-l", "me", "--", "h4", "-x"]) == ("h4", ["-x"])
    assert cluster.parse_ssh(["h5"]) == ("h5", [])
    with pytest.raises(ValueError, match="unknown ssh option -Z"):
        cluster.parse_ssh(["-Z", "h"])
    with pytest.raises(ValueError, match="-p needs a value"):
        cluster.parse_ssh(["h", "-p"])
    with pytest.raises(ValueError, match="no host"):
        cluster.parse_ssh(["-v"])
