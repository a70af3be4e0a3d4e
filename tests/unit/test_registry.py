"""Engine registry: lazy loading, names, and what ``auto`` picks."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

import dp_plugin.engines as engines
from dp_plugin.config import ENGINE_NAMES as CONFIG_ENGINE_NAMES
from dp_plugin.config import Config
from dp_plugin.engines.base import Availability, Engine
from dp_plugin.errors import EngineUnavailableError
from dp_plugin.launch.launchers import Topology


def _topology(launcher: str, rendezvous_addr: str | None = None,
              rendezvous_port: int | None = None) -> Topology:
    return Topology(
        launcher=launcher, rank=0, size=2, local_rank=0, local_size=2, cross_rank=0,
        cross_size=1, rendezvous_addr=rendezvous_addr, rendezvous_port=rendezvous_port,
    )


def _modules_loaded_after(code: str) -> set[str]:
    probe = (
        f"import sys\n{code}\n"
        "print(','.join(m for m in ('torch', 'mpi4py', 'horovod', 'tensorflow') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()
    return set(filter(None, out.split(",")))


def test_registry_and_engine_classes_load_no_framework() -> None:
    code = (
        "import dp_plugin.engines as e\n"
        "e.engine_class('local'); e.engine_class('gloo'); e.engine_class('nccl')"
    )
    assert _modules_loaded_after(code) == set()


def test_names_match_the_config_choices() -> None:
    # config.EngineName is the one list: the registry holds exactly those
    # names (checked at import too), in the same order.
    assert tuple(n for n in CONFIG_ENGINE_NAMES if n != "auto") == engines.ENGINE_NAMES
    assert set(engines._REGISTRY) == set(engines.ENGINE_NAMES)


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="engine 'glooo' is not known") as info:
        engines.engine_class("glooo")
    for name in (*engines.ENGINE_NAMES, "auto"):
        assert name in str(info.value)
    with pytest.raises(ValueError, match="is not known"):
        engines.create_engine("glooo", Topology.single(), Config())


def test_every_name_resolves_to_an_engine_with_that_name() -> None:
    for name in ("local", "gloo", "nccl"):
        cls = engines.engine_class(name)
        assert issubclass(cls, Engine) and cls.name == name


def _fake_availability(ok: set[str]) -> Callable[[str, Topology], Availability]:
    def availability(name: str, topology: Topology) -> Availability:
        return Availability(name in ok, f"{name} {'works' if name in ok else 'is missing'}")
    return availability


@pytest.mark.parametrize(
    ("launcher", "available", "expected"),
    [
        ("horovodrun", {"horovod", "gloo"}, "gloo"),  # CPUs: measured faster than the ring
        ("horovodrun", {"gloo"}, "gloo"),
        ("horovodrun", {"nccl", "gloo"}, "nccl"),  # GPUs, no Horovod
        ("mpich", {"mpi", "gloo"}, "mpi"),
        ("openmpi", {"gloo"}, "gloo"),
        ("torchrun", {"nccl", "gloo"}, "nccl"),
        ("torchrun", {"gloo"}, "gloo"),
        ("slurm", {"nccl", "gloo"}, "nccl"),
        ("slurm", {"gloo"}, "gloo"),
    ],
)
def test_auto_prefers_the_launchers_engine_and_says_why(
    monkeypatch: pytest.MonkeyPatch, launcher: str, available: set[str], expected: str
) -> None:
    monkeypatch.setattr(engines, "availability", _fake_availability(available))
    name, reason = engines.choose_engine(_topology(launcher))
    assert name == expected
    assert launcher in reason
    if expected == "gloo" and launcher != "horovodrun":
        assert "is missing" in reason  # names why the preferred engine was passed over


@pytest.mark.parametrize(("nccl_build", "expected"), [(True, "horovod"), (False, "nccl")])
def test_auto_under_horovodrun_on_gpus_keeps_horovods_nccl_build(
    monkeypatch: pytest.MonkeyPatch, nccl_build: bool, expected: str
) -> None:
    """Horovod's NCCL path was not measured against the nccl engine: auto keeps it."""
    import dp_plugin.engines.horovod as horovod_engine

    monkeypatch.setattr(engines, "availability", _fake_availability({"horovod", "nccl", "gloo"}))
    monkeypatch.setattr(horovod_engine, "built_with_nccl", lambda: nccl_build)
    name, reason = engines.choose_engine(_topology("horovodrun"))
    assert (name, "on GPUs" in reason) == (expected, True), reason


def test_auto_under_horovodrun_on_cpus_says_why_and_how_to_get_the_ring(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engines, "availability", _fake_availability({"horovod", "gloo"}))
    name, reason = engines.choose_engine(_topology("horovodrun"))
    assert name == "gloo"
    assert "measured faster than Horovod's ring" in reason, reason
    assert "DP_PLUGIN_ENGINE=horovod" in reason, reason


def test_auto_is_local_for_a_lone_process() -> None:
    name, reason = engines.choose_engine(Topology.single())
    assert name == "local" and "single process" in reason


def test_auto_on_a_cpu_machine_under_torchrun_is_gloo() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: auto picks nccl")
    topo = _topology("torchrun", rendezvous_addr="127.0.0.1", rendezvous_port=29500)
    name, reason = engines.choose_engine(topo)
    assert name == "gloo"
    assert "CUDA" in reason


def test_unavailable_engine_names_the_reason_and_the_alternatives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engines, "availability", _fake_availability({"gloo", "mpi"}))
    topo = _topology("mpich")
    with pytest.raises(EngineUnavailableError) as info:
        engines.create_engine("local", topo, Config())
    message = str(info.value)
    assert "'local' cannot run here" in message
    assert "exactly one process" in message  # LocalEngine's own reason
    assert "gloo, mpi" in message and "DP_PLUGIN_ENGINE" in message


def test_availability_report_covers_every_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines, "availability", _fake_availability({"local"}))
    report = engines.availability_report(Topology.single())
    assert list(report) == list(engines.ENGINE_NAMES)
    assert report["local"].ok and not report["gloo"].ok


def test_torch_engines_explain_a_missing_rendezvous() -> None:
    pytest.importorskip("torch")
    gloo = engines.engine_class("gloo")
    for launcher in ("torchrun", "slurm"):
        avail = gloo.availability(_topology(launcher))
        assert not avail.ok and "MASTER_ADDR" in avail.reason
    avail = gloo.availability(_topology("horovodrun"))
    assert not avail.ok and "--gloo" in avail.reason
    ok = gloo.availability(_topology("horovodrun", rendezvous_addr="127.0.0.1",
                                     rendezvous_port=5000))
    assert ok.ok, ok.reason


def test_nccl_is_unavailable_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    avail = engines.engine_class("nccl").availability(
        _topology("torchrun", rendezvous_addr="127.0.0.1", rendezvous_port=29500)
    )
    assert not avail.ok and "no CUDA device" in avail.reason and "gloo" in avail.reason
