"""The pods of a rendered Kubernetes manifest, as the rehearsal cluster runs them.

``dp-plugin k8s render`` writes a TrainJob, PyTorchJob or MPIJob; a real
cluster's controller turns it into pods, each with a name, a DNS name, a
``/dev/shm`` and the variables the controller injects. ``plan(manifest)``
says the same for each pod, so ``scripts/cluster.py --launcher k8s`` can run
the manifest's own container command in one network namespace per pod, with
that pod's host name, DNS names (in the namespace's hosts file), ``/dev/shm``
size (a tmpfs of the manifest's ``sizeLimit``) and environment.

What each controller injects (besides the manifest's own ``env``):

- TrainJob (Kubeflow Trainer v2, torch runtime): pods ``<job>-node-<i>-0`` of
  the headless service ``<job>``; ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
  ``PET_NODE_RANK``, ``PET_MASTER_ADDR=<job>-node-0-0.<job>``,
  ``PET_MASTER_PORT``.
- PyTorchJob (Training Operator): pods ``<job>-master-0`` and
  ``<job>-worker-<i>``; ``MASTER_ADDR=<job>-master-0``, ``MASTER_PORT``,
  ``WORLD_SIZE`` (pods), ``RANK`` (the pod's index) and the ``PET_*`` of its
  ``nprocPerNode``.
- MPIJob (MPI Operator v2): worker pods ``<job>-worker-<i>`` of the service
  ``<job>``, whose entry point is sshd, and a launcher pod
  ``<job>-launcher`` that runs ``mpirun`` over the hostfile the operator
  writes (``<job>-worker-<i>.<job>.<ns>.svc:<slots>`` for MPICH and Intel
  MPI, ``... slots=<slots>`` for Open MPI) and names in ``HYDRA_HOST_FILE``
  / ``I_MPI_HYDRA_HOST_FILE`` / ``OMPI_MCA_orte_default_hostfile``.

Every pod also has ``KUBERNETES_SERVICE_HOST``/``PORT`` and ``HOSTNAME``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVICE_HOST = "10.96.0.1"
"""The API server's service address every pod sees (kubeadm's default)."""
KUBE_NAMESPACE = "default"
HOSTFILE_VARIABLE = {"MPICH": "HYDRA_HOST_FILE", "Intel": "I_MPI_HYDRA_HOST_FILE",
                     "OpenMPI": "OMPI_MCA_orte_default_hostfile"}


@dataclass
class Pod:
    """One pod: where it runs and what it runs."""

    name: str
    dns_names: list[str]
    env: dict[str, str]
    command: list[str] | None
    """None for an MPIJob worker: its sshd waits for the launcher's mpirun."""
    shm_size: str | None = None
    files: dict[str, str] = field(default_factory=dict)
    """Files the controller mounts (name -> text), e.g. the MPI hostfile."""


@dataclass
class Plan:
    kind: str
    pods: list[Pod]
    procs_per_node: int


