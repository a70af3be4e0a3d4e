"""hvd.elastic in one process: commit/restore, commits on disk, resume, refusals.

The multi-process proof (a worker killed under torchrun --max-restarts,
bitwise-identical result) is tests/multiproc/test_torch_elastic.py.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import dp_plugin.torch as hvd
from dp_plugin.errors import LaunchError
from tests.torch.local_runtime import local_engine  # noqa: F401 - autouse fixture


def _objects(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, scheduler


def _step(model: nn.Module, opt: torch.optim.Optimizer, scheduler: object) -> None:
    opt.zero_grad()
    model(torch.randn(4, 3)).square().sum().backward()
    opt.step()
    scheduler.step()  # type: ignore[attr-defined]


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    return [p.detach().clone() for p in model.parameters()] + momentum


def test_restore_returns_to_the_last_commit_rng_included() -> None:
    model, opt, scheduler = _objects()
    state = hvd.elastic.TorchState(model, opt, scheduler=scheduler, epoch=0, batch=0)
    _step(model, opt, scheduler)
    state.batch = 1
    state.commit()
    kept, lr = _snapshot(model, opt), opt.param_groups[0]["lr"]
    after = torch.rand(3)
    _step(model, opt, scheduler)
    state.batch, state.epoch = 2, 7
    state.restore()
    assert (state.batch, state.epoch) == (1, 0)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(model, opt), kept, strict=True))
    assert opt.param_groups[0]["lr"] == lr == 0.05
    assert torch.equal(torch.rand(3), after)  # the generator is back at the commit too


def test_a_commit_on_disk_resumes_fresh_objects_through_run(tmp_path: Path) -> None:
    path = tmp_path / "elastic.pt"
    model, opt, scheduler = _objects(seed=1)
    state = hvd.elastic.TorchState(model, opt, scheduler=scheduler, batch=0, commit_path=path)
    for state.batch in range(1, 4):
        _step(model, opt, scheduler)
    state.commit()
    kept, after = _snapshot(model, opt), torch.rand(5)

    # A new process would build everything afresh (another seed: other weights).
    model2, opt2, scheduler2 = _objects(seed=2)
    state2 = hvd.elastic.TorchState(model2, opt2, scheduler=scheduler2, batch=0,
                                    commit_path=path)
    seen: list[int] = []

    @hvd.elastic.run
    def train(s: hvd.elastic.TorchState) -> str:
        seen.append(s.batch)
        return "done"

    assert train(state2) == "done" and seen == [3]
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(model2, opt2), kept, strict=True))
    assert scheduler2.state_dict() == scheduler.state_dict()
    assert torch.equal(torch.rand(5), after)


def test_run_without_a_commit_starts_from_the_current_state(tmp_path: Path) -> None:
    model, opt, scheduler = _objects()
    state = hvd.elastic.TorchState(model, opt, scheduler=scheduler, batch=0,
                                   commit_path=tmp_path / "none_yet.pt")
    assert hvd.elastic.run(lambda s: s.batch)(state) == 0
    assert not (tmp_path / "none_yet.pt").exists()


def test_a_foreign_or_different_commit_is_refused(tmp_path: Path) -> None:
    model, opt, scheduler = _objects()
    other = tmp_path / "plain.pt"
    hvd.save_checkpoint(other, model=model.state_dict())
    state = hvd.elastic.TorchState(model, opt, batch=0, commit_path=other)
    with pytest.raises(hvd.CheckpointError, match="not an elastic commit"):
        state.load()
    path = tmp_path / "elastic.pt"
    hvd.elastic.TorchState(model, opt, batch=0, commit_path=path).commit()
    changed = hvd.elastic.TorchState(model, opt, scheduler=scheduler, batch=0, commit_path=path)
    with pytest.raises(hvd.CheckpointError, match="another script"):
        changed.load()


def test_launchers_run_cannot_serve_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, _ = _objects()
    state = hvd.elastic.TorchState(model, opt)
    train = hvd.elastic.run(lambda s: None)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    with pytest.raises(LaunchError, match=r"TORCHELASTIC_MAX_RESTARTS=3.*commit_path"):
        train(state)
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS")
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    with pytest.raises(LaunchError,
                       match=r"elastic mode .* is not supported.*torchrun --max-restarts"):
        train(state)


def test_elastic_sampler_resumes_the_epoch_where_it_stopped() -> None:
    data = list(range(10))
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
    order = list(sampler)
    assert sorted(order) == data and len(sampler) == 10
    sampler.record_batch(0, 4)
    resumed = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
    resumed.load_state_dict(sampler.state_dict())
    assert list(resumed) == order[4:]
    resumed.set_epoch(1)
    assert sorted(resumed) == data and list(resumed) != order


def test_numpy_values_commit_and_resume(tmp_path: Path) -> None:
    """``best_acc=np.float64(0.91)``: the commit was written, and every
    restart then failed with ``Weights only load failed``."""
    path = tmp_path / "elastic.pt"
    model, opt, _ = _objects()
    state = hvd.elastic.TorchState(model, opt, best_acc=np.float64(0.5), commit_path=path)
    state.best_acc = np.float64(0.91)
    state.commit()
    fresh = hvd.elastic.TorchState(*_objects()[:2], best_acc=np.float64(0.0), commit_path=path)
    assert fresh.load() and type(fresh.best_acc) is np.float64 and fresh.best_acc == 0.91


def test_a_commit_that_would_not_load_is_refused_at_commit(tmp_path: Path) -> None:
    model, opt, _ = _objects()
    state = hvd.elastic.TorchState(model, opt, note=object(), commit_path=tmp_path / "e.pt")
    with pytest.raises(hvd.CheckpointError, match=r"\['values'\]\['note'\] = <object object"):
        state.commit()
    assert not (tmp_path / "e.pt").exists()


def _torchrun_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, run_id: str, launch: str,
                  attempt: int = 0, local_rank: int = 0, max_restarts: int = 3) -> None:
    """The variables torchrun gives a worker: run id, restart count and budget,
    and the error file in the launch's own log directory."""
    error_file = (tmp_path / f"torchelastic_{launch}" / f"{run_id}_{launch}" / f"attempt_{attempt}"
                  / str(local_rank) / "error.json")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", str(max_restarts))


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary directory the default commit path goes under: ``tmp_path``."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    return tmp_path / f"dp_plugin-{os.getuid()}"


