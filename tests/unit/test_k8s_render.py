"""``dp-plugin k8s render``: every manifest validates offline.

Pod templates are checked against Kubernetes' own schemas (kubernetes-validate,
strict: an unknown or misspelt field fails); a TrainJob also against Kubeflow
Trainer's API types (kubeflow-trainer-api), and nothing of it may be dropped
by them (an unknown field would be). PyTorchJob and MPIJob have no schema
package: their pod templates are what Kubernetes checks, and their fields the
operators read are asserted here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from dp_plugin.cli import main, parse
from dp_plugin.cli.k8s import GiB, dump, render, shm_bytes, torchrun_command

kubernetes_validate = pytest.importorskip("kubernetes_validate")
trainer_models = pytest.importorskip("kubeflow_trainer_api.models")

K8S_VERSION = "1.33.0"


def _render(*argv: str) -> dict[str, Any]:
    return render(parse(["k8s", "render", *argv]))


def _check_pod_template(template: dict[str, Any]) -> None:
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate",
               "metadata": {"name": "t"}, "template": template}
    kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)


def _pod_templates(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    spec = manifest["spec"]
    if manifest["kind"] == "PyTorchJob":
        return [r["template"] for r in spec["pytorchReplicaSpecs"].values()]
    if manifest["kind"] == "MPIJob":
        return [r["template"] for r in spec["mpiReplicaSpecs"].values()]
    jobs = spec["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    return [job["template"]["spec"]["template"] for job in jobs]


COMMON = ["--image", "registry.example/me/train:1", "--nodes", "3", "--procs-per-node", "4",
          "--cpu", "16", "--memory", "64Gi", "--env", "DP_PLUGIN_TIMEOUT=600"]


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob", "mpijob"])
@pytest.mark.parametrize("gpus", ["0", "8"])
def test_every_kind_validates_against_the_kubernetes_schemas(kind: str, gpus: str) -> None:
    manifest = _render("--kind", kind, *COMMON, "--gpus-per-node", gpus,
                       "--", "python", "train.py", "--epochs", "3")
    templates = _pod_templates(manifest)
    assert templates
    for template in templates:
        _check_pod_template(template)
    # /dev/shm is memory-backed and mounted wherever ranks run
    volumes = [v for t in templates for v in t["spec"].get("volumes", [])]
    assert volumes and all(v["emptyDir"]["medium"] == "Memory" for v in volumes)
    # the YAML and the JSON say the same thing
    assert yaml.safe_load(dump(manifest, "yaml")) == json.loads(dump(manifest, "json"))


def test_a_misspelt_field_is_caught_by_the_validation_used_here() -> None:
    manifest = _render("--kind", "pytorchjob", *COMMON, "--", "python", "train.py")
    template = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    template["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        _check_pod_template(template)


def test_trainjob_is_a_kubeflow_trainer_train_job() -> None:
    manifest = _render("--kind", "trainjob", *COMMON, "--port", "29500",
                       "--", "python", "train.py", "--epochs", "3")
    job = trainer_models.TrainerV1alpha1TrainJob.from_dict(manifest)
    # nothing unknown to the API types was dropped on the way
    assert job.to_dict() == manifest
    trainer = manifest["spec"]["trainer"]
    assert trainer["numNodes"] == 3 and trainer["numProcPerNode"] == 4
    assert trainer["command"] == ["torchrun", "train.py", "--epochs", "3"]
    assert trainer["resourcesPerNode"]["limits"] == {"cpu": "16", "memory": "64Gi"}
    patch = _pod_templates(manifest)[0]["spec"]
    assert patch["containers"][0]["env"] == [{"name": "PET_MASTER_PORT", "value": "29500"}]


def test_trainjob_api_types_refuse_a_bad_field() -> None:
    manifest = _render("--kind", "trainjob", *COMMON, "--", "python", "train.py")
    manifest["spec"]["trainer"]["numNodes"] = "three"
    with pytest.raises(ValueError):
        trainer_models.TrainerV1alpha1TrainJob.from_dict(manifest)


def test_pytorchjob_master_workers_port_and_procs() -> None:
    manifest = _render("--kind", "pytorchjob", *COMMON, "--max-restarts", "3",
                       "--", "python", "-m", "mypkg.train")
    spec = manifest["spec"]
    assert spec["nprocPerNode"] == "4"
    assert spec["pytorchReplicaSpecs"]["Master"]["replicas"] == 1
    assert spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    container = spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch"
    assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456}]
    assert container["command"] == ["torchrun", "--max-restarts=3", "--module", "mypkg.train"]
    one = _render("--kind", "pytorchjob", "--image", "i", "--nodes", "1",
                  "--procs-per-node", "2", "--", "python", "t.py")
    assert set(one["spec"]["pytorchReplicaSpecs"]) == {"Master"}


@pytest.mark.parametrize(("mpi", "implementation"),
                         [("openmpi", "OpenMPI"), ("mpich", "MPICH"), ("intel", "Intel")])
def test_mpijob_launcher_worker_split_and_slots(mpi: str, implementation: str) -> None:
    manifest = _render("--kind", "mpijob", "--mpi", mpi, *COMMON, "--", "python", "train.py")
    spec = manifest["spec"]
    assert spec["slotsPerWorker"] == 4 and spec["mpiImplementation"] == implementation
    replicas = spec["mpiReplicaSpecs"]
    assert replicas["Launcher"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 3
    launcher = replicas["Launcher"]["template"]["spec"]["containers"][0]
    assert launcher["command"][:3] == ["mpirun", "-np" if mpi == "openmpi" else "-n", "12"]
    assert launcher["command"][-2:] == ["python", "train.py"]
    if mpi == "openmpi":  # Open MPI forwards only what -x names
        assert "-x" in launcher["command"] and "DP_PLUGIN_TIMEOUT" in launcher["command"]
    worker = replicas["Worker"]["template"]["spec"]
    assert "command" not in worker["containers"][0]  # the image's sshd
    assert worker["containers"][0]["resources"]["limits"]["cpu"] == "16"


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_an_elastic_job_restarts_under_torchrun_and_mounts_its_commit_claim(kind: str) -> None:
    manifest = _render("--kind", kind, *COMMON, "--max-restarts", "2", "--commit-claim",
                       "run42-commits", "--commit-dir", "/commits", "--", "python", "t.py")
    if kind == "trainjob":
        assert trainer_models.TrainerV1alpha1TrainJob.from_dict(manifest).to_dict() == manifest
        assert manifest["spec"]["trainer"]["command"] == ["torchrun", "--max-restarts=2", "t.py"]
    for template in _pod_templates(manifest):
        _check_pod_template(template)
        spec = template["spec"]
        assert {"name": "commits", "persistentVolumeClaim": {"claimName": "run42-commits"}} \
            in spec["volumes"]
        assert {"name": "commits", "mountPath": "/commits"} in spec["containers"][0]["volumeMounts"]
        if kind == "pytorchjob":
            assert spec["containers"][0]["command"] == ["torchrun", "--max-restarts=2", "t.py"]
    default = _render("--kind", kind, *COMMON, "--commit-claim", "c", "--", "python", "t.py")
    mounts = [m for t in _pod_templates(default)
              for m in t["spec"]["containers"][0]["volumeMounts"]]
    assert {"name": "commits", "mountPath": "/var/lib/dp-plugin"} in mounts


def test_shm_is_sized_for_full_chunks_at_every_rank_count() -> None:
    from dp_plugin.engines.shm import CHUNK_BYTES

    for procs in (1, 2, 4, 8, 16):
        size = shm_bytes(procs)
        assert size % GiB == 0
        # a quarter of it (the default budget) holds two channels' full segments
        assert size // 4 >= 2 * 2 * (procs + 1) * CHUNK_BYTES
    manifest = _render("--kind", "trainjob", *COMMON, "--shm-size", "8Gi",
                       "--", "python", "t.py")
    assert _pod_templates(manifest)[0]["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] == "8Gi"


def test_torchrun_command_forms() -> None:
    assert torchrun_command(["python3", "t.py", "-x"], 0) == ["torchrun", "t.py", "-x"]
    assert torchrun_command(["/usr/bin/python3.11", "t.py"], 2) == [
        "torchrun", "--max-restarts=2", "t.py"]
    assert torchrun_command(["torchrun", "t.py"], 1) == ["torchrun", "--max-restarts=1", "t.py"]
    assert torchrun_command(["./train"], 0) == ["torchrun", "--no-python", "./train"]


@pytest.mark.parametrize(("argv", "says"), [
    (["--kind", "mpijob", "--port", "1234"], "no rendezvous port"),
    (["--kind", "mpijob", "--max-restarts", "2"], "only trainjob/pytorchjob"),
    (["--kind", "trainjob", "--port", "70000"], "1..65535"),
    (["--kind", "mpijob", "--commit-claim", "c"], "an MPIJob restarts no ranks"),
    (["--kind", "trainjob", "--commit-dir", "/commits"], "--commit-claim CLAIM"),
    (["--kind", "trainjob", "--commit-claim", "c", "--commit-dir", "commits"], "absolute path"),
])
def test_bad_combinations_are_refused_with_the_fix(argv: list[str], says: str) -> None:
    with pytest.raises(SystemExit, match=says):
        _render(*argv, "--image", "i", "--nodes", "2", "--procs-per-node", "2",
                "--", "python", "t.py")


def test_bad_values_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, says in ((["--name", "Bad_Name"], "lower-case"), (["--memory", "lots"], "quantity"),
                       (["--env", "NOEQUALS"], "NAME=VALUE"), (["--nodes", "0"], ">= 1"),
                       (["--commit-claim", "My_Claim"], "PersistentVolumeClaim")):
        base = {"--image": "i", "--nodes": "2", "--procs-per-node": "2"}
        base.update(dict(zip(argv[::2], argv[1::2], strict=True)))
        flat = [x for kv in base.items() for x in kv]
        with pytest.raises(SystemExit):
            parse(["k8s", "render", "--kind", "trainjob", *flat, "--", "python", "t.py"])
        assert says in capsys.readouterr().err


def test_no_command_is_refused() -> None:
    with pytest.raises(SystemExit, match="after --"):
        _render("--kind", "trainjob", "--image", "i", "--nodes", "2", "--procs-per-node", "2")


def test_writes_the_file(tmp_path: Any) -> None:
    out = tmp_path / "job.yaml"
    assert main(["k8s", "render", "--kind", "mpijob", "--image", "i", "--nodes", "2",
                 "--procs-per-node", "2", "-o", str(out), "--", "python", "t.py"]) == 0
    assert yaml.safe_load(out.read_text())["kind"] == "MPIJob"
