"""Scheduler tests: real SLURM and Ray daemons on namespace "hosts".

Session fixtures start each daemon set once (``hosts``: two network
namespaces on a bridge, each link shaped with tc's tbf at 1gbit both ways;
``slurm``: munged, slurmctld and a slurmd per host;
``ray_cluster``: a Ray head on host 0 and a worker node on host 1) and stop
it on every exit path: the fixture's finalizer, and ``atexit`` should the
session end another way. ``bert_reference``: the BERT example for a few
steps on 2 ranks on this host (torchrun's variables, set by the
test harness), the run every scheduler's run
must equal (same vocabulary, same losses to 1e-5).

Where a piece cannot exist here (not root, no namespaces, SLURM not
installable, Ray not installed) the tests skip saying why; on the CI
machine (root, apt-get, the ray extra installed) they run.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multiproc.harness import run_workers
from tests.schedulers import netns, proc, ray_cluster, slurm

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.multiproc)


@pytest.fixture(scope="session", autouse=True)
def _no_single_host_gloo_interface() -> Iterator[None]:
    """An earlier test's in-process ``hvd.init()`` on one host leaves
    ``GLOO_SOCKET_IFNAME=lo`` in this process's environment
    (``netif.gloo_interface``). The daemons and jobs started here inherit
    it, and ranks on two namespace hosts then dial each other on loopback
    (``Gloo connectFullMesh failed``). Seen when the whole suite ran in
    one pytest process; ``pytest tests/schedulers`` alone passed."""
    saved = os.environ.pop("GLOO_SOCKET_IFNAME", None)
    yield
    if saved is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = saved


@pytest.fixture(scope="session")
def hosts() -> Iterator[netns.Hosts]:
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    made = netns.Hosts(2)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="session")
def slurm_cluster(hosts: netns.Hosts, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[slurm.SlurmCluster]:
    reason = slurm.ensure_installed()
    if reason:
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("slurm")
    workdir.chmod(0o755)  # munged wants its socket's directory readable by all
    cluster = slurm.SlurmCluster(hosts, workdir)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def ray_hosts(hosts: netns.Hosts, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[ray_cluster.RayCluster]:
    reason = ray_cluster.unavailable()
    if reason:
        pytest.skip(reason)
    # A short directory: Ray's socket paths under it must stay within AF_UNIX's
    # 107 bytes, which pytest-xdist's deeper temporary directories passed
    # (/tmp/pytest-of-root/pytest-N/popen-gw1/ray0/ray/session_.../plasma_store).
    workdir = Path(tempfile.mkdtemp(prefix="dpray-"))
    cluster = ray_cluster.RayCluster(hosts, workdir)
    try:
        yield cluster
    finally:
        cluster.close()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def bert_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], Path]:
    """(losses of a 2-rank torchrun-style run, the vocabulary it trained).

    Run once per ``make test``: under pytest-xdist the test processes share
    it through their common temporary directory (the first to ask runs it
    while holding a lock; the other reads its losses), since the scheduler
    files it serves may run in either process."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return _bert_reference(tmp_path_factory.mktemp("bert_reference"))
    shared = tmp_path_factory.getbasetemp().parent  # this run's, common to its workers
    with open(shared / "bert_reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        out = shared / "bert_reference"
        saved = out / "losses.json"
        if saved.exists():
            losses = {int(k): v for k, v in json.loads(saved.read_text()).items()}
            return losses, out / "tokenizer.json"
        out.mkdir(exist_ok=True)
        losses, vocabulary = _bert_reference(out)
        saved.write_text(json.dumps(losses))
        return losses, vocabulary


def _bert_reference(out: Path) -> tuple[dict[int, float], Path]:
    result = run_workers("env", 2, proc.BERT, args=[*proc.TINY, "--output-dir", str(out)],
                         env={"DP_PLUGIN_TIMEOUT": "60"}, timeout=600)
    losses = proc.losses(result.output)
    assert sorted(losses) == [1, 2, 3, 4], result.output
    return losses, out / "tokenizer.json"
