"""Launch detection from environment dicts (no processes).

The dicts copy what the real launchers export: horovodrun --gloo,
torchrun and MPICH's mpiexec were run with ``env`` as the program; Open MPI,
Intel MPI and SLURM follow their documentation.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from dp_plugin.errors import LaunchError
from dp_plugin.launch.launchers import (
    LAUNCHER_NAMES,
    LAUNCHERS,
    MPICH,
    Horovod,
    IntelMPI,
    OpenMPI,
    Single,
    Slurm,
    Topology,
    Torchrun,
    detect,
    detected_launcher,
    expand_hostlist,
    parse_tasks_per_node,
)

EnvMaker = Callable[[], dict[str, str]]
BASE = {"PATH": "/usr/bin", "HOME": "/home/u", "LANG": "C.UTF-8"}


def horovodrun(rank: int = 1, size: int = 2, local_rank: int = 1, local_size: int = 2,
               cross_rank: int = 0, cross_size: int = 1) -> dict[str, str]:
    return {
        **BASE,
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": "lo", "NCCL_SOCKET_IFNAME": "lo",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "32117",
        "HOROVOD_HOSTNAME": "localhost",
        "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(local_rank), "HOROVOD_LOCAL_SIZE": str(local_size),
        "HOROVOD_CROSS_RANK": str(cross_rank), "HOROVOD_CROSS_SIZE": str(cross_size),
    }


def torchrun(rank: int = 1, size: int = 2, local_rank: int = 1, local_size: int = 2,
             group_rank: int = 0, group_size: int = 1) -> dict[str, str]:
    return {
        **BASE,
        "GROUP_RANK": str(group_rank), "GROUP_WORLD_SIZE": str(group_size),
        "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_size),
        "MASTER_ADDR": "localhost", "MASTER_PORT": "45023", "OMP_NUM_THREADS": "1",
        "RANK": str(rank), "WORLD_SIZE": str(size),
        "ROLE_NAME": "default", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(size),
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_RUN_ID": "8080c6a6-8917-4529-92f0-3543f8a4940d",
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


def mpich(rank: int = 1, size: int = 2, local_rank: int = 1, local_size: int = 2) -> dict[str, str]:
    return {
        **BASE,
        "GFORTRAN_UNBUFFERED_PRECONNECTED": "y", "HYDI_CONTROL_FD": "7",
        "MPI_LOCALNRANKS": str(local_size), "MPI_LOCALRANKID": str(local_rank),
        "PMI_FD": "9", "PMI_HOSTNAME": "vm", "PMI_RANK": str(rank), "PMI_SIZE": str(size),
    }


def intelmpi(rank: int = 1, size: int = 2, local_rank: int = 1,
             local_size: int = 2) -> dict[str, str]:
    return {
        **mpich(rank, size, local_rank, local_size),
        "I_MPI_ROOT": "/opt/intel/oneapi/mpi/2021.10.0", "I_MPI_HYDRA_TOPOLIB": "hwloc",
    }


def openmpi(rank: int = 1, size: int = 2, local_rank: int = 1,
            local_size: int = 2) -> dict[str, str]:
    return {
        **BASE,
        "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        "OMPI_COMM_WORLD_NODE_RANK": str(local_rank), "OMPI_UNIVERSE_SIZE": str(size),
        "PMIX_RANK": str(rank), "OMPI_MCA_orte_hnp_uri": "1234.0;tcp://10.0.0.1:5000",
    }


def srun(procid: int = 4, ntasks: int = 7, localid: int = 1, nodeid: int = 1, nnodes: int = 3,
         tasks_per_node: str = "3,2(x2)") -> dict[str, str]:
    """``srun -n 7`` over 3 nodes, block distribution: [3, 2, 2] tasks."""
    return {
        **BASE,
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_JOB_NUM_NODES": "3",
        "SLURM_TASKS_PER_NODE": tasks_per_node, "SLURM_CPUS_ON_NODE": "8",
        "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks),
        "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid),
        "SLURM_NNODES": str(nnodes), "SLURM_STEP_NUM_NODES": str(nnodes),
        "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
        "SLURMD_NODENAME": "node02", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1",
    }


HOW_TO_START = {
    "horovodrun": "horovodrun -np N", "torchrun": "torchrun --nproc_per_node N",
    "openmpi": "mpirun -np N", "mpich": "mpiexec -n N", "intelmpi": "mpiexec -n N",
    "srun": "srun --ntasks N",
}


# -- each launcher -------------------------------------------------------------

def test_horovodrun_gloo() -> None:
    topo = detect(horovodrun())
    assert topo == Topology(
        launcher="horovodrun", rank=1, size=2, local_rank=1, local_size=2,
        cross_rank=0, cross_size=1, rendezvous_addr="127.0.0.1", rendezvous_port=32117,
        hostname="localhost",
    )
    assert not topo.is_mpi


def test_horovodrun_multi_host_cross_values_are_taken_as_given() -> None:
    # Host 2 of 3, uneven hosts: Horovod's cross values differ from a derivation.
    env = horovodrun(rank=5, size=6, local_rank=1, local_size=2, cross_rank=2, cross_size=3)
    topo = detect(env)
    assert (topo.cross_rank, topo.cross_size) == (2, 3)


def test_horovodrun_without_cross_or_rendezvous() -> None:
    env = horovodrun(rank=3, size=4, local_rank=1, local_size=2)
    for name in ("HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
                 "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_HOSTNAME"):
        del env[name]
    topo = detect(env)
    assert (topo.cross_rank, topo.cross_size) == (1, 2)  # derived, block placement
    assert topo.rendezvous_addr is None and topo.rendezvous_port is None
    assert topo.hostname is None


def test_torchrun() -> None:
    topo = detect(torchrun())
    assert topo == Topology(
        launcher="torchrun", rank=1, size=2, local_rank=1, local_size=2,
        cross_rank=0, cross_size=1, rendezvous_addr="localhost", rendezvous_port=45023,
    )


def test_torchrun_group_rank_is_the_cross_rank() -> None:
    topo = detect(torchrun(rank=5, size=8, local_rank=1, local_size=4, group_rank=1,
                           group_size=2))
    assert (topo.cross_rank, topo.cross_size) == (1, 2)


def test_hand_made_env_launch_without_group_or_elastic_variables() -> None:
    # What tests/multiproc's "env" launcher and many job scripts set.
    env = {**BASE, "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2",
           "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    topo = detect(env)
    assert topo.launcher == "torchrun"
    assert (topo.rank, topo.size, topo.cross_rank, topo.cross_size) == (2, 3, 0, 1)


def test_mpich_hydra() -> None:
    topo = detect(mpich())
    assert topo == Topology(
        launcher="mpich", rank=1, size=2, local_rank=1, local_size=2,
        cross_rank=0, cross_size=1, hostname="vm",
    )
    assert topo.is_mpi


def test_intel_mpi_is_told_apart_by_its_i_mpi_variables() -> None:
    topo = detect(intelmpi())
    assert topo.launcher == "intelmpi"
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size) == (1, 2, 1, 2)
    assert topo.is_mpi


def test_openmpi_derives_cross_values_from_block_placement() -> None:
    # 8 ranks, 4 per host: rank 6 is local rank 2 on host 1 of 2.
    topo = detect(openmpi(rank=6, size=8, local_rank=2, local_size=4))
    assert topo.launcher == "openmpi" and topo.is_mpi
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size) == (6, 8, 2, 4)
    assert (topo.cross_rank, topo.cross_size) == (1, 2)


def test_derived_cross_values_on_an_uneven_last_host() -> None:
    # 5 ranks as hosts of [3, 2]: the last host's ranks are 3 and 4.
    for rank, local_rank in ((3, 0), (4, 1)):
        topo = detect(openmpi(rank=rank, size=5, local_rank=local_rank, local_size=2))
        assert topo.cross_rank < topo.cross_size
        assert topo.cross_rank == 1
    topo = detect(openmpi(rank=2, size=5, local_rank=2, local_size=3))
    assert (topo.cross_rank, topo.cross_size) == (0, 2)


def test_slurm_srun_step() -> None:
    topo = detect(srun())
    assert topo == Topology(
        launcher="slurm", rank=4, size=7, local_rank=1, local_size=2,
        cross_rank=1, cross_size=3, hostname="node02",
    )


def test_slurm_takes_master_addr_as_rendezvous() -> None:
    env = {**srun(), "MASTER_ADDR": "node01", "MASTER_PORT": "29400"}
    topo = detect(env)
    assert (topo.rendezvous_addr, topo.rendezvous_port) == ("node01", 29400)


def test_slurm_derives_the_rendezvous_from_the_node_list_and_the_job_id() -> None:
    # What `srun python train.py` exports, and no MASTER_ADDR/MASTER_PORT:
    # the step's first host (where rank 0 runs) and Lightning's port.
    env = {**srun(), "SLURM_JOB_NODELIST": "node[01-04]", "SLURM_STEP_NODELIST": "node[02-04]"}
    topo = detect(env)
    assert (topo.rendezvous_addr, topo.rendezvous_port) == ("node02", 15000 + 4242)
    del env["SLURM_STEP_NODELIST"]  # an older srun: the job's list
    assert detect(env).rendezvous_addr == "node01"
    env["SLURM_JOB_ID"] = "1234567"
    assert detect(env).rendezvous_port == 15000 + 4567
    # Explicit values win.
    env.update(MASTER_ADDR="10.1.2.3", MASTER_PORT="29500")
    assert (detect(env).rendezvous_addr, detect(env).rendezvous_port) == ("10.1.2.3", 29500)


def test_slurm_without_a_node_list_derives_nothing() -> None:
    topo = detect(srun())
    assert (topo.rendezvous_addr, topo.rendezvous_port) == (None, None)


def test_slurm_malformed_node_list_names_the_variable() -> None:
    env = {**srun(), "SLURM_STEP_NODELIST": "node[01-03"}
    with pytest.raises(LaunchError, match=r"SLURM_STEP_NODELIST='node\[01-03'.*unclosed"):
        detect(env)


@pytest.mark.parametrize(("raw", "hosts"), [
    ("node01", ["node01"]),
    ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
    ("node[08-10],gpu5", ["node08", "node09", "node10", "gpu5"]),
    ("a[1-2]b[0-1]", ["a1b0", "a1b1", "a2b0", "a2b1"]),
    ("x-[9-11].ib , y", ["x-9.ib", "x-10.ib", "x-11.ib", "y"]),
    ("n[007]", ["n007"]),
])
def test_expand_hostlist(raw: str, hosts: list[str]) -> None:
    assert expand_hostlist(raw) == hosts


@pytest.mark.parametrize(("raw", "why"), [
    ("node[01-03", "unclosed"), ("node]1", "unbalanced"), ("node[3-1]", "backwards"),
    ("node[a-b]", "not a number"), ("", "no host names"), ("n[1,,2]", "not a number"),
])
def test_expand_hostlist_rejects(raw: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        expand_hostlist(raw)


def test_slurm_first_node_of_an_uneven_step() -> None:
    topo = detect(srun(procid=2, localid=2, nodeid=0))
    assert (topo.local_rank, topo.local_size, topo.cross_rank) == (2, 3, 0)


def test_slurm_ntasks_per_node_fallback_on_a_short_last_node() -> None:
    # --ntasks-per-node=4 with 6 tasks on 2 nodes: the last node runs 2.
    env = srun(procid=5, ntasks=6, localid=1, nodeid=1, nnodes=2)
    del env["SLURM_STEP_TASKS_PER_NODE"]
    env["SLURM_NTASKS_PER_NODE"] = "4"
    assert detect(env).local_size == 2
    env.update(SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_NODEID="0")
    assert detect(env).local_size == 4


def test_slurm_batch_script_and_salloc_shell_are_not_srun_steps() -> None:
    env = srun(procid=0, localid=0, nodeid=0)
    for pseudo in ("4294967294", "4294967291", "4294967292"):  # batch / extern / interactive
        assert not Slurm.detect({**env, "SLURM_STEP_ID": pseudo, "SLURM_STEPID": pseudo})
    shell = {k: v for k, v in env.items() if k not in ("SLURM_STEP_ID", "SLURM_STEPID")}
    assert not Slurm.detect(shell)
    assert detect(shell).launcher == "single"


def test_parse_tasks_per_node() -> None:
    assert parse_tasks_per_node("4") == [(4, 1)]
    assert parse_tasks_per_node("2(x3),1") == [(2, 3), (1, 1)]
    assert parse_tasks_per_node("3, 2(x2)") == [(3, 1), (2, 2)]
    for bad in ("", "2(x)", "x3", "2(3)", "0", "2(x0)", "-1", "2,,1"):
        with pytest.raises(LaunchError, match="SLURM_STEP_TASKS_PER_NODE"):
            parse_tasks_per_node(bad)


@pytest.mark.parametrize("nodes", ["3623878656", "9223372036854775808"])
def test_a_huge_node_count_is_refused_without_expanding_it(nodes: str) -> None:
    """Found by the fuzz test: a plain task count on billions of nodes was
    expanded into a list (MemoryError after 23 GB, or OverflowError)."""
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "4",
           "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_STEP_NUM_NODES": nodes, "SLURM_STEP_TASKS_PER_NODE": "1",
           "SLURM_STEP_NUM_TASKS": "7"}
    with pytest.raises(LaunchError, match=f"describes {nodes} node.*running {nodes} task"):
        detect(env)


def test_single_process_fallback() -> None:
    assert detect(dict(BASE)) == Topology.single()
    assert detect({}) == Topology(
        launcher="single", rank=0, size=1, local_rank=0, local_size=1,
        cross_rank=0, cross_size=1,
    )


def test_detect_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if any(cls.detect({name: "0"}) for cls in LAUNCHERS[:-1]):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "3")
    monkeypatch.setenv("MPI_LOCALRANKID", "0")
    monkeypatch.setenv("MPI_LOCALNRANKS", "3")
    assert MPICH.detect()
    assert detect().size == 3


# -- priority -----------------------------------------------------------------

def test_launchers_are_listed_in_priority_order() -> None:
    assert [cls.name for cls in LAUNCHERS] == [
        "horovodrun", "torchrun", "openmpi", "intelmpi", "mpich", "slurm", "kubeflow",
        "process_group", "single",
    ]
    assert {cls.name for cls in LAUNCHERS} == set(LAUNCHER_NAMES)
    for cls in LAUNCHERS:
        assert cls.command and cls.fix


def test_horovodrun_wins_over_the_mpirun_or_srun_it_runs_under() -> None:
    env = {**openmpi(rank=0, size=1, local_rank=0, local_size=1), **srun(), **horovodrun()}
    assert detected_launcher(env) is Horovod
    assert detect(env).launcher == "horovodrun"


def test_torchrun_wins_over_mpi_and_slurm() -> None:
    env = {**srun(), **mpich(rank=0, size=1, local_rank=0, local_size=1), **torchrun()}
    assert detect(env).launcher == "torchrun"


def test_mpi_wins_over_the_slurm_step_that_started_its_daemons() -> None:
    # mpiexec inside an allocation runs its proxies through srun: one task per node.
    env = {**srun(procid=1, ntasks=2, localid=0, nodeid=1, nnodes=2, tasks_per_node="1(x2)"),
           **mpich(rank=5, size=8, local_rank=1, local_size=4)}
    topo = detect(env)
    assert topo.launcher == "mpich" and (topo.rank, topo.size) == (5, 8)
    env = {**srun(procid=1, ntasks=2, localid=0, nodeid=1, nnodes=2, tasks_per_node="1(x2)"),
           **openmpi(rank=5, size=8, local_rank=1, local_size=4)}
    assert detect(env).launcher == "openmpi"


def test_srun_pmi_variables_without_hydra_are_a_slurm_launch() -> None:
    # srun --mpi=pmi2 exports PMI_* but not Hydra's MPI_LOCALRANKID.
    env = {**srun(), "PMI_RANK": "4", "PMI_SIZE": "7", "PMI_FD": "5"}
    assert not MPICH.detect(env)
    assert detect(env).launcher == "slurm"


def test_each_launcher_detects_only_its_own_environment() -> None:
    envs = {
        Horovod: horovodrun(), Torchrun: torchrun(), OpenMPI: openmpi(), IntelMPI: intelmpi(),
        MPICH: mpich(), Slurm: srun(), Single: dict(BASE),
    }
    for cls, env in envs.items():
        assert detected_launcher(env) is cls, cls.name
        assert cls.topology(env).launcher == cls.name


# -- malformed variables --------------------------------------------------------

def _error(env: dict[str, str]) -> str:
    with pytest.raises(LaunchError) as info:
        detect(env)
    return str(info.value)


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (horovodrun, "HOROVOD_RANK"), (horovodrun, "HOROVOD_SIZE"),
        (horovodrun, "HOROVOD_LOCAL_RANK"), (horovodrun, "HOROVOD_LOCAL_SIZE"),
        (horovodrun, "HOROVOD_CROSS_RANK"), (horovodrun, "HOROVOD_CROSS_SIZE"),
        (horovodrun, "HOROVOD_GLOO_RENDEZVOUS_PORT"),
        (torchrun, "RANK"), (torchrun, "WORLD_SIZE"), (torchrun, "LOCAL_RANK"),
        (torchrun, "LOCAL_WORLD_SIZE"), (torchrun, "GROUP_RANK"),
        (torchrun, "GROUP_WORLD_SIZE"), (torchrun, "MASTER_PORT"),
        (openmpi, "OMPI_COMM_WORLD_RANK"), (openmpi, "OMPI_COMM_WORLD_SIZE"),
        (openmpi, "OMPI_COMM_WORLD_LOCAL_RANK"), (openmpi, "OMPI_COMM_WORLD_LOCAL_SIZE"),
        (mpich, "PMI_RANK"), (mpich, "PMI_SIZE"), (mpich, "MPI_LOCALRANKID"),
        (mpich, "MPI_LOCALNRANKS"), (intelmpi, "PMI_RANK"),
        (srun, "SLURM_PROCID"), (srun, "SLURM_NTASKS"), (srun, "SLURM_LOCALID"),
        (srun, "SLURM_NODEID"), (srun, "SLURM_STEP_NUM_NODES"),
        (srun, "SLURM_STEP_TASKS_PER_NODE"),
    ],
)
@pytest.mark.parametrize("bad", ["two", "1.5", "-1", ""])
def test_non_integer_or_negative_value_names_variable_and_value(
    make: EnvMaker, name: str, bad: str
) -> None:
    env = make()
    env[name] = bad
    message = _error(env)
    assert name in message
    assert repr(bad) in message
    assert HOW_TO_START[make.__name__] in message


@pytest.mark.parametrize(
    ("env", "names"),
    [
        (horovodrun(rank=2, size=2), ("HOROVOD_RANK='2'", "HOROVOD_SIZE='2'")),
        (horovodrun(size=0), ("HOROVOD_SIZE='0'",)),
        (horovodrun(local_rank=2, local_size=2), ("HOROVOD_LOCAL_RANK='2'",)),
        (horovodrun(rank=1, size=2, local_rank=1, local_size=3), ("HOROVOD_LOCAL_SIZE='3'",)),
        (horovodrun(cross_rank=1, cross_size=1), ("HOROVOD_CROSS_RANK='1'",)),
        (horovodrun(cross_size=3), ("HOROVOD_CROSS_SIZE='3'", "HOROVOD_SIZE='2'")),
        (torchrun(rank=5, size=4), ("RANK='5'", "WORLD_SIZE='4'")),
        (torchrun(rank=0, local_rank=1), ("LOCAL_RANK='1'", "RANK='0'")),
        (torchrun(rank=3, size=4, local_rank=0, local_size=2), ("LOCAL_WORLD_SIZE='2'",)),
        (mpich(rank=1, size=4, local_rank=1, local_size=1), ("MPI_LOCALRANKID='1'",)),
        (openmpi(rank=3, size=2), ("OMPI_COMM_WORLD_RANK='3'",)),
        (srun(nodeid=3), ("SLURM_NODEID='3'",)),
        (srun(ntasks=8), ("SLURM_STEP_TASKS_PER_NODE='3,2(x2)'", "SLURM_NTASKS='8'")),
        (srun(localid=2), ("SLURM_LOCALID='2'", "2 task(s) on node 1")),
    ],
)
def test_inconsistent_values_name_the_variables(env: dict[str, str], names: tuple[str]) -> None:
    message = _error(env)
    for name in names:
        assert name in message


@pytest.mark.parametrize(
    ("env", "present", "missing"),
    [
        ({**BASE, "RANK": "0"}, "RANK", "WORLD_SIZE"),
        ({**BASE, "WORLD_SIZE": "2"}, "WORLD_SIZE", "RANK"),
        ({**BASE, "RANK": "0", "WORLD_SIZE": "2"}, "RANK", "LOCAL_WORLD_SIZE"),
        ({**BASE, "HOROVOD_SIZE": "2"}, "HOROVOD_SIZE", "HOROVOD_RANK"),
        ({**BASE, "OMPI_COMM_WORLD_RANK": "1"}, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ({**BASE, "PMI_RANK": "1"}, "PMI_RANK", "PMI_SIZE"),
    ],
)
def test_missing_partner_variable_is_named(env: dict[str, str], present: str,
                                           missing: str) -> None:
    message = _error(env)
    assert f"{missing} is not set" in message
    assert f"{present}={env[present]!r}" in message


@pytest.mark.parametrize(
    ("make", "drop", "other"),
    [
        (horovodrun, "HOROVOD_CROSS_SIZE", "HOROVOD_CROSS_RANK"),
        (horovodrun, "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE"),
        (horovodrun, "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_GLOO_RENDEZVOUS_ADDR"),
        (torchrun, "GROUP_WORLD_SIZE", "GROUP_RANK"),
        (torchrun, "MASTER_PORT", "MASTER_ADDR"),
        (torchrun, "MASTER_ADDR", "MASTER_PORT"),
    ],
)
def test_half_of_an_optional_pair_is_an_error(make: EnvMaker, drop: str, other: str) -> None:
    env = make()
    del env[drop]
    message = _error(env)
    assert f"{other}={env[other]!r} is set but {drop} is not" in message


def test_bad_ports_and_addresses() -> None:
    for port in ("0", "65536", "http"):
        message = _error({**torchrun(), "MASTER_PORT": port})
        assert "MASTER_PORT" in message and repr(port) in message
    message = _error({**horovodrun(), "HOROVOD_GLOO_RENDEZVOUS_ADDR": " "})
    assert "HOROVOD_GLOO_RENDEZVOUS_ADDR" in message


def test_errors_tell_how_to_fix() -> None:
    assert "horovodrun -np N" in _error(horovodrun(rank=9))
    assert "torchrun --nproc_per_node N" in _error(torchrun(rank=9))
    assert "mpirun -np N" in _error(openmpi(rank=9))
    assert "mpiexec -n N" in _error(mpich(rank=9))
    assert "Intel MPI" in _error(intelmpi(rank=9))
    assert "srun" in _error(srun(procid=9))


def test_whitespace_around_numbers_is_accepted() -> None:
    env = torchrun()
    env["RANK"] = " 1\n"
    assert detect(env).rank == 1


# -- Topology itself -------------------------------------------------------------

def test_topology_validates_itself() -> None:
    good: dict[str, Any] = dict(launcher="torchrun", rank=1, size=2, local_rank=1,
                                local_size=2, cross_rank=0, cross_size=1)
    Topology(**good)
    changes: list[tuple[dict[str, Any], str]] = [
        ({"launcher": "pbs"}, "'pbs'"),
        ({"rank": 2}, "rank=2"),
        ({"rank": -1}, "-1"),
        ({"size": 0}, "size=0"),
        ({"local_rank": 2}, "local_rank=2"),
        ({"local_size": 3}, "local_size=3"),
        ({"cross_rank": 1}, "cross_rank=1"),
        ({"cross_size": 3}, "cross_size=3"),
        ({"rank": True}, "True"),
        ({"rendezvous_port": 70000}, "70000"),
    ]
    for change, words in changes:
        with pytest.raises(LaunchError, match=words):
            Topology(**{**good, **change})


def test_topology_is_frozen() -> None:
    topo = Topology.single()
    with pytest.raises(AttributeError):
        topo.rank = 1  # type: ignore[misc]