def load(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if text.lstrip().startswith("{"):
        return dict(json.loads(text))
    import yaml

    return dict(yaml.safe_load(text))


def _env_list(items: list[dict[str, str]] | None) -> dict[str, str]:
    return {item["name"]: item["value"] for item in items or []}


def _shm(pod_spec: dict[str, Any]) -> str | None:
    for volume in pod_spec.get("volumes", []):
        empty = volume.get("emptyDir", {})
        if empty.get("medium") == "Memory":
            return str(empty.get("sizeLimit")) if empty.get("sizeLimit") else None
    return None


def _base(name: str) -> dict[str, str]:
    return {"KUBERNETES_SERVICE_HOST": SERVICE_HOST, "KUBERNETES_SERVICE_PORT": "443",
            "HOSTNAME": name}


def _trainjob(job: str, spec: dict[str, Any]) -> Plan:
    trainer = spec["trainer"]
    nodes, procs = int(trainer["numNodes"]), int(trainer["numProcPerNode"])
    patch = spec["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
    pod_spec = patch["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    port = _env_list(pod_spec["containers"][0].get("env")).get("PET_MASTER_PORT", "29400")
    master = f"{job}-node-0-0.{job}"
    pods = []
    for i in range(nodes):
        name = f"{job}-node-{i}-0"
        env = {**_base(name), **_env_list(trainer.get("env")),
               "PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(procs),
               "PET_NODE_RANK": str(i), "PET_MASTER_ADDR": master, "PET_MASTER_PORT": port}
        pods.append(Pod(name, [f"{name}.{job}", name], env, list(trainer["command"]),
                        _shm(pod_spec)))
    return Plan("TrainJob", pods, procs)


def _pytorchjob(job: str, spec: dict[str, Any]) -> Plan:
    replicas = spec["pytorchReplicaSpecs"]
    roles = [("master", replicas["Master"])]
    if "Worker" in replicas:
        roles += [("worker", replicas["Worker"])]
    names = [f"{job}-{role}-{i}" for role, r in roles for i in range(int(r["replicas"]))]
    procs = spec.get("nprocPerNode", "1")
    pods = []
    for rank, name in enumerate(names):
        template = (replicas["Master"] if rank == 0 else replicas["Worker"])["template"]["spec"]
        container = template["containers"][0]
        port = str(container["ports"][0]["containerPort"])
        env = {**_base(name), **_env_list(container.get("env")),
               "MASTER_ADDR": names[0], "MASTER_PORT": port,
               "WORLD_SIZE": str(len(names)), "RANK": str(rank),
               "PET_NNODES": str(len(names)), "PET_NPROC_PER_NODE": str(procs),
               "PET_NODE_RANK": str(rank), "PET_MASTER_ADDR": names[0],
               "PET_MASTER_PORT": port, "PYTHONUNBUFFERED": "1"}
        pods.append(Pod(name, [name], env, list(container["command"]), _shm(template)))
    return Plan("PyTorchJob", pods, int(procs))


def _mpijob(job: str, spec: dict[str, Any]) -> Plan:
    replicas = spec["mpiReplicaSpecs"]
    slots, mpi = int(spec["slotsPerWorker"]), spec.get("mpiImplementation", "OpenMPI")
    worker_spec = replicas["Worker"]["template"]["spec"]
    worker_env = _env_list(worker_spec["containers"][0].get("env"))
    workers = [f"{job}-worker-{i}" for i in range(int(replicas["Worker"]["replicas"]))]
    fqdn = [f"{w}.{job}.{KUBE_NAMESPACE}.svc" for w in workers]
    line = "{host} slots={slots}" if mpi == "OpenMPI" else "{host}:{slots}"
    hostfile = "".join(line.format(host=h, slots=slots) + "\n" for h in fqdn)
    pods = [Pod(w, [f, f"{w}.{job}", w], {**_base(w), **worker_env}, None, _shm(worker_spec))
            for w, f in zip(workers, fqdn, strict=True)]
    launcher = replicas["Launcher"]["template"]["spec"]["containers"][0]
    name = f"{job}-launcher"
    env = {**_base(name), **_env_list(launcher.get("env")),
           HOSTFILE_VARIABLE[mpi]: "/etc/mpi/hostfile"}
    pods.append(Pod(name, [f"{name}.{job}.{KUBE_NAMESPACE}.svc", name], env,
                    list(launcher["command"]), None, {"/etc/mpi/hostfile": hostfile}))
    return Plan("MPIJob", pods, slots)


def plan(manifest: dict[str, Any]) -> Plan:
    """The pods ``manifest`` (a rendered TrainJob, PyTorchJob or MPIJob) makes."""
    kind, job = manifest.get("kind"), manifest["metadata"]["name"]
    makers = {"TrainJob": _trainjob, "PyTorchJob": _pytorchjob, "MPIJob": _mpijob}
    if kind not in makers:
        raise ValueError(f"kind {kind!r}: expected one of {', '.join(makers)}")
    if not re.match(r"^[a-z0-9-]+$", job):
        raise ValueError(f"metadata.name {job!r} is not a Kubernetes name")
    return makers[kind](job, manifest["spec"])
