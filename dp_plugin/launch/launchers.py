"""Launch detection: who started this process, and where it sits.

One class per launcher, each able to detect itself from the environment
(horovodrun, torchrun, mpirun/mpiexec of Open MPI, MPICH/Hydra or Intel MPI,
SLURM srun), and a single-process fallback. ``detect()`` returns a
``Topology``; a malformed or inconsistent variable raises ``LaunchError``
naming the variable, the value and the fix.

Which variables each launcher exports was checked against the real tools
(``horovodrun --gloo -np 2 -H localhost:2 env``, ``torchrun --nproc_per_node 2
--no-python env``, MPICH 5.0.2 ``mpiexec -n 2 env``); Open MPI, Intel MPI and
SLURM follow their documentation.

Priority (``LAUNCHERS``) matters because launchers nest:

1. horovodrun — it may itself run under mpirun or srun, and its own
   variables are the ones that describe the Horovod job;
2. torchrun — likewise it may run inside an MPI or SLURM job;
3. Open MPI, Intel MPI, MPICH — ``mpirun`` inside a SLURM allocation starts
   its daemons through srun, so the SLURM variables describe the daemons and
   the MPI variables describe the ranks;
4. SLURM srun, only for an srun job step (not the batch script itself);
5. a Kubeflow TrainJob/PyTorchJob pod whose command started no torchrun
   (``PET_NNODES``): an error unless the job is one process;
6. no launcher, but a torch.distributed default group the program made
   itself: its rank and size (``ProcessGroup``);
7. a single process.

Cross rank/size follow Horovod's meaning: with every host running the same
number of processes they are the index of this host and the number of hosts.
Where a launcher does not export them (MPI, or torchrun without
``GROUP_RANK``) they are derived assuming *block* placement (ranks fill one
host before the next, the default of every launcher here) and hosts of equal
size: ``cross_rank = (rank - local_rank) // local_size`` and
``cross_size = ceil(size / local_size)``. With hosts of unequal size that is
only an estimate; nothing in the core depends on it.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
import sys
from collections.abc import Mapping
from typing import ClassVar

from dp_plugin.errors import LaunchError
from dp_plugin.launch.topology import LAUNCHER_NAMES as LAUNCHER_NAMES  # re-exported
from dp_plugin.launch.topology import Sourced, VariableReader, build_topology
from dp_plugin.launch.topology import Topology as Topology  # re-exported


class Launcher:
    """One launcher: can it have started this process, and where does it sit.

    ``detect`` must be cheap and must not raise: it only looks for the
    launcher's marker variables. ``topology`` reads and validates all of them
    and raises ``LaunchError`` on anything malformed. A launcher that exports
    the topology as plain integers only names its variables (``variables``,
    ``cross_variables``, ``address_variables``, ``hostname_variable``).
    """

    name: ClassVar[str]
    """The ``Topology.launcher`` value."""
    markers: ClassVar[tuple[str, ...]]
    """Variables whose presence means this launcher started the process."""
    command: ClassVar[str]
    """How a user starts a job with it (for messages and ``make check``)."""
    fix: ClassVar[str]
    """The advice appended to every error about its variables."""
    variables: ClassVar[tuple[str, str, str, str]]
    """The variables of the size, the rank, the local size and the local rank."""
    cross_variables: ClassVar[tuple[str, str] | None] = None
    """The cross rank and cross size variables, if exported (else they are derived)."""
    address_variables: ClassVar[tuple[str, str] | None] = None
    """The rendezvous address and port variables, if exported."""
    hostname_variable: ClassVar[str | None] = None
    reads: ClassVar[tuple[str, ...]] = ()
    """Every variable ``detect`` or ``topology`` may look up (markers included);
    built from the variables above unless a launcher lists its own. A unit test
    checks that nothing else is looked up (``variables.LAUNCHER_VARIABLE_NAMES``)."""
    read_prefixes: ClassVar[tuple[str, ...]] = ()
    """Prefixes of variables whose mere presence ``detect`` looks for."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "reads" not in cls.__dict__ and hasattr(cls, "variables"):
            cls.reads = (
                *cls.variables, *(cls.cross_variables or ()), *(cls.address_variables or ()),
                *((cls.hostname_variable,) if cls.hostname_variable else ()),
            )

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> bool:
        """True if ``env`` (default ``os.environ``) says this launcher started us."""
        return cls._detect(os.environ if env is None else env)

    @classmethod
    def _detect(cls, env: Mapping[str, str]) -> bool:
        return any(name in env for name in cls.markers)

    @classmethod
    def topology(cls, env: Mapping[str, str]) -> Topology:
        """Read this launcher's variables from ``env``; ``LaunchError`` if malformed."""
        r = VariableReader(env, cls)
        size_var, rank_var, local_size_var, local_rank_var = cls.variables
        size = r.required(size_var, minimum=1)
        rank = r.required(rank_var)
        local_size = r.required(local_size_var, minimum=1)
        local_rank = r.required(local_rank_var)
        cross = r.pair(*cls.cross_variables) if cls.cross_variables else None
        addr, port = r.address(*cls.address_variables) if cls.address_variables else (None, None)
        return build_topology(
            cls, size=size, rank=rank, local_size=local_size, local_rank=local_rank,
            cross=cross, addr=addr, port=port,
            hostname=r.text(cls.hostname_variable) if cls.hostname_variable else None,
        )


