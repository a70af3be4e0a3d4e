"""dp_plugin.torch's process-level API in one process (local engine): init,
ranks, build flags, timeline, and errors before init."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import dp_plugin.torch as hvd
from dp_plugin.launch import runtime
from tests.multiproc.harness import launcher_variables


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No launcher variables (one process, local engine); shut down after each test."""
    for name in launcher_variables():
        monkeypatch.delenv(name)
    for name in ("DP_PLUGIN_ENGINE", "DP_PLUGIN_TIMELINE", "HOROVOD_TIMELINE"):
        monkeypatch.delenv(name, raising=False)
    hvd.shutdown()
    yield
    hvd.shutdown()


NEEDS_INIT = [
    hvd.rank, hvd.size, hvd.local_rank, hvd.local_size, hvd.cross_rank, hvd.cross_size,
    hvd.is_homogeneous, hvd.mpi_threads_supported, hvd.stop_timeline,
    lambda: hvd.start_timeline("t.json"), hvd.join,
]


@pytest.mark.parametrize("fn", NEEDS_INIT)
def test_use_before_init_raises_naming_init(fn: object) -> None:
    assert not hvd.is_initialized()
    with pytest.raises(hvd.NotInitializedError, match=r"call hvd.init\(\)") as info:
        fn()  # type: ignore[operator]
    assert isinstance(info.value, ValueError)  # what Horovod raises


def test_init_gives_a_one_process_job() -> None:
    hvd.init()
    hvd.init()  # idempotent
    assert hvd.is_initialized()
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    assert hvd.is_homogeneous() is True
    assert runtime.engine().name == "local"
    assert hvd.gloo_enabled() is False and hvd.mpi_enabled() is False
    with pytest.raises(ValueError, match="MPI is not enabled"):
        hvd.mpi_threads_supported()
    assert hvd.join() == 0
    hvd.shutdown()
    assert not hvd.is_initialized()
    assert hvd.gloo_enabled() is False


def test_build_flags_answer_for_this_installation() -> None:
    import torch.distributed as dist

    assert hvd.gloo_built() is dist.is_gloo_available()
    assert isinstance(hvd.mpi_built(), bool)
    nccl = hvd.nccl_built()
    assert isinstance(nccl, int) and (nccl > 0) == (
        dist.is_nccl_available() and torch.cuda.is_available())
    assert hvd.cuda_built() is torch.backends.cuda.is_built()
    assert hvd.rocm_built() is (torch.version.hip is not None)
    assert hvd.ccl_built() is False and hvd.ddl_built() is False


def test_init_comm_accepts_the_whole_world_only() -> None:
    hvd.init(comm=[0])
    hvd.shutdown()
    hvd.init(comm=[])
    hvd.shutdown()
    with pytest.raises(NotImplementedError, match=r"hvd\.add_process_set"):
        hvd.init(comm=[0, 1])
    with pytest.raises(ValueError, match="list of ranks or an mpi4py communicator"):
        hvd.init(comm="world")


def test_init_registers_process_sets() -> None:
    hvd.init(process_sets="dynamic")
    assert hvd.global_process_set.ranks == [0]
    assert hvd.global_process_set.included()


def test_timeline_from_the_environment_and_start_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOROVOD_TIMELINE", str(tmp_path / "env.json"))
    hvd.init()
    assert (tmp_path / "env.rank0.json").exists()
    hvd.start_timeline(str(tmp_path / "live-{rank}.json"))
    hvd.stop_timeline()
    hvd.stop_timeline()  # nothing running: fine
    for name in ("env.rank0.json", "live-0.json"):
        events = json.loads((tmp_path / name).read_text())  # closed: valid JSON
        assert events[0]["ph"] == "M"
    with pytest.raises(ValueError, match="file_path must be a non-empty string"):
        hvd.start_timeline("")


def test_dynamic_timeline_setting_opens_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")
    hvd.init()
    assert list(tmp_path.iterdir()) == []
