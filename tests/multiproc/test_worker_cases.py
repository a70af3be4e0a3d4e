"""Every worker runs one case per launch through workers/_fail_fast.run_cases.

The checks of run_cases itself use a tiny worker that imports no framework,
so they cost an interpreter start per rank, not a torch import.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc import harness
from tests.multiproc.harness import assert_ranks_ok, run_cells, run_workers, worker_cases

WORKERS = Path(__file__).resolve().parent / "workers"
# User-style training scripts (Horovod programs with only the import
# changed), not test workers: they have no cases. fake_hosts.py wraps another
# worker; fault_matrix.py's ranks die or exit 1 on purpose with timed lines
# the matrix reads, which run_cases' fail-fast exit would replace;
# horovod_across_hosts.py is started by scripts/cluster.py under horovodrun
# and prints each engine's outcome, refusals included, for the test to read.
NOT_CASE_WORKERS = {"_fail_fast.py", "typical_horovod_script.py", "horovod_keras_script.py",
                    "fake_hosts.py", "fault_matrix.py", "horovod_across_hosts.py"}
CASE_WORKERS = sorted(p for p in WORKERS.glob("*.py") if p.name not in NOT_CASE_WORKERS)

TINY = f'''
import sys
sys.path.insert(0, {str(WORKERS)!r})
from _fail_fast import run_cases
from dp_plugin.launch.launchers import detect

def bad(args):
    if detect().rank == 1:
        raise ValueError("case bad fails on rank 1")

CASES = {{"good": lambda args: print("ran good", args.greeting), "bad": bad}}

if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--greeting", required=True)
    run_cases(CASES, parser=parser)
'''


@pytest.mark.parametrize("worker", CASE_WORKERS, ids=[p.stem for p in CASE_WORKERS])
def test_worker_declares_cases_and_runs_them_through_run_cases(worker: Path) -> None:
    cases = worker_cases(worker)
    assert cases and len(cases) == len(set(cases)), cases
    tree = ast.parse(worker.read_text())
    calls = {node.func.id for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert "run_cases" in calls, f"{worker.name} must end through run_cases"
    assert "fail_fast" not in calls, f"{worker.name}: leave fail_fast to run_cases"


def test_worker_cases_refuses_a_worker_without_a_cases_literal(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text("CASES = dict(a=print)\n")
    with pytest.raises(ValueError, match="no module-level CASES"):
        worker_cases(script)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    script = tmp_path / "tiny_worker.py"
    script.write_text(TINY)
    return script


def test_list_cases_needs_no_launcher_and_no_other_option(tiny: Path) -> None:
    out = subprocess.run([sys.executable, str(tiny), "--list-cases"], capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.split() == ["good", "bad"] == worker_cases(tiny)


def test_one_case_runs_and_every_rank_prints_ok(tiny: Path) -> None:
    result = run_workers("env", 2, tiny, ["--case", "good", "--greeting", "hi"], timeout=60)
    assert_ranks_ok(result, 2)
    assert result.output.count("ran good hi") == 2, result.output


def test_a_failing_case_exits_1_at_once_with_the_rank_and_traceback(tiny: Path) -> None:
    result = run_workers("env", 2, tiny, ["--case", "bad", "--greeting", "hi"], timeout=60,
                         check=False)
    assert result.returncodes == [0, 1], result.output
    assert "rank 1 FAILED" in result.output and "case bad fails on rank 1" in result.output
    assert_ranks_ok(result, 1)  # rank 0 is unaffected
    assert "rank 1 OK" not in result.output


def test_an_unknown_case_is_refused_on_every_rank(tiny: Path) -> None:
    result = run_workers("env", 2, tiny, ["--case", "nope", "--greeting", "hi"], timeout=60,
                         check=False)
    assert result.returncodes == [2, 2], result.output
    assert "invalid choice: 'nope'" in result.output


def test_run_cells_runs_every_cell_and_names_the_failed_ones(tiny: Path) -> None:
    def good() -> str:
        result = run_workers("env", 2, tiny, ["--case", "good", "--greeting", "hi"], timeout=60)
        return result.output

    def bad() -> str:
        return run_workers("env", 2, tiny, ["--case", "bad", "--greeting", "hi"],
                           timeout=60).output

    outputs = run_cells({"a": good, "b": good}, 2)
    assert [str(outputs[k]).count("ran good hi") for k in "ab"] == [2, 2], outputs
    with pytest.raises(AssertionError) as raised:
        run_cells({"first": good, "second": bad, "third": good}, 2)
    text = str(raised.value)
    assert text.startswith("1 of 3 cells failed: second\n"), text
    assert "=== cell second: AssertionError:" in text and "case bad fails on rank 1" in text
    assert "=== cell first" not in text and "=== cell third" not in text, text


def test_mpich_segments_are_removed_when_the_last_concurrent_mpirun_ends(tmp_path: Path) -> None:
    """Two mpirun jobs overlap (run_cells): the segment that appeared while
    both ran stays until the second ends (the other job may still open it),
    then goes."""
    jobs = harness._MpichJobs(tmp_path / "jobs.json")
    segment = Path("/dev/shm") / f"mpich_shm_dp_test_{os.getpid()}"
    try:
        jobs.enter()
        jobs.enter()
        segment.write_bytes(b"x")
        jobs.leave()
        assert segment.exists(), "removed while another mpirun job still ran"
        jobs.leave()
        assert not segment.exists(), "left behind after the last mpirun job"
    finally:
        segment.unlink(missing_ok=True)


def test_mpich_segments_wait_for_jobs_of_other_live_test_processes(tmp_path: Path) -> None:
    """pytest-xdist runs tests in two processes: a job of the other one keeps
    the segments; a process that died with jobs running no longer does."""
    state = tmp_path / "jobs.json"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    segment = Path("/dev/shm") / f"mpich_shm_dp_test_x{os.getpid()}"
    try:
        state.write_text(json.dumps({"running": {str(other.pid): 1}, "before": []}))
        jobs = harness._MpichJobs(state)
        jobs.enter()
        segment.write_bytes(b"x")
        jobs.leave()
        assert segment.exists(), "removed while another test process's mpirun job ran"
        other.kill()
        other.wait()
        jobs.enter()
        jobs.leave()
        assert not segment.exists(), "a dead process's job kept the segment"
    finally:
        other.kill()
        other.wait()
        segment.unlink(missing_ok=True)