class Horovod(Launcher):
    """horovodrun (Gloo mode exports every HOROVOD_* below to each worker).

    Under ``horovodrun --mpi`` Horovod exports no rank variables (MPI gives
    them), so such a job is detected as the MPI flavour that runs it.
    """

    name = "horovodrun"
    markers = ("HOROVOD_RANK", "HOROVOD_SIZE")
    variables = ("HOROVOD_SIZE", "HOROVOD_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_LOCAL_RANK")
    cross_variables = ("HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")
    address_variables = ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT")
    hostname_variable = "HOROVOD_HOSTNAME"
    command = "horovodrun -np N python train.py"
    fix = (
        "horovodrun sets HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK and HOROVOD_LOCAL_SIZE "
        f"for every worker: start the job with `{command}`, "
        "or unset these variables to run a single process"
    )


KUBEFLOW_VARIABLES = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK")
"""What a Kubeflow TrainJob or PyTorchJob sets in every node pod for torchrun,
which reads them as its --nnodes, --nproc-per-node and --node-rank."""


class Torchrun(Launcher):
    """torchrun / torch.distributed.run, or a hand-made ``env://`` launch.

    torchrun exports RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    GROUP_RANK, GROUP_WORLD_SIZE (the agent, i.e. host, index and count),
    MASTER_ADDR and MASTER_PORT. A hand-made launch must set the first four.
    """

    name = "torchrun"
    markers = ("RANK", "WORLD_SIZE")
    variables = ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK")
    cross_variables = ("GROUP_RANK", "GROUP_WORLD_SIZE")
    address_variables = ("MASTER_ADDR", "MASTER_PORT")
    reads = (*variables, *cross_variables, *address_variables, "KUBERNETES_SERVICE_HOST",
             *KUBEFLOW_VARIABLES)
    command = "torchrun --nproc_per_node N train.py"
    fix = (
        "torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE for every worker: "
        f"start the job with `{command}`, set all four consistently, "
        "or unset them to run a single process"
    )

    @classmethod
    def topology(cls, env: Mapping[str, str]) -> Topology:
        if ("LOCAL_RANK" not in env and "LOCAL_WORLD_SIZE" not in env
                and "KUBERNETES_SERVICE_HOST" in env):
            return cls._one_process_per_pod(env)
        topology = super().topology(env)
        _check_kubeflow_agrees(env)
        return topology

    @classmethod
    def _one_process_per_pod(cls, env: Mapping[str, str]) -> Topology:
        """A PyTorchJob pod whose container runs the script itself, not torchrun:
        the operator sets RANK (the pod's index), WORLD_SIZE (the pods) and
        MASTER_ADDR/MASTER_PORT (the Master pod), and one process runs per pod."""
        procs = env.get("PET_NPROC_PER_NODE", "1").strip()
        if procs.isdigit() and int(procs) > 1:
            raise LaunchError(
                f"PET_NPROC_PER_NODE={procs!r} asks for {procs} processes in this pod, but it "
                "runs one (torchrun's LOCAL_RANK is not set): start the container's command "
                "with torchrun (`torchrun train.py ...`, as `dp-plugin k8s render` writes it), "
                "or set the job's nprocPerNode to 1"
            )
        r = VariableReader(env, cls)
        size, rank = r.required("WORLD_SIZE", minimum=1), r.required("RANK")
        addr, port = r.address("MASTER_ADDR", "MASTER_PORT")
        return build_topology(
            cls, size=size, rank=rank, local_size=Sourced("local size (one process per pod)", 1),
            local_rank=Sourced("local rank (one process per pod)", 0),
            cross=(Sourced("RANK (the pod's index)", rank.value, env["RANK"]),
                   Sourced("WORLD_SIZE (the pods)", size.value, env["WORLD_SIZE"])),
            addr=addr, port=port, hostname=None,
        )


