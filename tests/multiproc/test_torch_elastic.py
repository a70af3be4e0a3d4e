"""hvd.elastic under torchrun --max-restarts: a killed worker costs nothing
but the steps since the last commit (workers/torch_elastic.py).

3 workers, commits every 5 steps, rank 1 SIGKILLs itself after step 7 on
the first attempt. torchrun restarts all three, ``hvd.elastic.run`` resumes
them from the commit of step 5, and the final weights are bitwise those of
a run that was never interrupted (same data order). The killed run passes
no commit_path, as Horovod's own elastic example: torchrun's run id gives
the default one.
"""

from __future__ import annotations

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
