"""Rendered Kubernetes manifests rehearsed on namespace "pods".

No container runtime runs here, so no real Kubernetes. What runs instead is
as close to the pods as namespaces allow: ``dp-plugin k8s render`` writes the
manifest, and ``scripts/cluster.py --launcher k8s`` runs each pod's own
container command, with the variables its controller would inject, in a
network namespace of its own (a UTS namespace for its host name, an IPC
namespace, a tmpfs ``/dev/shm`` of the manifest's size), over 1 Gbit/s
shaped links, with the pods' DNS names in every hosts file. The BERT example
trains at 2 pods x 2 ranks: its loss falls and every rank ends with the same
parameters. An elastic TrainJob (``--max-restarts 1``) loses one pod's
worker processes mid-run: both pods' torchrun restart their workers, which
resume from the last commit and end with the weights of an uninterrupted run.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.examples.test_cluster import CLUSTER, ROOT, TINY, _namespaces, _namespaces_unavailable
from tests.multiproc.harness import assert_ranks_ok, run_workers

sys.path.insert(0, str(ROOT / "scripts"))
import cluster  # scripts/cluster.py
import pods  # scripts/pods.py


def _render(kind: str, out: Path, extra: list[str], command: list[str]) -> Path:
    from dp_plugin.cli import main

    manifest = out / f"{kind}.yaml"
    assert main(["k8s", "render", "--kind", kind, "--image", "local/dp-plugin:test",
                 "--nodes", "2", "--procs-per-node", "2", "--env", "DP_PLUGIN_TIMEOUT=60",
                 "--env", "OMP_NUM_THREADS=1", *extra, "-o", str(manifest),
                 "--", *command]) == 0
    return manifest


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize(("kind", "extra"), [("trainjob", []), ("mpijob", ["--mpi", "mpich"])])
def test_bert_on_two_rehearsed_pods(kind: str, extra: list[str], tmp_path: Path) -> None:
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    bert = [sys.executable, str(ROOT / "examples" / "bert_pretrain.py"),
            *[a if a != "4" else "8" for a in TINY], "--report-digest",
            "--output-dir", str(tmp_path / "out")]
    manifest = _render(kind, tmp_path, extra, bert)
    result = run_workers("env", 1, CLUSTER, args=[
        "--launcher", "k8s", "--manifest", str(manifest), "--link", "1gbit",
        "--timeout", "240"], timeout=300)
    out = result.output
    assert "launchers exited with [0" in out and "summary: workers 4" in out, out
    losses = [float(x) for x in re.findall(r"step \d+ loss (\d+\.\d+)", out)]
    assert len(losses) == 8 and losses[-1] < losses[0], out
    digests = re.findall(r"parameters sha256 (\w+) \(rank (\d) of 4\)", out)
    assert sorted(r for _, r in digests) == ["0", "1", "2", "3"], out
    assert len({d for d, _ in digests}) == 1, f"ranks differ: {digests}"
    # the gradients crossed the shaped links: each pod sent more than the
    # model's parameters (0.03M float32), as a ring between hosts must
    sent = [int(x) for x in re.findall(r"h[12] sent (\d+)", out)]
    assert len(sent) == 2 and min(sent) > 120_000, out
    made = re.search(r"(dpc-\d+-)h1 10\.", out)
    assert made and _namespaces(made.group(1)) == set(), "namespaces were left behind"


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_killed_pods_workers_restart_and_resume_from_the_commit(tmp_path: Path) -> None:
    """Failure kind (a) of docs/elastic.md: the worker processes of pod 2
    die (SIGKILL from outside, while they wait at step 7; the commit is of
    step 5). Pod 1's ranks fail their all-reduce, both torchruns restart
    their workers once, every rank resumes at step 5 from the default commit
    (rank 0's, in pod 1's own temporary directory), and the job ends with
    the weights of an uninterrupted run."""
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    worker = ROOT / "tests" / "multiproc" / "workers" / "torch_elastic.py"
    killed, reference = tmp_path / "killed", tmp_path / "reference"
    killed.mkdir()
    reference.mkdir()
    manifest = _render("trainjob", tmp_path, ["--max-restarts", "1"], [
        sys.executable, str(worker), "--case", "held", "--out", str(killed)])
    assert "--max-restarts=1" in manifest.read_text()
    result = run_workers("env", 1, CLUSTER, args=[
        "--launcher", "k8s", "--manifest", str(manifest), "--link", "1gbit",
        "--timeout", "240", "--kill", "workers", "--kill-host", "2",
        "--kill-when", r"rank \d holds at step 7"], timeout=300)
    out = result.output
    assert "launchers exited with [0, 0]" in out, out
    fault = re.search(r"fault: SIGKILLed the worker processes of host2: (.*)", out)
    assert fault and len(re.findall(r"\d+ \(", fault.group(1))) == 2, out  # not its torchrun
    for rank in range(4):
        assert f"rank {rank} attempt 0 starts at step 0" in out, out
        assert f"rank {rank} attempt 1 starts at step 5" in out, out
    assert "attempt 2" not in out, out
    assert_ranks_ok(result, 4)  # each rank checked that all four hold the same weights

    ok = run_workers("env", 4, worker, args=["--case", "uninterrupted", "--out", str(reference)],
                     env={"DP_PLUGIN_TIMEOUT": "60"}, timeout=150)
    assert_ranks_ok(ok, 4)
    # One host here, two there: the sums run in another order, so close, not bitwise.
    got, want = (np.frombuffer((d / "weights.bin").read_bytes(), np.float32)
                 for d in (killed, reference))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_pods_of_each_kind_get_what_their_controller_injects(tmp_path: Path) -> None:
    """The variables, names and mounts each kind's pods get (no namespaces)."""
    trainjob = pods.plan(pods.load(_render("trainjob", tmp_path, [], ["python", "t.py"])))
    assert [p.name for p in trainjob.pods] == ["dp-plugin-job-node-0-0", "dp-plugin-job-node-1-0"]
    second = trainjob.pods[1]
    assert second.command == ["torchrun", "t.py"] and second.shm_size == "2Gi"
    assert {k: second.env[k] for k in ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK",
                                       "PET_MASTER_ADDR", "PET_MASTER_PORT")} == {
        "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "dp-plugin-job-node-0-0.dp-plugin-job", "PET_MASTER_PORT": "29400"}
    assert second.env["DP_PLUGIN_TIMEOUT"] == "60"

    pytorchjob = pods.plan(pods.load(_render("pytorchjob", tmp_path, [], ["python", "t.py"])))
    master, worker = pytorchjob.pods
    assert (master.name, worker.name) == ("dp-plugin-job-master-0", "dp-plugin-job-worker-0")
    assert (worker.env["RANK"], worker.env["WORLD_SIZE"], worker.env["MASTER_ADDR"],
            worker.env["MASTER_PORT"]) == ("1", "2", "dp-plugin-job-master-0", "23456")

    mpijob = pods.plan(pods.load(_render("mpijob", tmp_path, ["--mpi", "mpich"],
                                         ["python", "t.py"])))
    *workers, launcher = mpijob.pods
    assert [w.command for w in workers] == [None, None]  # sshd
    assert launcher.env["HYDRA_HOST_FILE"] == "/etc/mpi/hostfile"
    assert launcher.files["/etc/mpi/hostfile"] == (
        "dp-plugin-job-worker-0.dp-plugin-job.default.svc:2\n"
        "dp-plugin-job-worker-1.dp-plugin-job.default.svc:2\n")


def test_a_fault_goes_only_where_a_launcher_restarts_ranks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--kill`` needs ``--kill-when`` and a host of the cluster, and is
    refused where nothing would restart the killed ranks (an MPIJob's
    mpirun, horovodrun) rather than left to fail the job."""
    trainjob = _render("trainjob", tmp_path, ["--max-restarts", "1"], ["python", "t.py"])
    args = cluster.parse_args(["--launcher", "k8s", "--manifest", str(trainjob),
                               "--kill", "workers", "--kill-when", "step 7"])
    assert (args.kill, args.kill_host, args.kill_when.pattern) == ("workers", 2, "step 7")
    mpijob = _render("mpijob", tmp_path, ["--mpi", "mpich"], ["python", "t.py"])
    for argv, says in (
            (["--launcher", "k8s", "--manifest", str(trainjob), "--kill", "pod"],
             "--kill and --kill-when go together"),
            (["--launcher", "k8s", "--manifest", str(trainjob), "--kill", "pod",
              "--kill-when", "x", "--kill-host", "3"], "expected a host of 1..2"),
            (["--launcher", "k8s", "--manifest", str(mpijob), "--kill", "workers",
              "--kill-when", "x"], "an MPIJob's mpirun has no restarts"),
            (["--launcher", "horovodrun", "--kill", "workers", "--kill-when", "x"],
             "horovodrun starts every rank from host 1")):
        with pytest.raises(SystemExit):
            cluster.parse_args(argv)
        assert says in capsys.readouterr().err, argv