def _check_kubeflow_agrees(env: Mapping[str, str]) -> None:
    """Under torchrun in a Kubeflow job, torchrun's layout must be the job's:
    a command that passes its own --nnodes or --nproc-per-node overrides the
    PET_* variables and starts a job of another shape than the pods were made for."""
    for pet, torchrun_name in zip(KUBEFLOW_VARIABLES,
                                  ("GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"),
                                  strict=True):
        asked, got = env.get(pet, "").strip(), env.get(torchrun_name, "").strip()
        if asked.isdigit() and got.isdigit() and int(asked) != int(got):
            raise LaunchError(
                f"{pet}={asked!r} (what the Kubeflow job set for this pod) disagrees with "
                f"torchrun's {torchrun_name}={got!r}: the container's command overrides the "
                "job's layout; drop torchrun's --nnodes, --nproc-per-node and --node-rank "
                "flags from it, so that torchrun reads the PET_* variables"
            )


class OpenMPI(Launcher):
    """Open MPI's mpirun/mpiexec (OMPI_COMM_WORLD_*); cross values are derived."""

    name = "openmpi"
    markers = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
    variables = (
        "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
    )
    command = "mpirun -np N python train.py"
    fix = (
        "Open MPI's mpirun sets OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, "
        "OMPI_COMM_WORLD_LOCAL_RANK and OMPI_COMM_WORLD_LOCAL_SIZE for every process: "
        f"start the job with `{command}` and do not set them by hand"
    )


class MPICH(Launcher):
    """MPICH's Hydra mpiexec: PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS.

    ``srun --mpi=pmi2`` also exports PMI_* but not Hydra's MPI_LOCAL*
    variables; inside an srun step such a process is left to ``Slurm``.
    """

    name = "mpich"
    markers = ("PMI_RANK", "PMI_SIZE")
    variables = ("PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS", "MPI_LOCALRANKID")
    hostname_variable = "PMI_HOSTNAME"
    command = "mpiexec -n N python train.py"
    fix = (
        "MPICH's mpiexec (Hydra) sets PMI_RANK, PMI_SIZE, MPI_LOCALRANKID and MPI_LOCALNRANKS "
        f"for every process: start the job with `{command}` and do not set them by hand"
    )

    @classmethod
    def _detect(cls, env: Mapping[str, str]) -> bool:
        if not super()._detect(env):
            return False
        hydra = "MPI_LOCALRANKID" in env or "MPI_LOCALNRANKS" in env
        return hydra or not Slurm._detect(env)


class IntelMPI(MPICH):
    """Intel MPI: Hydra-based, MPICH's variables plus I_MPI_* ones."""

    name = "intelmpi"
    read_prefixes = ("I_MPI_",)
    fix = MPICH.fix.replace("MPICH's mpiexec (Hydra)", "Intel MPI's mpiexec (Hydra)")

    @classmethod
    def _detect(cls, env: Mapping[str, str]) -> bool:
        return super()._detect(env) and any(k.startswith("I_MPI_") for k in env)


