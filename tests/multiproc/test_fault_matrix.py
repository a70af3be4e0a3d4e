"""The fault matrix: one rank of two killed by SIGKILL at each
phase of a run (workers/fault_matrix.py), on the gloo engine over shared
memory and over TCP (``DP_PLUGIN_SHARED_MEMORY=0``) and on the mpi engine,
and by SIGTERM in one phase (``mid_bucket``) per engine: 7 cells x 3
engines = 21 cells, one launch each. SIGTERM in the other phases repeated
the SIGKILL cells: dp_plugin installs no SIGTERM
handler, so the default one ends the process at once, without ``atexit``,
as SIGKILL does - every cell checks that the handler is still the default
after ``init()`` and a training step. One test per engine runs its 7 cells
``CONCURRENT`` at a time (threads,
``harness.run_cells``): a cell mostly waits (for the other rank's import,
the fault, the survivor's deadline), and each keeps its own launch, port,
deadline, directory and checks; a failure names its cells.

Every cell asserts:

- the survivor's outcome, within ``DP_PLUGIN_TIMEOUT`` + 5 s of the fault:
  gloo (env launcher): the survivor raises a dp_plugin error whose message
  names its rank (``rank R:``), prints it, and exits 1 - except the
  ``shutdown`` cell, where the victim dies after its last collective and
  the survivor's own shutdown needs nothing from it: the survivor finishes
  and exits 0 (its program had completed); mpi (mpiexec): mpiexec ends
  every rank when one dies and says which (``BAD TERMINATION``, ``PID
  <victim's pid> RUNNING AT``, ``EXIT CODE: <signal>``; in the ``init``
  cell, where the victim died before MPI started, the survivor's pid and
  ``EXIT CODE: 9``: mpiexec killed it), exit non-zero, no rank finishes - except, again,
  ``shutdown``, where the survivor may already have finished (its own
  ``MPI_Finalize`` is then ended by mpiexec): mpiexec still reports the
  victim and exits non-zero;
- the victim died of the signal (env launcher: exit code ``-signal``);
- nothing new named ``dp_plugin-*`` is left in ``/dev/shm``;
- the checkpoint path holds the old checkpoint, byte for byte (the
  ``save`` cell kills the writer halfway through the new one), or nothing
  in the ``init`` cell (no checkpoint was written yet): never a torn file.

Times: for the env launcher, from the fault to the survivor's message (or
its end, ``shutdown`` cell), on the workers' clock; for mpiexec, to the end
of the job. ``FAULT_MATRIX_TABLE=<file>`` appends each cell as a markdown
table row (docs/reliability.md, "Fault matrix"): that time, the time until
the launch ended (process teardown included), and the whole launch.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import threading
import time
from pathlib import Path

import pytest

from tests.multiproc.harness import RunResult, run_cells, run_workers

WORKER = Path(__file__).parent / "workers" / "fault_matrix.py"
TIMEOUT_S = 4.0
LIMIT_S = TIMEOUT_S + 5.0
PHASES = ("init", "agreement", "mid_bucket", "join", "save", "shutdown")
CELLS = [*(("SIGKILL", phase) for phase in PHASES), ("SIGTERM", "mid_bucket")]
ENGINES = {  # name: (launcher, environment)
    "gloo-shm": ("env", {"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_SHARED_MEMORY": "1"}),
    "gloo-tcp": ("env", {"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_SHARED_MEMORY": "0"}),
    "mpi": ("mpirun", {"DP_PLUGIN_ENGINE": "mpi"}),
}
SIGNUM = {"SIGKILL": 9, "SIGTERM": 15}
CONCURRENT = 2
"""Cells of one engine at a time (2 ranks each, on the 2-core CI machine).
3 failed a gloo-shm cell at load ~10 (two other sessions' jobs beside it):
rank 1 reached ``init_process_group`` 22 s after rank 0, past the 4 s
timeout (the load-caused failure docs/reliability.md records, sequential
too at load 30)."""
_table_lock = threading.Lock()


def _shm() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("dp_plugin-")}
    except FileNotFoundError:
        return set()


def _times(result: RunResult, what: str) -> dict[int, float]:
    return {int(r): float(t) for r, t in
            re.findall(rf"\brank (\d+) {what} at ([0-9.]+)", result.output)}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_fault_matrix(engine: str, tmp_path: Path) -> None:
    cells = {f"{engine} {sig} {phase}": functools.partial(
        _cell, engine, sig, phase, tmp_path / f"{sig}-{phase}")
        for sig, phase in CELLS}
    run_cells(cells, CONCURRENT)


def _cell(engine: str, sig: str, phase: str, tmp_path: Path) -> None:
    tmp_path.mkdir()
    launcher, env = ENGINES[engine]
    checkpoint = tmp_path / "ckpt.pt"
    before = _shm()
    started = time.time()
    result = run_workers(launcher, 2, WORKER, env={
        **env, "DP_PLUGIN_TIMEOUT": str(TIMEOUT_S), "DP_PLUGIN_FUSION_THRESHOLD": "1",
        "FAULT_PHASE": phase, "FAULT_SIGNAL": sig, "FAULT_CHECKPOINT": str(checkpoint),
    }, timeout=240, check=False)  # a loaded 2-core machine needs minutes to start torch
    ended = time.time()
    out = result.output
    victim = 0 if phase == "save" else 1
    survivor = 1 - victim
    faults = {int(r): float(t) for r, t in
              re.findall(r"\brank (\d+) pid \d+ FAULT at ([0-9.]+)", out)}
    assert list(faults) == [victim], out
    pids = dict(re.findall(r"\brank (\d) pid (\d+) starts", out))
    if phase != "init":  # every rank that trained a step says which SIGTERM handler it has
        handlers = dict(re.findall(r"\brank (\d) SIGTERM handler (.*)", out))
        assert handlers == {"0": "default", "1": "default"}, out
    finished, errors = _times(result, "finished"), _times(result, "error")
    if launcher == "env":  # the survivor's own clock: its message or its end
        said = errors.get(survivor, finished.get(survivor))
        assert said is not None, out
        took = said - faults[victim]
    else:  # mpiexec ends the survivor: when the job ended
        took = ended - faults[victim]
    assert took < LIMIT_S, f"the survivor took {took:.1f} s after the fault:\n{out}"
    if launcher == "env":
        codes = result.returncodes
        assert codes[victim] == -SIGNUM[sig], out
        if phase == "shutdown":
            assert codes[survivor] == 0 and survivor in finished, out
        else:
            assert codes[survivor] == 1 and survivor in errors, out
            message = re.search(rf"\brank {survivor} error at [0-9.]+: (.*)", out)
            assert message is not None and f"rank {survivor}" in message.group(1), out
    else:
        assert result.returncodes[0] != 0, out
        # mpiexec names the process by its pid (every rank printed its own):
        # the victim, by its signal; in the init cell, where the victim died
        # before MPI started, the survivor, which mpiexec killed (SIGKILL).
        named, code = ((survivor, 9) if phase == "init" else (victim, SIGNUM[sig]))
        assert "BAD TERMINATION" in out and f"PID {pids[str(named)]} RUNNING AT" in out, out
        assert f"EXIT CODE: {code}\n" in out, out
        if phase != "shutdown":
            assert not finished, out
    left = _shm() - before
    if left:
        time.sleep(0.5)  # another test's segment may be about to be unlinked
        left &= _shm()
    assert not left, f"left in /dev/shm: {sorted(left)}\n{out}"
    old = re.search(r"rank 0 old checkpoint sha256 ([0-9a-f]{64})", out)
    if phase == "init":
        assert old is None and not checkpoint.exists(), out
    else:
        assert old is not None, out
        assert hashlib.sha256(checkpoint.read_bytes()).hexdigest() == old.group(1), out
    table = os.environ.get("FAULT_MATRIX_TABLE")
    if table:  # measured times, for docs/reliability.md
        codes = ("exit codes " + ", ".join(map(str, result.returncodes)) if launcher == "env"
                 else f"mpiexec exit {result.returncodes[0]}, BAD TERMINATION")
        with _table_lock, open(table, "a") as f:
            f.write(f"| {engine} | {sig} | {phase} | {codes} | {took:.1f} s | "
                    f"{ended - faults[victim]:.1f} s | {ended - started:.1f} s |\n")
