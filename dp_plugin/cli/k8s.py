"""``dp-plugin k8s render``: a Kubernetes manifest that runs a dp_plugin job.

Three job kinds, each the way its controller expects a torch or MPI job:

- ``trainjob``: Kubeflow Trainer v2's ``TrainJob`` on the ``torch-distributed``
  runtime. The runtime sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
  ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` in every node
  pod (pods ``<job>-node-<i>-0.<job>``), and the container runs ``torchrun``,
  which reads them; ``/dev/shm`` comes through a runtime patch.
- ``pytorchjob``: the Training Operator's ``PyTorchJob`` (``kubeflow.org/v1``),
  one Master and N-1 Workers, ``nprocPerNode`` processes each under torchrun;
  the operator sets ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` and
  the ``PET_*`` variables, on the port named ``pytorchjob-port``.
- ``mpijob``: the MPI Operator's ``MPIJob`` (``kubeflow.org/v2beta1``): a
  launcher pod runs ``mpirun`` over N worker pods of ``slotsPerWorker`` slots
  each, from the hostfile the operator mounts at ``/etc/mpi/hostfile``, which
  is how Horovod ran on Kubernetes.

Each pod that runs ranks mounts a memory-backed ``/dev/shm`` sized for
dp_plugin's shared-memory transport (``shm_bytes``): a container's default
64 MiB halves its chunks several times over (docs/configuration.md,
``DP_PLUGIN_SHARED_MEMORY_BUDGET``).

Elastic (``--max-restarts N``, trainjob and pytorchjob): torchrun in every
pod restarts its ranks, up to N times, when one fails, and ``hvd.elastic``
resumes them from the last commit. torchrun keeps its static rendezvous
(node ranks from the controller's variables, the store on node 0), which
keeps rank 0, who writes and reads the commit, in node 0's pod.
``--commit-claim`` mounts a PersistentVolumeClaim for a ``commit_path``
that outlives the pods (docs/elastic.md, "On Kubernetes").

    dp-plugin k8s render --kind trainjob --image registry/me/train:1 --nodes 2 \\
        --procs-per-node 4 --cpu 16 --memory 64Gi -- python train.py --epochs 3
    dp-plugin k8s render --kind mpijob --mpi openmpi --image IMG --nodes 4 \\
        --procs-per-node 8 --gpus-per-node 8 -o job.yaml -- python train.py

The manifest goes to standard output (or ``-o FILE``) as YAML, or JSON with
``--format json``; both are what ``kubectl apply -f`` reads.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

HELP = "write a Kubernetes manifest (TrainJob, PyTorchJob or MPIJob) for a dp_plugin job"

KINDS = ("trainjob", "pytorchjob", "mpijob")
MPI_IMPLEMENTATIONS = {"openmpi": "OpenMPI", "intel": "Intel", "mpich": "MPICH"}
"""``--mpi`` -> the MPIJob's ``mpiImplementation``."""
TRAINJOB_RUNTIME = "torch-distributed"
"""The ClusterTrainingRuntime that Kubeflow Trainer installs for torch jobs."""
PYTORCHJOB_PORT = 23456
"""The Training Operator's default ``pytorchjob-port``, which becomes MASTER_PORT."""
TRAINJOB_PORT = 29400
"""The torch runtime's ``PET_MASTER_PORT``."""
COMMIT_DIR = "/var/lib/dp-plugin"
"""Where ``--commit-claim`` mounts its volume unless ``--commit-dir`` says."""
GiB = 1 << 30

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")