class Slurm(Launcher):
    """SLURM ``srun`` job step (not the batch script, nor an salloc shell).

    Reads SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID and
    SLURM_STEP_NUM_NODES (or SLURM_NNODES); the local size comes from
    SLURM_STEP_TASKS_PER_NODE (exact for the step, e.g. ``2(x3),1``), else
    SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE.

    The rendezvous is MASTER_ADDR/MASTER_PORT when the job script sets them
    (both, explicit values win). Otherwise it is derived as Lightning's
    SLURM environment does, so that ``srun python train.py`` needs nothing
    exported: the address is the first host of the step's node list
    (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST, expanded by
    ``expand_hostlist``), where rank 0 runs under block placement, and the
    port is ``15000 + SLURM_JOB_ID % 10000``. Neither is always right, and
    docs/multinode.md says when to export them instead: rank 0 elsewhere
    than on the first listed node (``--distribution=arbitrary``), and two
    steps or jobs (ids equal modulo 10000) starting on the same first node
    at once, which derive the same port.
    """

    name = "slurm"
    markers = ("SLURM_PROCID",)
    reads = (
        "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_NTASKS", "SLURM_LOCALID",
        "SLURM_NODEID", "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_STEP_TASKS_PER_NODE",
        "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "MASTER_ADDR", "MASTER_PORT",
        "SLURMD_NODENAME", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_JOB_ID",
    )
    command = "srun --ntasks N python train.py"
    fix = (
        "srun sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_NNODES and "
        f"SLURM_STEP_TASKS_PER_NODE for every task: start the workers with `{command}` "
        "inside an allocation and do not set them by hand"
    )
    # Step ids at or above this are Slurm's pseudo-steps (batch script, extern
    # container, interactive step): no srun task layout there.
    _PSEUDO_STEP = 0xFFFFFFF0
    _TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    _NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
    PORT_BASE = 15000
    """The derived port is ``PORT_BASE + SLURM_JOB_ID % 10000`` (Lightning's choice)."""

    @classmethod
    def _step_var(cls, env: Mapping[str, str]) -> str | None:
        return next((n for n in ("SLURM_STEP_ID", "SLURM_STEPID") if n in env), None)

    @classmethod
    def _detect(cls, env: Mapping[str, str]) -> bool:
        step_var = cls._step_var(env)
        if "SLURM_PROCID" not in env or step_var is None:
            return False
        try:
            return int(env[step_var].strip()) < cls._PSEUDO_STEP
        except ValueError:
            return True  # malformed: let topology() report it

    @classmethod
    def topology(cls, env: Mapping[str, str]) -> Topology:
        r = VariableReader(env, cls)
        step_var = cls._step_var(env)
        if step_var is not None:
            r.required(step_var)
        size = r.required("SLURM_NTASKS", minimum=1)
        rank = r.required("SLURM_PROCID")
        local_rank = r.required("SLURM_LOCALID")
        nodes_var = "SLURM_STEP_NUM_NODES" if "SLURM_STEP_NUM_NODES" in env else "SLURM_NNODES"
        cross_size = r.required(nodes_var, minimum=1)
        cross_rank = r.required("SLURM_NODEID")
        local_size = cls._local_size(
            r, size=size, rank=rank, local_rank=local_rank, node=cross_rank, nodes=cross_size)
        addr, port = r.address("MASTER_ADDR", "MASTER_PORT")
        if addr is None:
            addr, port = cls._derived_address(r)
        return build_topology(
            cls, size=size, rank=rank, local_size=local_size, local_rank=local_rank,
            cross=(cross_rank, cross_size), addr=addr, port=port,
            hostname=r.text("SLURMD_NODENAME"),
        )

    @classmethod
    def _derived_address(cls, r: VariableReader) -> tuple[str | None, int | None]:
        """The first host of the node list and a port from the job id; (None,
        None) when SLURM exported neither a node list nor a job id (the
        rendezvous then asks for MASTER_ADDR/MASTER_PORT)."""
        env = r.env
        name = next((n for n in cls._NODELISTS if env.get(n, "").strip()), None)
        if name is None or "SLURM_JOB_ID" not in env:
            return None, None
        try:
            first = expand_hostlist(env[name])[0]
        except ValueError as exc:
            raise r.error(f"{name}={env[name]!r} is not a SLURM host list ({exc})") from None
        job = r.required("SLURM_JOB_ID")
        return first, cls.PORT_BASE + job.value % 10000

    @classmethod
    def _local_size(
        cls, r: VariableReader, *, size: Sourced, rank: Sourced, local_rank: Sourced,
        node: Sourced, nodes: Sourced,
    ) -> Sourced:
        name = next((n for n in cls._TASKS_PER_NODE if n in r.env), None)
        if name is None:
            raise r.error(
                f"none of {', '.join(cls._TASKS_PER_NODE)} is set, so the number of tasks "
                "on this node is unknown"
            )
        raw = r.env[name]
        # Runs of (tasks per node, nodes), never expanded: a malformed count
        # of nodes (SLURM_STEP_NUM_NODES=3623878656) must not become a list.
        runs = parse_tasks_per_node(raw, name)
        if len(runs) == 1 and runs[0][1] == 1 and name == "SLURM_NTASKS_PER_NODE":
            # --ntasks-per-node is an upper bound: under block placement the
            # last node holds what is left.
            n = min(runs[0][0], size.value - (rank.value - local_rank.value))
            return Sourced(name, n, raw, note=f"{n} task(s) on this node")
        if len(runs) == 1 and runs[0][1] == 1:
            runs = [(runs[0][0], nodes.value)]  # a plain '4' means 4 on every node
        ends = list(itertools.accumulate(repeat for _, repeat in runs))  # of each run's nodes
        tasks = sum(count * repeat for count, repeat in runs)
        if ends[-1] != nodes.value or tasks != size.value:
            raise r.error(
                f"{name}={raw!r} describes {ends[-1]} node(s) running {tasks} task(s) "
                f"in all, but {nodes.label} and {size.label}"
            )
        if node.value >= ends[-1]:
            raise r.error(f"{node.label} must be less than {nodes.label}")
        count = next(count for (count, _), end in zip(runs, ends, strict=True) if node.value < end)
        return Sourced(name, count, raw, note=f"{count} task(s) on node {node.value}")


