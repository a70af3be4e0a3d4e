"""Launch detection inside Kubernetes jobs (environment dicts, no processes).

What each controller sets, from Kubeflow Trainer v2's torch runtime (TrainJob:
``PET_*`` for the torchrun in the container), the Training Operator
(PyTorchJob: ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``, plus
``PET_*``), and every pod's ``KUBERNETES_SERVICE_HOST``. An MPIJob's ranks
see their MPI's own variables (tests/unit/test_launch.py covers those).
"""

from __future__ import annotations

import pytest

from dp_plugin.errors import LaunchError
from dp_plugin.launch.launchers import KubeflowPod, Torchrun, detect, detected_launcher
from dp_plugin.launch.variables import is_launcher_variable

POD = {"PATH": "/usr/bin", "HOME": "/root", "HOSTNAME": "job-node-1-0",
       "KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
TRAINJOB = {**POD, "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1",
            "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"}


def under_torchrun(pod: dict[str, str], rank: int, local_rank: int, group_rank: int,
                   local_size: int = 2, groups: int = 2) -> dict[str, str]:
    """What torchrun adds for one of its workers (it keeps the pod's variables)."""
    return {**pod, "RANK": str(rank), "WORLD_SIZE": str(local_size * groups),
            "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_size),
            "GROUP_RANK": str(group_rank), "GROUP_WORLD_SIZE": str(groups),
            "MASTER_ADDR": "job-node-0-0.job", "MASTER_PORT": "29400",
            "TORCHELASTIC_RESTART_COUNT": "0"}


def test_trainjob_under_torchrun_is_torchrun_with_the_pods_as_hosts() -> None:
    topo = detect(under_torchrun(TRAINJOB, rank=3, local_rank=1, group_rank=1))
    assert topo.launcher == "torchrun"
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size) == (3, 4, 1, 2)
    assert (topo.cross_rank, topo.cross_size) == (1, 2)
    assert topo.rendezvous_addr == "job-node-0-0.job"


@pytest.mark.parametrize(("overridden", "names"), [
    ({"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0"},
     ("PET_NPROC_PER_NODE='2'", "LOCAL_WORLD_SIZE='1'")),
    ({"GROUP_WORLD_SIZE": "1", "GROUP_RANK": "0", "WORLD_SIZE": "2", "RANK": "1"},
     ("PET_NNODES='2'", "GROUP_WORLD_SIZE='1'")),
])
def test_a_command_that_overrides_the_jobs_layout_is_refused(
        overridden: dict[str, str], names: tuple[str, str]) -> None:
    env = {**under_torchrun(TRAINJOB, rank=3, local_rank=1, group_rank=1), **overridden}
    with pytest.raises(LaunchError) as info:
        detect(env)
    for name in names:
        assert name in str(info.value)
    assert "drop torchrun's --nnodes" in str(info.value)


def test_an_elastic_node_range_is_not_compared() -> None:
    env = under_torchrun({**TRAINJOB, "PET_NNODES": "1:4"}, rank=3, local_rank=1, group_rank=1)
    assert detect(env).size == 4


def test_trainjob_pod_that_runs_python_without_torchrun_is_refused() -> None:
    # Every pod would otherwise train alone, as a single process, silently.
    assert detected_launcher(TRAINJOB) is KubeflowPod
    with pytest.raises(LaunchError, match=r"PET_NNODES='2'.*start the container's command with "
                                          r"torchrun"):
        detect(TRAINJOB)


def test_a_one_process_kubeflow_job_is_a_single_process() -> None:
    env = {**POD, "PET_NNODES": "1", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "0"}
    assert detect(env).launcher == "single"


PYTORCHJOB = {**POD, "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
              "WORLD_SIZE": "3", "RANK": "2", "PYTHONUNBUFFERED": "1"}


def test_pytorchjob_pod_running_the_script_is_one_rank_per_pod() -> None:
    topo = detect(PYTORCHJOB)
    assert detected_launcher(PYTORCHJOB) is Torchrun
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size) == (2, 3, 0, 1)
    assert (topo.cross_rank, topo.cross_size) == (2, 3)
    assert (topo.rendezvous_addr, topo.rendezvous_port) == ("job-master-0", 23456)


def test_pytorchjob_asking_for_several_procs_per_pod_needs_torchrun() -> None:
    with pytest.raises(LaunchError, match=r"PET_NPROC_PER_NODE='4'.*torchrun"):
        detect({**PYTORCHJOB, "PET_NPROC_PER_NODE": "4"})
    # "auto" is the operator's default when nprocPerNode is not set
    assert detect({**PYTORCHJOB, "PET_NPROC_PER_NODE": "auto"}).local_size == 1


def test_pytorchjob_under_torchrun() -> None:
    pod = {**PYTORCHJOB, "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "0"}
    topo = detect(under_torchrun(pod, rank=1, local_rank=1, group_rank=0))
    assert (topo.rank, topo.size, topo.local_size, topo.cross_size) == (1, 4, 2, 2)


def test_outside_kubernetes_a_missing_local_rank_is_still_an_error() -> None:
    env = {k: v for k, v in PYTORCHJOB.items() if not k.startswith("KUBERNETES_")}
    with pytest.raises(LaunchError, match="LOCAL_WORLD_SIZE is not set"):
        detect(env)


def test_the_kubeflow_variables_are_launcher_variables() -> None:
    # so test harnesses strip them from children and check that none leaked
    for name in ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "KUBERNETES_SERVICE_HOST"):
        assert is_launcher_variable(name)
