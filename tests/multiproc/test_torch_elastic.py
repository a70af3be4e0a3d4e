"""hvd.elastic under torchrun --max-restarts: a killed worker costs nothing
but the steps since the last commit (workers/torch_elastic.py).

3 workers, commits every 5 steps, rank 1 SIGKILLs itself after step 7 on
the first attempt. torchrun restarts all three, ``hvd.elastic.run`` resumes
them from the commit of step 5, and the final weights are bitwise those of
a run that was never interrupted (same data order). The killed run passes
no commit_path, as Horovod's own elastic example: torchrun's run id gives
the default one. A new job with the same ``--rdzv-id`` never resumes an
earlier job's default commit.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.multiproc.harness import assert_ranks_ok, run_workers

WORKER = Path(__file__).parent / "workers" / "torch_elastic.py"


def test_killed_worker_resumes_from_the_commit_bitwise_identical(tmp_path: Path) -> None:
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference.mkdir()
    killed.mkdir()
    env = {"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "60"}
    ok = run_workers("env", 3, WORKER, args=["--case", "uninterrupted", "--out", str(reference)],
                     env=env, timeout=150)
    assert_ranks_ok(ok, 3)
    temp = tmp_path / "temp"  # the default commit path's temporary directory
    temp.mkdir()
    result = run_workers("torchrun", 3, WORKER, args=["--case", "killed", "--out", str(killed)],
                         env={**env, "TMPDIR": str(temp)}, timeout=240,
                         launcher_args=["--max-restarts", "1"])
    assert "rank 1 attempt 0 starts at step 0" in result.output, result.output
    for rank in range(3):  # every worker was restarted and resumed from the step-5 commit
        assert f"rank {rank} attempt 1 starts at step 5" in result.output, result.output
    assert "attempt 2" not in result.output, result.output
    assert_ranks_ok(result, 3)
    expected = (reference / "weights.bin").read_bytes()
    assert len(expected) == (8 * 16 + 16 + 16 * 4 + 4) * 4
    assert (killed / "weights.bin").read_bytes() == expected
    # The default commit went to a private per-user folder, removed when run() returned.
    (folder,) = [p for p in temp.iterdir() if p.name.startswith("dp_plugin-")]
    assert folder.stat().st_mode & 0o777 == 0o700 and not list(folder.iterdir())


def test_a_new_job_with_the_same_rdzv_id_does_not_resume_the_last_ones_commit(
        tmp_path: Path) -> None:
    """Job A (``--rdzv-id nightly``, no restarts) commits at step 5 and its
    rank 0 is SIGKILLed at step 7, so its default commit stays. Job B, the
    same command (restart count 0), started "at step 5" with A's weights
    before; now it starts at step 0, says it removed A's file, and its own
    file is gone when it returns."""
    out, temp = tmp_path / "out", tmp_path / "temp"
    out.mkdir()
    temp.mkdir()
    env = {"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "60", "TMPDIR": str(temp)}
    same_id = ["--rdzv-id", "nightly", "--max-restarts", "0"]
    job_a = run_workers("torchrun", 3, WORKER, args=["--case", "rank0_dies", "--out", str(out)],
                        env=env, timeout=180, check=False, launcher_args=same_id)
    assert "rank 0 attempt 0 starts at step 0" in job_a.output, job_a.output
    assert job_a.returncodes != [0], job_a.output
    folder = temp / f"dp_plugin-{os.getuid()}"
    (left,) = folder.iterdir()  # job A's commit of step 5
    assert left.name.startswith("elastic-nightly"), left
    job_b = run_workers("torchrun", 3, WORKER, args=["--case", "fresh", "--out", str(out)],
                        env=env, timeout=180, launcher_args=same_id)
    assert_ranks_ok(job_b, 3)
    for rank in range(3):
        assert f"rank {rank} attempt 0 starts at step 0" in job_b.output, job_b.output
    assert f"removed the default elastic commit {left}" in job_b.output, job_b.output
    assert not list(folder.iterdir())