class KubeflowPod(Launcher):
    """A Kubeflow TrainJob or PyTorchJob pod whose command started no launcher.

    The job set ``PET_*`` for torchrun, but the container ran ``python
    train.py``: every pod would train alone, silently. Raises unless the job
    is one process in all.
    """

    name = "kubeflow"
    markers = ("PET_NNODES",)
    reads = KUBEFLOW_VARIABLES
    command = "torchrun train.py (in the job's container command)"
    fix = ("start the container's command with torchrun (`torchrun train.py ...`, as "
           "`dp-plugin k8s render` writes it): torchrun reads the PET_* variables")

    @classmethod
    def topology(cls, env: Mapping[str, str]) -> Topology:
        nodes, procs = (env.get(n, "1").strip() for n in KUBEFLOW_VARIABLES[:2])
        if nodes == "1" and procs in ("1", "auto", "cpu"):
            return Topology.single()
        raise LaunchError(
            f"PET_NNODES={nodes!r} and PET_NPROC_PER_NODE={procs!r} say this pod is part of a "
            "Kubeflow job of several processes, but no launcher started this process (RANK, "
            f"WORLD_SIZE and LOCAL_RANK are not set); {cls.fix}"
        )


class ProcessGroup(Launcher):
    """No launcher variables, but the program made torch.distributed's default
    group itself (``init_process_group("gloo", init_method="tcp://...")``, or
    a library such as Accelerate did): dp_plugin adopts it.

    Rank and size are the group's; the local topology comes from one
    ``all_gather_object`` of the host names over the group (collective:
    every rank's ``init()`` runs it): local rank and size count the ranks
    on this host, cross rank is this host's index in order of first rank,
    cross size the number of hosts. The engine then joins the group
    (``TorchDistEngine``) and leaves it to its owner at ``shutdown()``.

    ``detect`` only looks at an already-imported torch: the core never
    imports it.
    """

    name = "process_group"
    markers = ()
    command = "torch.distributed.init_process_group(...) before hvd.init()"
    fix = ("initialize torch.distributed's default group over every process of the job "
           "before hvd.init(), or start the job with a launcher")

    @classmethod
    def _detect(cls, env: Mapping[str, str]) -> bool:
        dist = sys.modules.get("torch.distributed")
        if dist is None:
            return False
        try:
            return bool(dist.is_available() and dist.is_initialized())
        except Exception:  # a half-imported torch: not ours to judge here
            return False

    @classmethod
    def topology(cls, env: Mapping[str, str]) -> Topology:
        import torch.distributed as dist

        rank, size = dist.get_rank(), dist.get_world_size()
        hosts: list[str | None] = [None] * size
        dist.all_gather_object(hosts, socket.gethostname())
        mine = hosts[rank]
        order = list(dict.fromkeys(hosts))  # hosts in order of their first rank
        local_ranks = [r for r, h in enumerate(hosts) if h == mine]
        return build_topology(
            cls, size=Sourced("world size", size), rank=Sourced("rank", rank),
            local_size=Sourced("ranks on this host", len(local_ranks)),
            local_rank=Sourced("index on this host", local_ranks.index(rank)),
            cross=(Sourced("host index", order.index(mine)), Sourced("hosts", len(order))),
            addr=None, port=None, hostname=mine,
        )


