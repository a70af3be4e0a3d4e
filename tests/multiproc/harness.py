"""Start real worker processes under a real launcher, with a deadline.

Every multi-process test goes through ``run_workers``: it picks a free port,
runs the workers in their own process group(s), kills the whole tree when the
deadline passes (a hang is a failure, reported as such, never a skip) and
checks every exit code.

Launchers:
- ``env``: ``nprocs`` plain ``python script`` processes with the variables
  torchrun would set (cheap: no launcher start-up). Output lines are prefixed
  ``[rank R] ``.
- ``torchrun``: the real ``torchrun --nproc_per_node N`` (prefixes ``[defaultR]:``).
- ``mpirun``: MPICH's ``mpiexec -n N`` from the venv; each rank's output is
  captured in a file of its own and prefixed ``[rank R] `` (mpiexec's own
  lines ``[mpiexec] ``).
- ``horovodrun``: ``horovodrun --gloo -np N -H localhost:N`` (prefixes ``[R]<stdout>:``).

Warm ranks: under ``env`` and ``horovodrun`` each rank is forked
by a pre-warmed server (tests/multiproc/forkserver.py: torch and dp_plugin
imported, one optimizer step run, never initialised) instead of starting a
fresh interpreter; the launchers themselves stay real (what they start is
``warm_client.py`` in place of ``python``). ``fresh=True`` runs one launch
fresh (the canaries that cover interpreter start-up and exit, and runs that
need a process of their own: network namespaces, process scans);
``DP_PLUGIN_TEST_FRESH=1`` runs every launch fresh. torchrun and mpirun
launches are always fresh.

Workers run one case per launch (``--case NAME``, see workers/_fail_fast.py);
``worker_cases`` lists a worker's cases for ``pytest.mark.parametrize``.

``run_cells`` runs independent launches ("cells") of one test concurrently,
in threads: for cells that mostly wait (a deadline, a killed rank), not
for CPU-bound ones. Each cell is an ordinary ``run_workers`` call with its
own port, deadline and exit-code checks; a failure names its cell.

``RunResult.returncodes`` holds one exit code per worker for ``env`` and the
launcher's single exit code otherwise (launchers fail when any worker fails).
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import fcntl
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from dp_plugin.launch.variables import (
    LAUNCHER_VARIABLE_NAMES,
    LAUNCHER_VARIABLE_PREFIXES,
    is_launcher_variable,
    launcher_variables,
)

LAUNCHERS = ("env", "torchrun", "mpirun", "horovodrun")

BIN_DIR = Path(sys.executable).parent
"""The venv's bin: torchrun, mpiexec and horovodrun are taken from here."""

_HERE = Path(__file__).resolve().parent
WARM_LAUNCHERS = ("env", "horovodrun")
"""Launchers whose ranks the fork server starts; torchrun's and mpiexec's are
always fresh (forkserver.py says why for mpiexec)."""
ALL_FRESH = os.environ.get("DP_PLUGIN_TEST_FRESH", "") == "1"
"""``DP_PLUGIN_TEST_FRESH=1``: every launch starts fresh interpreters."""
_TF_IMPORT = re.compile(
    r"^\s*(import|from)\s+(tensorflow|keras|dp_plugin\.tensorflow|dp_plugin\.keras)\b", re.M)
_LIGHTNING_IMPORT = re.compile(r"^\s*(import|from)\s+(lightning|dp_plugin\.lightning)\b", re.M)