def shm_bytes(procs_per_node: int) -> int:
    """``/dev/shm`` for a node of ``procs_per_node`` ranks, rounded up to a GiB.

    The shared-memory transport keeps one segment of 2 x (ranks + 1) full
    chunks per channel (the engine's and the optimizer's: two), within a
    budget of a quarter of ``/dev/shm``; one GiB more is left for DataLoader
    workers, which pass batches through ``/dev/shm`` too.
    """
    from dp_plugin.engines.shm import BUDGET_SHARE, CHUNK_BYTES

    segments = 2 * 2 * (procs_per_node + 1) * CHUNK_BYTES
    return -(-(BUDGET_SHARE * segments + GiB) // GiB) * GiB


def _quantity(text: str) -> str:
    if not _QUANTITY.match(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a Kubernetes quantity; expected a number with an optional "
            "suffix, e.g. 8, 500m, 64Gi")
    return text


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return value


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not re.match(r"^[A-Za-z_][A-Za-z0-9_.-]*$", name):
        raise argparse.ArgumentTypeError(
            f"--env {text!r}: expected NAME=VALUE, e.g. --env DP_PLUGIN_TIMEOUT=600")
    return name, value


def _job_name(text: str) -> str:
    if len(text) > 40 or not _NAME.match(text):
        raise argparse.ArgumentTypeError(
            f"--name {text!r}: a job name must be lower-case letters, digits and '-', "
            "start and end with a letter or digit, and have at most 40 characters "
            "(the pods' names add to it)")
    return text


def _claim(text: str) -> str:
    if len(text) > 253 or not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", text):
        raise argparse.ArgumentTypeError(
            f"--commit-claim {text!r}: a PersistentVolumeClaim's name is lower-case letters, "
            "digits, '-' and '.', starting and ending with a letter or digit")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    verbs = parser.add_subparsers(dest="k8s_command", metavar="VERB", required=True)
    p = verbs.add_parser("render", help="write the manifest", description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=KINDS, required=True, help="the job kind")
    p.add_argument("--image", required=True, help="the container image holding the code")
    p.add_argument("--nodes", type=_count, required=True, help="pods (one per node)")
    p.add_argument("--procs-per-node", type=_count, required=True,
                   help="ranks per pod (GPUs per node on GPU nodes)")
    p.add_argument("--name", type=_job_name, default="dp-plugin-job", help="the job's name")
    p.add_argument("--namespace", default=None, help="the Kubernetes namespace")
    p.add_argument("--cpu", type=_quantity, default=None,
                   help="CPUs per node pod (default: the procs per node)")
    p.add_argument("--memory", type=_quantity, default=None, help="memory per node pod")
    p.add_argument("--gpus-per-node", type=int, default=0, help="nvidia.com/gpu per node pod")
    p.add_argument("--shm-size", type=_quantity, default=None,
                   help="the /dev/shm of each node pod (default: sized for the shared-"
                        "memory transport at --procs-per-node ranks, see docs/cli.md)")
    p.add_argument("--port", type=int, default=None,
                   help=f"the rendezvous port (default {TRAINJOB_PORT} for a TrainJob, "
                        f"{PYTORCHJOB_PORT} for a PyTorchJob)")
    p.add_argument("--mpi", choices=sorted(MPI_IMPLEMENTATIONS), default="openmpi",
                   help="the MPI in the image (mpijob only)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="torchrun's --max-restarts: restarts of a node's ranks before the "
                        "job fails (trainjob and pytorchjob)")
    p.add_argument("--commit-claim", type=_claim, default=None, metavar="CLAIM",
                   help="a PersistentVolumeClaim mounted in every node pod at --commit-dir, "
                        "for an elastic commit_path that outlives the pods (trainjob and "
                        "pytorchjob; see docs/elastic.md)")
    p.add_argument("--commit-dir", default=None,
                   help=f"with --commit-claim: where it is mounted (default {COMMIT_DIR})")
    p.add_argument("--env", type=_env_pair, action="append", default=[],
                   help="NAME=VALUE for every rank (repeatable)")
    p.add_argument("--format", choices=("yaml", "json"), default="yaml")
    p.add_argument("-o", "--output", type=Path, default=None, help="write here, not stdout")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="after --: what each rank runs, e.g. -- python train.py --epochs 3")


def torchrun_command(command: list[str], max_restarts: int) -> list[str]:
    """The container command under torchrun, which reads its node count, rank and
    master from the ``PET_*`` variables the controller sets: ``python x.py`` ->
    ``torchrun x.py``; a command that is not Python runs with ``--no-python``."""
    restarts = [f"--max-restarts={max_restarts}"] if max_restarts else []
    first = Path(command[0]).name
    if first == "torchrun":
        return [command[0], *restarts, *command[1:]]
    if re.match(r"^python(\d+(\.\d+)?)?$", first):
        if len(command) > 2 and command[1] == "-m":
            return ["torchrun", *restarts, "--module", *command[2:]]
        return ["torchrun", *restarts, *command[1:]]
    return ["torchrun", *restarts, "--no-python", *command]