class Single(Launcher):
    """No launcher: one process, rank 0 of 1."""

    name = "single"
    markers = ()
    command = "python train.py"
    fix = "nothing to fix: a single process needs no variables"

    @classmethod
    def _detect(cls, env: Mapping[str, str]) -> bool:
        return True

    @classmethod
    def topology(cls, env: Mapping[str, str]) -> Topology:
        return Topology.single()


LAUNCHERS: tuple[type[Launcher], ...] = (
    Horovod, Torchrun, OpenMPI, IntelMPI, MPICH, Slurm, KubeflowPod, ProcessGroup, Single,
)
"""Every launcher, in detection priority order (see the module docstring)."""

def detected_launcher(env: Mapping[str, str] | None = None) -> type[Launcher]:
    """The first launcher in ``LAUNCHERS`` whose markers are in ``env``."""
    env = os.environ if env is None else env
    return next(cls for cls in LAUNCHERS if cls.detect(env))


def detect(env: Mapping[str, str] | None = None) -> Topology:
    """Who started this process and where it sits.

    Reads ``env`` (default ``os.environ``) only. Every rank of a job runs this
    on its own; a malformed variable raises ``LaunchError`` on each rank that
    sees it (the launcher then stops the job), never a hang.
    """
    env = os.environ if env is None else env
    return detected_launcher(env).topology(env)


_TASKS_ITEM = re.compile(r"^\s*(\d+)\s*(?:\(\s*x\s*(\d+)\s*\))?\s*$")


def parse_tasks_per_node(raw: str,
                         name: str = "SLURM_STEP_TASKS_PER_NODE") -> list[tuple[int, int]]:
    """SLURM's compressed task counts as runs of (tasks, nodes):
    ``'2(x3),1'`` -> ``[(2, 3), (1, 1)]``."""
    runs: list[tuple[int, int]] = []
    for item in raw.split(","):
        m = _TASKS_ITEM.match(item)
        if m is None or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise LaunchError(
                f"{name}={raw!r} is not a SLURM task count list; expected items like '4' or "
                f"'2(x3)' separated by commas (e.g. '2(x3),1'); {Slurm.fix}"
            )
        runs.append((int(m.group(1)), int(m.group(2) or 1)))
    return runs


_HOST_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_HOST_NAME = re.compile(r"(?:[^,\[]|\[[^\]]*\]|\[)+")  # up to a comma outside brackets
_BRACKETS = re.compile(r"\[([^\[\]]*)\]")


def expand_hostlist(raw: str) -> list[str]:
    """Expand a SLURM host list, as ``scontrol show hostnames`` does:
    ``'node[01-03,7],gpu5'`` -> ``['node01', 'node02', 'node03', 'node7', 'gpu5']``.

    A range keeps the zero padding of its lower bound; several bracketed
    parts in one name (``'r[1-2]n[1-2]'``) give every combination, the last
    part varying fastest. ``ValueError`` names the malformed piece.
    """
    hosts: list[str] = []
    for name in filter(None, (n.strip() for n in _HOST_NAME.findall(raw))):
        parts = _BRACKETS.split(name)  # text, bracket body, text, ..., text
        for text in parts[::2]:
            if "[" in text:
                raise ValueError(f"unclosed '[' in {name!r}")
            if "]" in text:
                raise ValueError(f"unbalanced ']' in {raw!r}")
        choices = [_expand_ranges(p, name) if i % 2 else [p] for i, p in enumerate(parts)]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    if not hosts:
        raise ValueError("no host names in it")
    return hosts


def _expand_ranges(body: str, name: str) -> list[str]:
    """``'01-03,7'`` -> ``['01', '02', '03', '7']``."""
    out: list[str] = []
    for item in body.split(","):
        m = _HOST_RANGE.match(item.strip())
        if m is None:
            raise ValueError(f"{item!r} in {name!r} is not a number or a range like 01-03")
        low_text = m.group(1)
        low, high = int(low_text), int(m.group(2) or low_text)
        if high < low:
            raise ValueError(f"range {item!r} in {name!r} runs backwards")
        out.extend(str(i).zfill(len(low_text)) for i in range(low, high + 1))
    return out