def _state(batch: int = 0) -> hvd.elastic.TorchState:
    model, opt, _ = _objects()
    return hvd.elastic.TorchState(model, opt, batch=batch)


def test_torchrun_gives_a_private_per_job_default_commit_path(
        tmp_path: Path, private_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Horovod's elastic example has no commit_path: under torchrun the
    commits go to a per-job file in a 0700 directory, which ``run`` resumes
    from and removes when the function returns."""
    _torchrun_job(monkeypatch, tmp_path, "job/7", "a")
    state = _state()
    assert state.commit_path is not None and state.commit_path.parent == private_tmp
    assert state.commit_path.name.startswith("elastic-job_7-")
    assert stat.S_IMODE(private_tmp.stat().st_mode) == 0o700
    state.batch = 4
    state.commit()
    assert state.commit_path.exists()
    _torchrun_job(monkeypatch, tmp_path, "job/7", "a", attempt=1, local_rank=2)
    resumed = hvd.elastic.TorchState(*_objects(seed=3)[:2], batch=0)
    assert resumed.commit_path == state.commit_path  # every local rank, every restart
    seen = []
    hvd.elastic.run(lambda s: seen.append(s.batch))(resumed)  # the LaunchError is gone
    assert seen == [4] and not state.commit_path.exists()
    _torchrun_job(monkeypatch, tmp_path, "other-job", "a")
    assert _state().commit_path.name.startswith("elastic-other-job-")
    private_tmp.chmod(0o755)
    with pytest.raises(LaunchError, match=r"not private to this user \(mode 755"):
        _state()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert _state().commit_path is None


def test_a_new_job_with_the_same_rdzv_id_starts_fresh(
        tmp_path: Path, private_tmp: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A job script with a fixed ``--rdzv-id``: job A commits at batch 5 and
    dies; job B (a new launch, restart count 0) started at batch 5 with A's
    weights before. Now B starts fresh and removes A's file, saying so; A's
    own restart would have resumed it, and a membership-change restart of B
    (restart count still 0) resumes B's."""
    _torchrun_job(monkeypatch, tmp_path, "nightly", "a")
    job_a = _state()
    job_a.batch = 5
    job_a.commit()
    assert job_a.commit_path is not None and job_a.commit_path.exists()
    _torchrun_job(monkeypatch, tmp_path, "nightly", "b")
    seen = []

    def train(s: hvd.elastic.TorchState) -> None:
        seen.append(s.batch)
        s.batch = 2
        s.commit()
        raise RuntimeError("a worker died")

    with pytest.raises(RuntimeError, match="a worker died"):
        hvd.elastic.run(train)(_state())
    assert seen == [0] and not job_a.commit_path.exists()
    assert "an earlier torchrun job with the same run id left it" in caplog.text
    assert str(job_a.commit_path) in caplog.text
    # B's attempt failed with restarts left: its commit stays for its restart.
    hvd.elastic.run(lambda s: seen.append(s.batch))(_state())
    assert seen == [0, 2]
    for p in (job_a.commit_path, *private_tmp.iterdir()):
        assert not p.exists(), p  # B returned: its commit is gone too


def test_the_last_attempts_failure_removes_the_default_commit(
        tmp_path: Path, private_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Failed jobs' default commits piled up in the temporary directory: one
    whose last attempt fails is removed; one that may still be restarted stays."""
    def fail(s: hvd.elastic.TorchState) -> None:
        s.commit()
        raise RuntimeError("a worker died")

    _torchrun_job(monkeypatch, tmp_path, "r", "a", attempt=1, max_restarts=2)
    state = _state()
    with pytest.raises(RuntimeError):
        hvd.elastic.run(fail)(state)
    assert state.commit_path is not None and state.commit_path.exists()
    _torchrun_job(monkeypatch, tmp_path, "r", "a", attempt=2, max_restarts=2)
    with pytest.raises(RuntimeError):
        hvd.elastic.run(fail)(_state())
    assert not state.commit_path.exists()
    _torchrun_job(monkeypatch, tmp_path, "r", "b", max_restarts=0)  # no restarts at all
    state = _state()
    with pytest.raises(RuntimeError):
        hvd.elastic.run(fail)(state)
    assert state.commit_path is not None and not state.commit_path.exists()


def test_week_old_default_commits_of_other_jobs_are_removed(
        tmp_path: Path, private_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job whose rank 0 was killed on its last attempt leaves its commit;
    a start of any job removes default commits not written for a week."""
    from dp_plugin.torch.elastic import STALE_AFTER_S, remove_stale_commits

    _torchrun_job(monkeypatch, tmp_path, "x", "a")
    path = _state().commit_path
    assert path is not None
    old, recent = private_tmp / "elastic-other-0123456789abcdef.pt", private_tmp / "elastic-y.pt"
    for p in (old, recent):
        p.write_bytes(b"")
    week = os.stat(old).st_mtime - STALE_AFTER_S - 60
    os.utime(old, (week, week))
    assert remove_stale_commits(path) == [old]
    assert recent.exists()


def test_static_rendezvous_jobs_get_commit_paths_of_their_own(
        tmp_path: Path, private_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun without --rdzv-id/--standalone (any --master_port launch) sets
    TORCHELASTIC_RUN_ID=none for every job: before, all of them shared
    ``elastic-none.pt`` and a fresh job resumed another job's commit. The
    launch's own torchrun log directory names the file: the same for every
    local rank and restart of one job, another for the next job; without
    one, restarts are refused naming commit_path=."""
    def job(name: str, attempt: int = 0, local_rank: int = 0) -> hvd.elastic.TorchState:
        _torchrun_job(monkeypatch, tmp_path, "none", name, attempt, local_rank)
        return _state()

    first = job("a")
    assert first.commit_path is not None and first.commit_path.name != "elastic-none.pt"
    assert job("a", attempt=1, local_rank=2).commit_path == first.commit_path
    first.batch = 5
    first.commit()
    seen = []
    hvd.elastic.run(lambda s: seen.append(s.batch))(job("a", attempt=1))  # its restart
    assert seen == [5] and not first.commit_path.exists()
    second = job("b")
    assert second.commit_path != first.commit_path

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", "")  # torchrun --log-dir /dev/null
    model, opt, _ = _objects()
    with pytest.raises(LaunchError, match=r"log directory is unknown.*"
                       r"commit_path='some/dir/elastic.pt'"):
        hvd.elastic.TorchState(model, opt)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "fixed")  # also with --rdzv-id
    with pytest.raises(LaunchError, match=r"TORCHELASTIC_RUN_ID='fixed'"):
        hvd.elastic.TorchState(model, opt)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # nothing restarts: in memory
    assert hvd.elastic.TorchState(model, opt).commit_path is None