def _resources(args: argparse.Namespace) -> dict[str, Any]:
    amounts = {"cpu": args.cpu or str(args.procs_per_node), "memory": args.memory,
               "nvidia.com/gpu": str(args.gpus_per_node) if args.gpus_per_node else None}
    given = {name: amount for name, amount in amounts.items() if amount}
    return {"requests": dict(given), "limits": dict(given)}


def _shm(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The memory-backed volume for /dev/shm, and its mount."""
    size = args.shm_size or f"{shm_bytes(args.procs_per_node) // GiB}Gi"
    volume = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size}}
    return volume, {"name": "dshm", "mountPath": "/dev/shm"}


def _volumes(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A node pod's volumes and its container's mounts: ``/dev/shm`` and,
    with ``--commit-claim``, the claim that holds the elastic commits."""
    volume, mount = _shm(args)
    volumes, mounts = [volume], [mount]
    if args.commit_claim:
        volumes.append({"name": "commits",
                        "persistentVolumeClaim": {"claimName": args.commit_claim}})
        mounts.append({"name": "commits", "mountPath": args.commit_dir or COMMIT_DIR})
    return volumes, mounts


def _env(args: argparse.Namespace) -> list[dict[str, str]]:
    return [{"name": name, "value": value} for name, value in args.env]


def _metadata(args: argparse.Namespace) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": args.name, "labels": {"app.kubernetes.io/name": args.name,
                                                          "app.kubernetes.io/part-of": "dp-plugin"}}
    if args.namespace:
        meta["namespace"] = args.namespace
    return meta


def trainjob(args: argparse.Namespace) -> dict[str, Any]:
    volumes, mounts = _volumes(args)
    trainer: dict[str, Any] = {
        "image": args.image,
        "command": torchrun_command(args.command, args.max_restarts),
        "numNodes": args.nodes,
        "numProcPerNode": args.procs_per_node,
        "resourcesPerNode": _resources(args),
    }
    if args.env:
        trainer["env"] = _env(args)
    # The runtime's replicated job and container are both named "node".
    pod = {"volumes": volumes, "containers": [{"name": "node", "volumeMounts": mounts}]}
    if args.port not in (None, TRAINJOB_PORT):
        pod["containers"][0]["env"] = [{"name": "PET_MASTER_PORT", "value": str(args.port)}]
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": _metadata(args),
        "spec": {
            "runtimeRef": {"name": TRAINJOB_RUNTIME, "apiGroup": "trainer.kubeflow.org",
                           "kind": "ClusterTrainingRuntime"},
            "trainer": trainer,
            "runtimePatches": [{
                "manager": "dp-plugin",
                "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{
                    "name": "node",
                    "template": {"spec": {"template": {"spec": pod}}},
                }]}}},
            }],
        },
    }


def pytorchjob(args: argparse.Namespace) -> dict[str, Any]:
    volumes, mounts = _volumes(args)
    port = args.port or PYTORCHJOB_PORT
    container: dict[str, Any] = {
        "name": "pytorch",  # the operator finds its container by this name
        "image": args.image,
        "command": torchrun_command(args.command, args.max_restarts),
        "ports": [{"name": "pytorchjob-port", "containerPort": port}],
        "resources": _resources(args),
        "volumeMounts": mounts,
    }
    if args.env:
        container["env"] = _env(args)
    template = {"spec": {"containers": [container], "volumes": volumes}}
    replicas = {role: {"replicas": count, "restartPolicy": "OnFailure", "template": template}
                for role, count in (("Master", 1), ("Worker", args.nodes - 1)) if count}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _metadata(args),
        "spec": {"nprocPerNode": str(args.procs_per_node),
                 "runPolicy": {"cleanPodPolicy": "None"},
                 "pytorchReplicaSpecs": replicas},
    }


