"""SLURM, for real: srun and sbatch on a two-node cluster of namespace hosts.

No MASTER_ADDR/MASTER_PORT anywhere: dp_plugin derives them from SLURM's
variables (the step's first host, a port from the job id). The BERT
example's losses under srun (one node) and under the CPU sbatch script of
docs/multinode.md (two nodes) equal a torchrun run's; ``srun -N 2 -n 4``
spans both hosts with the right local/cross topology; a rank SIGKILLed
under srun ends the step with dp_plugin's error on the survivor and SLURM
reporting the step failed. The two-node jobs run over shaped links (1gbit
tbf each way, as scripts/cluster.py's): each test checks the qdiscs are in
place and that its job's traffic went through them.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.schedulers import netns, proc
from tests.schedulers.slurm import SlurmCluster

WORKERS = Path(__file__).resolve().parent / "workers"
FAULTS = proc.ROOT / "tests" / "multiproc" / "workers" / "faults.py"
DOCS = proc.ROOT / "docs" / "multinode.md"
# The first test also pays for the session's daemons and reference run.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _env(cluster: SlurmCluster, **extra: str) -> dict[str, str]:
    # SLURM_CONF is added after the launcher variables (SLURM_*) are dropped.
    return proc.clean_env(**{"DP_PLUGIN_TIMEOUT": "60", "SLURM_CONF": str(cluster.conf),
                             **extra})


def test_srun_on_one_node_derives_the_rendezvous_and_trains_like_torchrun(
        slurm_cluster: SlurmCluster, bert_reference: tuple[dict[int, float], Path],
        tmp_path: Path) -> None:
    want, vocabulary = bert_reference
    done = proc.run(["srun", "-N", "1", "-n", "2", sys.executable, str(proc.BERT), *proc.TINY,
                     "--tokenizer", str(vocabulary), "--output-dir", str(tmp_path)],
                    _env(slurm_cluster), timeout=600)
    assert done.returncode == 0, done.stdout
    assert "summary: workers 2" in done.stdout, done.stdout
    proc.assert_same_losses(proc.losses(done.stdout), want, done.stdout)


def sbatch_scripts() -> dict[str, str]:
    """docs/multinode.md's batch scripts, exactly as written there, by their
    first comment line ("CPU nodes", "GPU nodes")."""
    found = re.findall(r"```bash\n(#!/bin/bash\n# (\w+) nodes.*?)```", DOCS.read_text(), flags=re.S)
    return {kind: script for script, kind in found}


def test_the_doc_holds_a_cpu_and_a_gpu_script() -> None:
    scripts = sbatch_scripts()
    assert sorted(scripts) == ["CPU", "GPU"], scripts
    for script in scripts.values():
        assert "#SBATCH" in script and "srun" in script, script


def test_the_cpu_sbatch_script_of_the_docs_runs_across_two_nodes(
        slurm_cluster: SlurmCluster, bert_reference: tuple[dict[int, float], Path],
        tmp_path: Path) -> None:
    # The GPU script cannot run here (no GPUs); the doc says so beside it.
    want, vocabulary = bert_reference
    script = tmp_path / "train.sbatch"
    script.write_text(sbatch_scripts()["CPU"])
    out = tmp_path / "job.out"
    before = netns.traffic(slurm_cluster.hosts)
    # Options on the command line override the script's #SBATCH lines: this
    # cluster's two nodes of 2 CPUs, one task each; the example's flags follow
    # the script, as the doc shows.
    done = proc.run(["sbatch", "--wait", "--nodes=2", "--ntasks-per-node=1",
                     "--cpus-per-task=1", "--time=00:10:00", f"--output={out}",
                     str(script), *proc.TINY, "--tokenizer", str(vocabulary),
                     "--output-dir", str(tmp_path / "bert")],
                    _env(slurm_cluster), timeout=600)
    log = out.read_text() if out.exists() else "(no job output)"
    assert done.returncode == 0, f"{done.stdout}\n{log}"
    assert "summary: workers 2" in log, log
    proc.assert_same_losses(proc.losses(log), want, log)
    netns.assert_links_shaped(slurm_cluster.hosts, before)


def test_srun_spans_two_hosts(slurm_cluster: SlurmCluster) -> None:
    before = netns.traffic(slurm_cluster.hosts)
    done = proc.run(["srun", "-N", "2", "-n", "4", "--label", sys.executable,
                     str(WORKERS / "topology.py")], _env(slurm_cluster), timeout=600)
    assert done.returncode == 0, done.stdout
    lines = re.findall(r"rank (\d) of 4 local (\d)/(\d) cross (\d)/(\d) host (\S+) launcher "
                       r"(\S+) rendezvous (\S+):(\d+) sum (\S+) job (\d+)", done.stdout)
    assert len(lines) == 4, done.stdout
    first, second = slurm_cluster.nodes
    for rank, local, local_size, cross, cross_size, host, launcher, addr, port, total, job in lines:
        r = int(rank)
        assert (int(local), int(local_size)) == (r % 2, 2), done.stdout
        assert (int(cross), int(cross_size)) == (r // 2, 2), done.stdout
        assert host == (first if r < 2 else second), done.stdout
        assert launcher == "slurm" and addr == first, done.stdout
        assert int(port) == 15000 + int(job) % 10000, done.stdout
        assert float(total) == 6.0, done.stdout
    netns.assert_links_shaped(slurm_cluster.hosts, before)


def test_a_killed_rank_ends_the_step_with_dp_plugins_error(slurm_cluster: SlurmCluster) -> None:
    done = proc.run(["srun", "-N", "2", "-n", "2", sys.executable, str(FAULTS), "--case", "kill"],
                    _env(slurm_cluster, DP_PLUGIN_TIMEOUT="4", DP_PLUGIN_ENGINE="gloo"),
                    timeout=300)
    out = done.stdout
    assert done.returncode != 0, out
    assert "rank 1 FAULT at" in out, out
    # The survivor: dp_plugin's error naming its rank and the collective.
    survivor = re.search(r"rank 0 error at [0-9.]+: (.*)", out)
    assert survivor is not None, out
    assert "rank 0" in survivor.group(1) and "allreduce" in survivor.group(1), out
    # SLURM: the killed task and the failed step.
    assert re.search(r"srun: error: \S+: task 1: Killed", out), out
    assert re.search(r"srun: error: \S+: task 0: Exited with exit code 1", out), out
