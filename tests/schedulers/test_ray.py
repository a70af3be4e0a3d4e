"""Ray, for real: a cluster of two namespace hosts (``ray start --head`` in
one, ``ray start --address=...`` in the other, one CPU each).

``dp_plugin.ray.RayExecutor`` (Horovod's API) and Ray Train's
``TorchTrainer`` each place one worker on each host and train the BERT
example a few steps with the same losses (1e-5) as a torchrun-style run;
the executor's ``execute``/``execute_single``/``run(args, kwargs)`` do what
Horovod's do; a worker SIGKILLed mid-run makes ``run`` raise dp_plugin's
error from the survivor on the driver, within DP_PLUGIN_TIMEOUT and the
grace period, with the dead rank named in the error's note. Ray Train v2
with dp_plugin's backend: ``HorovodTrainer`` beside ``TorchTrainer``, one
worker per host, and ``HorovodTrainer`` resuming a killed worker, both
workers on one host (three fits: test_ray_train.py). Every test here reads
its part of one driver's output (workers/ray_driver.py, one Ray session).
The hosts' links are shaped (1gbit tbf each way, as scripts/cluster.py's):
the training tests check the qdiscs are in place and that traffic went
through them while the driver ran.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.schedulers import netns, proc
from tests.schedulers.ray_cluster import RayCluster

DRIVER = Path(__file__).resolve().parent / "workers" / "ray_driver.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@dataclass
class Driven:
    """One run of workers/ray_driver.py: every part in one Ray session."""

    returncode: int
    output: str
    dir: Path
    before: dict[str, dict[str, int]]
    """The links' traffic before the driver started (netns.traffic)."""

    def part(self, name: str) -> str:
        """What part ``name`` printed, after checking that it ended ok and
        that the driver's exit code says what its parts said."""
        found = re.search(rf"^=== {name}\n(.*?)^=== {name} (ok|failed)$", self.output,
                          flags=re.M | re.S)
        assert found is not None and found.group(2) == "ok", (
            f"the driver's part {name!r} did not end ok:\n{self.output}")
        failed = re.search(r"^=== \w+ failed$", self.output, flags=re.M) is not None
        assert self.returncode == (1 if failed else 0), self.output
        return found.group(1)


@pytest.fixture(scope="module")
def driven(ray_hosts: RayCluster, bert_reference: tuple[dict[int, float], Path],
           tmp_path_factory: pytest.TempPathFactory) -> Driven:
    """One driver for every test here: each driver start costs an interpreter,
    ``import ray`` and torch, and a Ray job (several seconds on two cores)."""
    _, vocabulary = bert_reference
    out = tmp_path_factory.mktemp("ray_driver")
    before = netns.traffic(ray_hosts.hosts)
    env = proc.clean_env(ray_hosts.env(), RAY_ADDRESS=ray_hosts.address, DP_PLUGIN_TIMEOUT="60")
    done = proc.run(ray_hosts.driver(sys.executable, str(DRIVER), str(vocabulary), str(out)),
                    env, timeout=1500)
    return Driven(done.returncode, done.stdout, out, before)


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
        driven: Driven) -> None:
    want, _ = bert_reference
    out = driven.part("executor")
    where = re.search(r"^where (.*)$", out, flags=re.M)
    assert where is not None, out
    placed = re.findall(r"\('(\S+)', '(\d)', '(\d)'\)", where.group(1))
    # One worker per host: ranks 0 and 1, each local rank 0 of its host.
    assert sorted(ip for ip, _, _ in placed) == sorted(h.address for h in ray_hosts.hosts.hosts)
    assert [(r, lr) for _, r, lr in placed] == [("0", "0"), ("1", "0")], out
    assert "execute ['hi', 'hi']" in out and "execute_single hi!" in out, out
    assert "run [10.0, 10.0]" in out, out  # (0 + 1) * scale on both ranks
    _check_bert(out, ray_hosts, want)
    netns.assert_links_shaped(ray_hosts.hosts, driven.before)


def test_torch_trainer_spans_two_hosts_and_trains_like_torchrun(
        ray_hosts: RayCluster, bert_reference: tuple[dict[int, float], Path],
        driven: Driven) -> None:
    want, _ = bert_reference
    out = driven.part("trainer")
    assert "trainer error: None" in out, out
    _check_bert(out, ray_hosts, want)
    netns.assert_links_shaped(ray_hosts.hosts, driven.before)


def test_a_killed_worker_makes_run_raise_dp_plugins_error(driven: Driven) -> None:
    out = driven.part("kill")
    raised = re.search(r"raised (\w+): (.*)", out)
    assert raised is not None, out
    assert "rank 0" in raised.group(2) and "allreduce" in raised.group(2), out
    assert re.search(r"rank 1 \(node \S+\): its actor died", out), out


def test_horovod_trainer_spans_two_hosts_like_torch_trainer(
        ray_hosts: RayCluster, driven: Driven) -> None:
    """Ray Train v2 with dp_plugin's backend (dp_plugin.ray.train), one worker
    per host: each is its node's only rank, and the weights equal DDP's."""
    from tests.schedulers.test_ray_train import parse

    out = driven.part("train_v2")
    assert "error dp_plugin None" in out and "error ddp None" in out, out
    weights, ranks, _ = parse(out)
    assert len(weights["dp_plugin"]) == len(weights["ddp"]) == 2, out
    assert len({*weights["dp_plugin"], *weights["ddp"], *weights["reference"]}) == 1, weights
    assert sorted(ranks["dp_plugin"]) == [[0, 0, 2, 0], [1, 0, 2, 1]], out
    netns.assert_links_shaped(ray_hosts.hosts, driven.before)


def test_horovod_trainer_resumes_a_killed_worker_to_the_reference_weights(
        driven: Driven) -> None:
    from tests.schedulers.test_ray_train import parse

    out = driven.part("train_v2")
    assert "error killed None" in out, out
    weights, ranks, attempts = parse(out)
    # both ranks hold the reference's weights, after the kill and the resume
    assert len(weights["killed"]) == 2 and len(weights["reference"]) == 1, out
    assert set(weights["killed"]) == set(weights["reference"]), weights
    # dp_plugin's rank is Ray Train's world rank; both workers on the one node
    assert sorted(ranks["killed"]) == [[0, 0, 2, 0], [1, 1, 2, 1]], out
    # both workers restarted once, resuming after a checkpoint of the first
    # attempt (the last that Ray had registered when rank 1 died: step 1 or 3)
    starts = sorted(attempts["killed"].split(), key=lambda a: (a.split(":")[1], a))
    assert starts[:2] == ["0:0", "1:0"], out
    assert starts[2:] in (["0:2", "1:2"], ["0:4", "1:4"]), out
    assert (driven.dir / "train_v2" / "killed-once").exists()