def mpirun_command(args: argparse.Namespace) -> list[str]:
    """The launcher's command: every slot of the hostfile the operator mounts."""
    ranks = str(args.nodes * args.procs_per_node)
    command = args.command
    if args.mpi == "openmpi":
        # Open MPI forwards only the variables named with -x; bind-to none lets
        # a rank's threads (intra-op, the engine's) use the pod's CPUs.
        forwarded = [flag for name, _ in args.env for flag in ("-x", name)]
        return ["mpirun", "-np", ranks, "--bind-to", "none", "--map-by", "slot",
                *forwarded, *command]
    return ["mpirun", "-n", ranks, "-ppn", str(args.procs_per_node), *command]


def mpijob(args: argparse.Namespace) -> dict[str, Any]:
    volume, mount = _shm(args)
    launcher: dict[str, Any] = {
        "name": "launcher",
        "image": args.image,
        "command": mpirun_command(args),
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"},
                      "limits": {"cpu": "1", "memory": "1Gi"}},
    }
    worker: dict[str, Any] = {
        "name": "worker",
        "image": args.image,  # its entry point runs sshd, as the MPI Operator expects
        "resources": _resources(args),
        "volumeMounts": [mount],
    }
    if args.env:
        launcher["env"] = _env(args)
        worker["env"] = _env(args)
    return {
        "apiVersion": "kubeflow.org/v2beta1",
        "kind": "MPIJob",
        "metadata": _metadata(args),
        "spec": {
            "slotsPerWorker": args.procs_per_node,
            "mpiImplementation": MPI_IMPLEMENTATIONS[args.mpi],
            "runPolicy": {"cleanPodPolicy": "Running"},
            "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "restartPolicy": "OnFailure",
                             "template": {"spec": {"containers": [launcher]}}},
                "Worker": {"replicas": args.nodes, "restartPolicy": "OnFailure",
                           "template": {"spec": {"containers": [worker],
                                                 "volumes": [volume]}}},
            },
        },
    }


RENDERERS = {"trainjob": trainjob, "pytorchjob": pytorchjob, "mpijob": mpijob}


def render(args: argparse.Namespace) -> dict[str, Any]:
    """The manifest for parsed ``args``; ``SystemExit`` naming a bad combination."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("dp-plugin k8s render: give the command each rank runs after --, "
                         "e.g. `dp-plugin k8s render ... -- python train.py`")
    args.command = command
    if args.gpus_per_node < 0:
        raise SystemExit(f"--gpus-per-node {args.gpus_per_node}: must be >= 0")
    if args.port is not None and not 1 <= args.port <= 65535:
        raise SystemExit(f"--port {args.port}: must be a TCP port, 1..65535")
    if args.port is not None and args.kind == "mpijob":
        raise SystemExit("--port: an MPIJob needs no rendezvous port (the ranks meet "
                         "through MPI); drop --port or use --kind trainjob/pytorchjob")
    if args.max_restarts < 0 or (args.max_restarts and args.kind == "mpijob"):
        raise SystemExit(f"--max-restarts {args.max_restarts}: must be >= 0, and only "
                         "trainjob/pytorchjob restart ranks (torchrun's --max-restarts)")
    if args.commit_claim and args.kind == "mpijob":
        raise SystemExit("--commit-claim: an MPIJob restarts no ranks; elastic commits need "
                         "--kind trainjob or pytorchjob with --max-restarts")
    if args.commit_dir is not None and (not args.commit_claim
                                        or not args.commit_dir.startswith("/")):
        raise SystemExit(f"--commit-dir {args.commit_dir!r}: expected an absolute path, and "
                         "--commit-claim CLAIM, the volume to mount there")
    return RENDERERS[args.kind](args)


def dump(manifest: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(manifest, indent=2) + "\n"
    try:
        import yaml
    except ImportError:
        raise SystemExit("--format yaml needs PyYAML (`pip install pyyaml`); or use "
                         "--format json, which kubectl reads as well") from None
    return str(yaml.safe_dump(manifest, sort_keys=False, default_flow_style=False))


def run(args: argparse.Namespace) -> int:
    text = dump(render(args), args.format)
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
    return 0