# Variables that say "a launcher started this process" (dp_plugin.launch.variables
# owns the one list). If any leaks in from the shell that runs pytest, a worker
# would believe it is someone else.
__all__ = [
    "LAUNCHERS", "LAUNCHER_VARIABLE_NAMES", "LAUNCHER_VARIABLE_PREFIXES", "RunResult",
    "assert_ranks_ok", "free_port", "is_launcher_variable", "launcher_variables", "run_cells",
    "run_workers", "worker_cases",
]


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (bound to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunResult:
    returncodes: list[int]
    """One per worker (``env``) or the launcher's single code (others)."""
    output: str
    """stdout and stderr of every process, each line tagged with its rank."""


def run_workers(
    launcher: str,
    nprocs: int,
    script: str | Path,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
    check: bool = True,
    hosts: Sequence[tuple[str, str]] | None = None,
    launcher_args: Sequence[str] = (),
    fresh: bool = False,
) -> RunResult:
    """Run ``script`` on ``nprocs`` ranks under ``launcher`` and wait for all.

    Raises ``AssertionError`` with the collected output when the run takes
    longer than ``timeout`` seconds (the process tree is killed: a hang) or,
    with ``check=True``, when any exit code is nonzero.

    ``hosts`` (``env`` only): one ``(network namespace, address)`` per rank;
    each rank runs inside its namespace (``ip netns exec``) and rank 0's
    address is MASTER_ADDR, as on several hosts (see test_faults.py).
    ``launcher_args`` go to the launcher before the script (e.g. torchrun's
    ``--max-restarts 1``); launcher ``env`` has none.

    ``fresh=True``: the ranks are fresh interpreters, not forks of the warm
    server (always so for torchrun, ``hosts=`` and ``DP_PLUGIN_TEST_FRESH=1``).
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r} is not known; valid launchers: {LAUNCHERS}")
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if launcher_args and launcher == "env":
        raise ValueError("launcher_args need a real launcher; launcher 'env' has none")
    script = str(Path(script).resolve())
    base_env = _clean_env(env)
    warm = not (fresh or ALL_FRESH or hosts is not None or launcher not in WARM_LAUNCHERS)
    # What starts one rank's "python script args": a fresh interpreter, or a
    # client of the warm server of the script's flavour.
    python = [sys.executable]
    if warm:
        python = [sys.executable, "-S", str(_HERE / "warm_client.py"),
                  _warm_servers.path(_flavour(script, base_env))]
    with tempfile.TemporaryDirectory(prefix="dp_plugin_run_") as tmp:
        jobs: list[tuple[list[str], dict[str, str], str]] = []
        rank_files: list[tuple[Path, str]] = []
        if hosts is not None and (launcher != "env" or len(hosts) != nprocs):
            raise ValueError("hosts= needs the env launcher and one (namespace, address) per rank")
        if launcher == "env":
            port = str(free_port())
            for rank in range(nprocs):
                rank_env = dict(base_env)
                rank_env.update(
                    RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                )
                cmd = [*python, script, *args]
                if hosts is not None:  # one rank per host: local rank 0 of 1
                    rank_env.update(MASTER_ADDR=hosts[0][1], LOCAL_RANK="0",
                                    LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank),
                                    GROUP_WORLD_SIZE=str(nprocs))
                    cmd = ["ip", "netns", "exec", hosts[rank][0], *cmd]
                jobs.append((cmd, rank_env, f"[rank {rank}] "))
        elif launcher == "torchrun":
            cmd = [str(BIN_DIR / "torchrun"), "--nnodes", "1", "--nproc_per_node", str(nprocs),
                   "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                   "--tee", "3", *launcher_args, script, *args]
            jobs.append((cmd, base_env, ""))
        elif launcher == "mpirun":
            # Hydra's -prepend-rank tags every write(), not every line, and
            # splits a print into fragments; each rank writes a file instead.
            redirect = (f'exec "$0" "$@" > "{tmp}/rank.${{PMI_RANK:-$OMPI_COMM_WORLD_RANK}}.txt" '
                        "2>&1")
            cmd = [str(BIN_DIR / "mpiexec"), "-n", str(nprocs), *launcher_args, "sh", "-c",
                   redirect, *python, script, *args]
            jobs.append((cmd, base_env, "[mpiexec] "))
            rank_files = [(Path(tmp) / f"rank.{r}.txt", f"[rank {r}] ") for r in range(nprocs)]
        else:
            cmd = [str(BIN_DIR / "horovodrun"), "--gloo", "-np", str(nprocs),
                   "-H", f"localhost:{nprocs}", *launcher_args, *python, script, *args]
            jobs.append((cmd, base_env, ""))
        _mpich_jobs.enter()  # any rank may start MPICH (_MpichJobs)
        what = f"{launcher} x{nprocs} {Path(script).name}" + ("" if warm else " (fresh)")
        try:
            return _run(jobs, rank_files, Path(tmp), timeout, check, what)
        finally:
            _mpich_jobs.leave()


def run_cells(cells: Mapping[str, Callable[[], object]], workers: int) -> dict[str, object]:
    """Call every cell (a function that launches and checks one run) with at
    most ``workers`` at a time, in threads; return each cell's result by
    name. Every cell runs to its end even when others fail; then one
    ``AssertionError`` names each failed cell with its error. For cells that
    mostly wait (a deadline, a dead rank): CPU-bound launches gain nothing."""
    results: dict[str, object] = {}
    failures: dict[str, BaseException] = {}
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="cell") as pool:
        futures = {name: pool.submit(cell) for name, cell in cells.items()}
        for name, future in futures.items():
            try:
                results[name] = future.result()
            except BaseException as exc:  # also pytest.fail's; reported below, by cell
                if isinstance(exc, KeyboardInterrupt):
                    raise
                failures[name] = exc
    if failures:
        raise AssertionError(
            f"{len(failures)} of {len(cells)} cells failed: {', '.join(failures)}\n\n"
            + "\n\n".join(f"=== cell {name}: {type(exc).__name__}: {exc}"
                           for name, exc in failures.items()))
    return results


def _flavour(script: str, env: Mapping[str, str]) -> str:
    """The warm server for ``script`` (forkserver.py's flavours):
    ``tensorflow`` for a worker that imports TensorFlow or Keras itself,
    ``keras-torch`` for one that imports Keras with ``KERAS_BACKEND=torch``
    (and not TensorFlow), ``lightning`` for one that imports Lightning, else
    ``torch``."""
    text = Path(script).read_text()
    imports = {m.group(2) for m in _TF_IMPORT.finditer(text)}
    if not imports:
        return "lightning" if _LIGHTNING_IMPORT.search(text) else "torch"
    if env.get("KERAS_BACKEND") == "torch" and imports <= {"keras", "dp_plugin.keras"}:
        return "keras-torch"
    return "tensorflow"


class _WarmServers:
    """One fork server per flavour, started at its first use and stopped at
    exit (closing its stdin ends it and every rank it still has)."""

    START_TIMEOUT_S = 180.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
        self._dir = ""

    def path(self, flavour: str) -> str:
        with self._lock:
            server = self._servers.get(flavour)
            if server is None or server[0].poll() is not None:
                server = self._servers[flavour] = self._start(flavour)
            return server[1]

    def _start(self, flavour: str) -> tuple[subprocess.Popen[bytes], str]:
        if not self._dir:
            self._dir = tempfile.mkdtemp(prefix="dp_plugin_warm_")
            atexit.register(self.stop)
        path = os.path.join(self._dir, f"{flavour}.sock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        log = os.path.join(self._dir, f"{flavour}.log")
        env = _clean_env({"TF_CPP_MIN_LOG_LEVEL": "2"})
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-u", str(_HERE / "forkserver.py"), flavour, path],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
                start_new_session=True)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], self.START_TIMEOUT_S)
        line = proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            proc.kill()
            proc.wait()
            raise AssertionError(
                f"the {flavour} fork server did not start within {self.START_TIMEOUT_S:g} s "
                f"(exit code {proc.returncode}); its log:\n{Path(log).read_text()}")
        return proc, path

    def stop(self) -> None:
        with self._lock:
            for proc, _ in self._servers.values():
                with contextlib.suppress(OSError):
                    assert proc.stdin is not None
                    proc.stdin.close()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self._servers.clear()
            if self._dir:
                shutil.rmtree(self._dir, ignore_errors=True)


_warm_servers = _WarmServers()


class _MpichJobs:
    """MPICH unlinks its shared-memory segments at MPI_Finalize; a rank
    killed (by a test, mpiexec or the deadline) leaves its 2 MiB
    ``mpich_shm_*`` behind. Not only under mpirun: a rank of any launcher
    that imported mpi4py (Lightning's MPI environment detection does) has
    started MPICH, and one that ends by an error or ``os._exit`` skips
    MPI_Finalize. What appeared in /dev/shm while launches ran is theirs;
    it is deleted when the last of them ends (``run_cells`` may
    run several at once, and pytest-xdist runs tests in two processes:
    deleting a segment a running job has yet to open would break it). The
    count of running jobs and the segments seen before the first are kept
    in a file under a lock, shared by every test process of this user; a
    process that died holding jobs is dropped from the count."""

    def __init__(self, state: Path | None = None) -> None:
        self._lock = threading.Lock()
        self._state = state or (Path(tempfile.gettempdir())
                                / f"dp_plugin_mpich_jobs.{os.getuid()}.json")

    def enter(self) -> None:
        with self._shared() as state:
            if not state["running"]:
                state["before"] = sorted(_mpich_segments())
            state["running"][str(os.getpid())] = state["running"].get(str(os.getpid()), 0) + 1

    def leave(self) -> None:
        with self._shared() as state:
            me = str(os.getpid())
            state["running"][me] -= 1
            if not state["running"][me]:
                del state["running"][me]
            if not state["running"]:
                self._sweep(state)

    @staticmethod
    def _sweep(state: dict[str, Any]) -> None:
        for name in _mpich_segments() - set(state["before"]):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", name))

    @contextlib.contextmanager
    def _shared(self) -> Iterator[dict[str, Any]]:
        with self._lock, open(f"{self._state}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state = json.loads(self._state.read_text())
            except (FileNotFoundError, ValueError):
                state = {"running": {}, "before": []}
            alive = {pid: n for pid, n in state["running"].items() if psutil.pid_exists(int(pid))}
            if state["running"] and not alive:
                self._sweep(state)  # the last jobs' process died: what they left goes now
            state["running"] = alive
            yield state
            self._state.write_text(json.dumps(state))


_mpich_jobs = _MpichJobs()


def _mpich_segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("mpich_shm_")}
    except FileNotFoundError:
        return set()


def worker_cases(script: str | Path) -> list[str]:
    """The case names of a worker: the keys of its module-level ``CASES`` dict
    literal (see workers/_fail_fast.py), read without importing the worker
    (which would load torch or TensorFlow into the pytest process)."""
    tree = ast.parse(Path(script).read_text(), filename=str(script))
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == "CASES" for t in targets):
            value = node.value  # type: ignore[union-attr]
            if isinstance(value, ast.Dict) and all(
                isinstance(k, ast.Constant) and isinstance(k.value, str) for k in value.keys
            ):
                return [k.value for k in value.keys]  # type: ignore[union-attr]
            break
    raise ValueError(f"{script} has no module-level CASES = {{'name': function, ...}} literal")


def assert_ranks_ok(result: RunResult, nprocs: int, marker: str = "OK") -> None:
    """Every rank printed ``rank R <marker>`` (e.g. ``rank 2 OK``)."""
    missing = [
        r for r in range(nprocs)
        if not re.search(rf"\brank {r} {re.escape(marker)}(?![\w-])", result.output)
    ]
    if missing:
        raise AssertionError(
            f"ranks {missing} did not print 'rank R {marker}' (exit codes "
            f"{result.returncodes}); output:\n{result.output}"
        )


def assert_cases_ok(result: RunResult, nprocs: int, cases: Sequence[str]) -> None:
    """A launch of ``--case A B ...``: every rank printed ``case NAME passed``
    for each case (``run_cases`` prints it when a launch runs several), then
    ``OK``."""
    for case in cases if len(cases) > 1 else ():
        assert_ranks_ok(result, nprocs, marker=f"case {case} passed")
    assert_ranks_ok(result, nprocs)


# -- internals -------------------------------------------------------------

def _clean_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not is_launcher_variable(k)}
    # Launchers and workers must resolve python, mpiexec etc. from this venv.
    env["PATH"] = f"{BIN_DIR}{os.pathsep}{env.get('PATH', '')}"
    # Several ranks share few cores; torch's default thread count oversubscribes them.
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _run(jobs: list[tuple[list[str], dict[str, str], str]], rank_files: list[tuple[Path, str]],
         tmp: Path, timeout: float, check: bool, what: str) -> RunResult:
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[IO[bytes]] = []
    hung = False
    try:
        for i, (cmd, env, _) in enumerate(jobs):
            logs.append(open(tmp / f"out{i}.txt", "wb"))  # noqa: SIM115 - closed in finally
            procs.append(subprocess.Popen(
                cmd, env=env, stdout=logs[-1], stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            ))
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung = True
                break
    finally:
        # Also on success: a worker a launcher left behind must not outlive the test.
        _kill_all(procs)
        for log in logs:
            log.close()

    outputs = [(tmp / f"out{i}.txt", prefix) for i, (_, _, prefix) in enumerate(jobs)]
    output = "".join(
        _prefixed(path.read_bytes().decode(errors="replace"), prefix)
        for path, prefix in outputs + rank_files
        if path.exists()
    )
    codes = [p.returncode for p in procs]
    if hung:
        raise AssertionError(
            f"HANG: {what} did not finish within {timeout:g} s; the process tree was killed "
            f"(exit codes after kill: {codes}). Output:\n{output}"
        )
    result = RunResult(returncodes=codes, output=output)
    if check and any(c != 0 for c in codes):
        raise AssertionError(f"{what} failed with exit codes {codes}. Output:\n{output}")
    return result


def _prefixed(text: str, prefix: str) -> str:
    if not text:
        return ""
    lines = text.splitlines()
    return "".join(f"{prefix}{line}\n" for line in lines)


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill every process the run started, including workers that a launcher
    moved into a session of their own (horovodrun does)."""
    victims: list[psutil.Process] = []
    for proc in procs:
        if proc.poll() is not None:
            continue  # reaped: its pid may already belong to someone else
        with contextlib.suppress(psutil.NoSuchProcess):
            victims.extend(psutil.Process(proc.pid).children(recursive=True))
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    for victim in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.kill()
    for proc in procs:
        if proc.returncode is None:
            proc.wait()
