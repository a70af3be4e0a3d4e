"""dp_plugin.keras.elastic under torchrun --max-restarts (workers/tf_elastic.py), and
rank 0's commit failures on every rank (env launcher).

2 workers, commits every 2 steps, rank 1 SIGKILLs itself after step 5 on the
first attempt. torchrun restarts both, ``hvd.elastic.run`` resumes them from
the commit of step 4, and the final weights match an uninterrupted
single-process run on the same batches.
"""

from __future__ import annotations

from pathlib import Path

from tests.multiproc.harness import assert_ranks_ok, run_workers

WORKER = Path(__file__).parent / "workers" / "tf_elastic.py"


def test_keras_state_resumes_from_the_commit_after_a_kill(tmp_path: Path) -> None:
    env = {"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "60", "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = run_workers("torchrun", 2, WORKER,
                         args=["--case", "killed", "--commit", str(tmp_path / "commit.pkl")],
                         env=env, timeout=300, launcher_args=["--max-restarts", "1"])
    assert "rank 1 attempt 0 starts at step 0" in result.output, result.output
    for rank in range(2):  # both workers were restarted and resumed from the step-4 commit
        assert f"rank {rank} attempt 1 starts at step 4" in result.output, result.output
    assert "attempt 2" not in result.output, result.output
    assert_ranks_ok(result, 2)


def test_a_commit_failing_on_rank_0_raises_on_every_rank_at_once(tmp_path: Path) -> None:
    """Issue 32: rank 0's failure to write or read the commit reached the other rank
    only through DP_PLUGIN_TIMEOUT (30 s here); now CommitError on both within 10 s."""
    blocked = tmp_path / "a-file"
    blocked.write_text("nothing can be written under a regular file")
    (tmp_path / "unreadable.pkl").mkdir()
    env = {"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "30", "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = run_workers("env", 2, WORKER, args=["--case", "rank0_fails", "--commit", str(blocked)],
                         env=env, timeout=180)
    assert_ranks_ok(result, 2)
    for rank in range(2):
        assert f"rank {rank}: both failures raised CommitError at once" in result.output
