"""The one list of launcher variables (dp_plugin.launch.launchers) covers everything
launch detection reads, and the test harness and benchmarks use that list."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from dp_plugin.launch import launchers as launch
from dp_plugin.launch.launchers import LAUNCHERS, detect
from dp_plugin.launch.variables import (
    LAUNCHER_VARIABLE_NAMES,
    LAUNCHER_VARIABLE_PREFIXES,
    is_launcher_variable,
    launcher_variables,
)
from tests.unit.test_launch import BASE, horovodrun, intelmpi, mpich, openmpi, srun, torchrun

ENV_NAME = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+_?$")


class Recording(Mapping[str, str]):
    """An environment that remembers every name looked up in it."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = dict(env)
        self.looked_up: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.looked_up.add(key)
        return self._env[key]

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.looked_up.add(key)
        return key in self._env

    def get(self, key: str, default: object = None) -> object:  # type: ignore[override]
        self.looked_up.add(key)
        return self._env.get(key, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._env)

    def __len__(self) -> int:
        return len(self._env)


def _without(env: dict[str, str], *names: str) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in names}


ENVS = {
    "single": dict(BASE),
    "horovodrun": horovodrun(),
    "horovodrun-bare": _without(horovodrun(), "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE",
                                "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT"),
    "torchrun": torchrun(),
    "torchrun-bare": _without(torchrun(), "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
                              "MASTER_PORT"),
    "openmpi": openmpi(),
    "mpich": mpich(),
    "intelmpi": intelmpi(),
    "srun": srun(),
    "srun-ntasks-per-node": {**_without(srun(), "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_NODES",
                                        "SLURM_STEP_ID"), "SLURM_NTASKS_PER_NODE": "3",
                             "MASTER_ADDR": "node01", "MASTER_PORT": "29500"},
    "srun-pmi2": {**srun(), "PMI_RANK": "4", "PMI_SIZE": "7"},
    "slurm-batch-script": {**srun(), "SLURM_STEP_ID": "4294967294"},
}


@pytest.mark.parametrize("name", list(ENVS))
def test_every_variable_detection_looks_up_is_a_launcher_variable(name: str) -> None:
    env = Recording(ENVS[name])
    detect(env)
    missing = sorted(v for v in env.looked_up if not is_launcher_variable(v))
    assert not missing, f"launch detection read {missing}, which LAUNCHER_VARIABLE_NAMES lacks"


@pytest.mark.parametrize("name", list(ENVS))
def test_each_launcher_looks_up_only_what_it_declares(name: str) -> None:
    for cls in LAUNCHERS:
        env = Recording(ENVS[name])
        if not cls.detect(env):
            continue
        cls.topology(env)
        undeclared = sorted(
            v for v in env.looked_up
            if v not in cls.reads and not v.startswith(cls.read_prefixes)
            # MPICH tells an srun --mpi=pmi2 step apart through Slurm's markers.
            and not (issubclass(cls, launch.MPICH) and v in launch.Slurm.reads)
        )
        assert not undeclared, f"{cls.__name__} reads {undeclared} but does not declare them"


def test_every_variable_name_in_launch_py_is_in_the_list() -> None:
    """Also catches a name read in a way the recording above does not see
    (iterating the environment, as Intel MPI's I_MPI_* check does)."""
    tree = ast.parse(Path(launch.__file__).read_text())
    names = {
        node.value for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and ENV_NAME.match(node.value)
    }
    assert "SLURMD_NODENAME" in names and "I_MPI_" in names  # the scan finds what it should
    missing = sorted(
        n for n in names
        if not (is_launcher_variable(n) or n in LAUNCHER_VARIABLE_PREFIXES)
    )
    assert not missing, f"launch.py names {missing}, which the launcher variable list lacks"


def test_the_list_covers_what_every_launcher_sets() -> None:
    for env in (horovodrun(), torchrun(), openmpi(), mpich(), intelmpi(), srun()):
        set_by_launcher = {k for k in env if k not in BASE}
        for name in set_by_launcher & {"GFORTRAN_UNBUFFERED_PRECONNECTED", "HYDI_CONTROL_FD",
                                       "NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS",
                                       "TORCH_NCCL_ASYNC_ERROR_HANDLING"}:
            set_by_launcher.discard(name)  # set, but they claim no identity
        missing = sorted(k for k in set_by_launcher if not is_launcher_variable(k))
        assert not missing, missing
        assert detect(_without(env, *launcher_variables(env))).launcher == "single"


def test_tuning_variables_are_not_launcher_variables() -> None:
    for name in ("DP_PLUGIN_ENGINE", "DP_PLUGIN_TIMEOUT", "HOROVOD_FUSION_THRESHOLD",
                 "HOROVOD_TIMELINE", "OMP_NUM_THREADS", "PATH"):
        assert not is_launcher_variable(name), name
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "SLURMD_NODENAME",
                 "I_MPI_ROOT", "HOROVOD_RANK", "TORCHELASTIC_RUN_ID", "MPI_LOCALRANKID"):
        assert is_launcher_variable(name), name
    assert "RANK" in LAUNCHER_VARIABLE_NAMES


def test_harness_and_benchmarks_use_the_one_list() -> None:
    from tests.multiproc import harness

    assert harness.is_launcher_variable is is_launcher_variable
    assert harness.LAUNCHER_VARIABLE_NAMES is LAUNCHER_VARIABLE_NAMES
    # The benchmarks' launching lives in dp_plugin.cli.jobs (dp-plugin bench uses it too).
    root = Path(__file__).resolve().parents[2]
    source = (root / "dp_plugin" / "cli" / "jobs.py").read_text()
    assert "from dp_plugin.launch.variables import is_launcher_variable" in source
    assert "HOROVOD_RANK" not in source  # no list of its own
