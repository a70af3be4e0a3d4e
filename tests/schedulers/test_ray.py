"""Ray, for real: a cluster of two namespace hosts (``ray start --head`` in
one, ``ray start --address=...`` in the other, one CPU each).

``dp_plugin.ray.RayExecutor`` (Horovod's API) and Ray Train's
``TorchTrainer`` each place one worker on each host and train the BERT
example a few steps with the same losses (1e-5) as a torchrun-style run;
the executor's ``execute``/``execute_single``/``run(args, kwargs)`` do what
Horovod's do; a worker SIGKILLed mid-run makes ``run`` raise dp_plugin's
error from the survivor on the driver, within DP_PLUGIN_TIMEOUT and the
grace period, with the dead rank named in the error's note. The hosts'
links are shaped (1gbit tbf each way, as scripts/cluster.py's): the
training tests check the qdiscs are in place and that the job's traffic
went through them.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.schedulers import netns, proc
from tests.schedulers.ray_cluster import RayCluster

DRIVER = Path(__file__).resolve().parent / "workers" / "ray_driver.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _drive(cluster: RayCluster, *args: str, timeout: float = 600) -> str:
    env = proc.clean_env(cluster.env(), RAY_ADDRESS=cluster.address, DP_PLUGIN_TIMEOUT="60")
    done = proc.run(cluster.driver(sys.executable, str(DRIVER), *args), env, timeout=timeout)
    assert done.returncode == 0, done.stdout
    return done.stdout


def _workers(output: str) -> dict[str, str]:
    """Each worker's captured output, by node address."""
    parts = re.split(r"^--- worker on (\S+)\n", output, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _check_bert(output: str, cluster: RayCluster, want: dict[int, float]) -> None:
    workers = _workers(output)
    hosts = {h.address for h in cluster.hosts.hosts}
    assert set(workers) == hosts, f"workers on {sorted(workers)}, hosts {sorted(hosts)}:\n{output}"
    rank0 = next(text for text in workers.values() if "summary: workers 2" in text)
    proc.assert_same_losses(proc.losses(rank0), want, output)


def test_ray_executor_spans_two_hosts_and_trains_like_torchrun(
        ray_hosts: RayCluster, bert_reference: tuple[dict[int, float], Path],
        tmp_path: Path) -> None:
    want, vocabulary = bert_reference
    before = netns.traffic(ray_hosts.hosts)
    out = _drive(ray_hosts, "executor", str(vocabulary), str(tmp_path))
    where = re.search(r"^where (.*)$", out, flags=re.M)
    assert where is not None, out
    placed = re.findall(r"\('(\S+)', '(\d)', '(\d)'\)", where.group(1))
    # One worker per host: ranks 0 and 1, each local rank 0 of its host.
    assert sorted(ip for ip, _, _ in placed) == sorted(h.address for h in ray_hosts.hosts.hosts)
    assert [(r, lr) for _, r, lr in placed] == [("0", "0"), ("1", "0")], out
    assert "execute ['hi', 'hi']" in out and "execute_single hi!" in out, out
    assert "run [10.0, 10.0]" in out, out  # (0 + 1) * scale on both ranks
    _check_bert(out, ray_hosts, want)
    netns.assert_links_shaped(ray_hosts.hosts, before)


def test_torch_trainer_spans_two_hosts_and_trains_like_torchrun(
        ray_hosts: RayCluster, bert_reference: tuple[dict[int, float], Path],
        tmp_path: Path) -> None:
    want, vocabulary = bert_reference
    before = netns.traffic(ray_hosts.hosts)
    out = _drive(ray_hosts, "trainer", str(vocabulary), str(tmp_path))
    assert "trainer error: None" in out, out
    _check_bert(out, ray_hosts, want)
    netns.assert_links_shaped(ray_hosts.hosts, before)


def test_a_killed_worker_makes_run_raise_dp_plugins_error(ray_hosts: RayCluster) -> None:
    out = _drive(ray_hosts, "kill", timeout=400)
    raised = re.search(r"raised (\w+): (.*)", out)
    assert raised is not None, out
    assert "rank 0" in raised.group(2) and "allreduce" in raised.group(2), out
    assert re.search(r"rank 1 \(node \S+\): its actor died", out), out


def test_horovod_trainer_spans_two_hosts_like_torch_trainer(
        ray_hosts: RayCluster, tmp_path: Path) -> None:
    """Ray Train v2 with dp_plugin's backend (dp_plugin.ray.train), one worker
    per host: each is its node's only rank, and the weights equal DDP's."""
    from tests.schedulers.test_ray_train import DRIVER as TRAIN_V2
    from tests.schedulers.test_ray_train import parse

    before = netns.traffic(ray_hosts.hosts)
    env = proc.clean_env(ray_hosts.env(), RAY_ADDRESS=ray_hosts.address, DP_PLUGIN_TIMEOUT="60")
    done = proc.run(ray_hosts.driver(sys.executable, str(TRAIN_V2), str(tmp_path), "--spread",
                                     "dp_plugin", "ddp"), env, timeout=600)
    out = done.stdout
    assert done.returncode == 0 and "error dp_plugin None" in out and "error ddp None" in out, out
    weights, ranks, _ = parse(out)
    assert len(weights["dp_plugin"]) == len(weights["ddp"]) == 2, out
    assert len({*weights["dp_plugin"], *weights["ddp"], *weights["reference"]}) == 1, weights
    assert sorted(ranks["dp_plugin"]) == [[0, 0, 2, 0], [1, 0, 2, 1]], out
    netns.assert_links_shaped(ray_hosts.hosts, before)
