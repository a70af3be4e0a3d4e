"""dp_plugin.keras.elastic under torchrun --max-restarts (workers/tf_elastic.py), and
rank 0's commit failures on every rank (env launcher).

2 workers, commits every 2 steps, rank 1 SIGKILLs itself after step 5 on the
first attempt. torchrun restarts both, ``hvd.elastic.run`` resumes them from
the commit of step 4, and the final weights match an uninterrupted
single-process run on the same batches.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np

from dp_plugin.api.elastic import MARK
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
    """Rank 0's failure to write or read the commit reached the other rank
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


class _ObjectFieldWithoutFlags:
    """Pickles as ``numpy.dtype`` with a field of dtype object and flags 0: numpy
    then believes the dtype holds no Python references."""

    def __reduce__(self) -> tuple[Any, ...]:
        fields = {"a": (np.dtype("O"), 0)}
        return (np.dtype, ("V8", False, True), (3, "|", None, ("a",), fields, 8, 1, 0))


class _PointersFromTheFile:
    """Pickles as an array of that dtype whose 16 bytes come from the file: numpy
    reads them as two object pointers (0x4141...)."""

    def __reduce__(self) -> tuple[Any, ...]:
        rebuild, args, _ = np.zeros(1).__reduce__()
        return (rebuild, args, (1, (2,), _ObjectFieldWithoutFlags(), False, b"A" * 16))


def test_a_forged_commit_is_refused_on_every_rank_without_a_crash(tmp_path: Path) -> None:
    """The commit's tracked names differ from the state's, so the load formats a
    mismatch message holding the forged array: with a dtype unpickled, that read
    the pointers and segfaulted every rank (rank 0 broadcasts the same bytes)."""
    forged = tmp_path / "forged.pkl"
    record = {MARK: {"values": ["epoch"], "forged": _PointersFromTheFile()}, "commit": {}}
    forged.write_bytes(pickle.dumps(record, protocol=4))
    env = {"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "60", "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = run_workers("env", 2, WORKER, args=["--case", "forged", "--commit", str(forged)],
                         env=env, timeout=180)
    assert_ranks_ok(result, 2)
    for rank in range(2):
        assert f"rank {rank}: the forged commit was refused" in result.output, result.output
