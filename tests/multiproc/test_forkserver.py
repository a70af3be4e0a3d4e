"""The warm fork server (forkserver.py, warm_client.py) gives a rank what a
fresh ``python script`` would have, and ends as it would end: the harness
relies on it for most launches, so its differences would be every test's."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.multiproc import harness
from tests.multiproc.harness import run_workers

pytestmark = pytest.mark.skipif(harness.ALL_FRESH, reason="DP_PLUGIN_TEST_FRESH=1: no fork server")

PROBE = '''
import atexit, os, random, signal, sys, tempfile, threading, time
print("rank", os.environ["RANK"], "argv", sys.argv[1:], "cwd", os.getcwd(), flush=True)
print("rank", os.environ["RANK"], "tempdir", tempfile.gettempdir(), flush=True)
print("rank", os.environ["RANK"], "path1", sys.path[1], "main", __name__, flush=True)
print("rank", os.environ["RANK"], "random", random.random(), flush=True)
print("rank", os.environ["RANK"], "torch", "torch" in sys.modules, flush=True)
print("rank", os.environ["RANK"], "pid", os.getpid(), "launched",
      os.environ.get("DP_PLUGIN_TEST_LAUNCHED_PID"), flush=True)
action = sys.argv[1]
if action == "raise":
    raise ValueError("raised by the script")
if action == "exit":
    sys.exit(int(sys.argv[2]))
if action == "kill":
    os.kill(os.getpid(), getattr(signal, sys.argv[2]))
if action == "threads":  # a non-daemon thread and an atexit hook run before the end
    atexit.register(lambda: print("rank", os.environ["RANK"], "atexit ran", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread done", flush=True))).start()
if action == "wait":  # until SIGTERM (sent to the launcher's process) ends it
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {os.environ['DP_PLUGIN_TEST_LAUNCHED_PID']}")
    os.rename(sys.argv[2] + ".tmp", sys.argv[2])
    time.sleep(60)
'''


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return script


def _lines(output: str, what: str) -> dict[str, str]:
    return dict(re.findall(rf"\brank (\d+) {what} (.*)", output))


def test_a_warm_rank_runs_the_script_as_a_fresh_one_would(probe: Path, tmp_path: Path) -> None:
    extra, temp = tmp_path / "lib", tmp_path / "temp"
    extra.mkdir()
    temp.mkdir()
    result = run_workers("env", 2, probe, ["threads", "x"],
                         env={"PYTHONPATH": str(extra), "TMPDIR": str(temp)}, timeout=60)
    out = result.output
    assert _lines(out, "tempdir") == {"0": str(temp), "1": str(temp)}, out  # not the server's
    assert _lines(out, "argv") == {r: f"['threads', 'x'] cwd {os.getcwd()}" for r in "01"}, out
    assert _lines(out, "path1") == {r: f"{extra} main __main__" for r in "01"}, out
    assert _lines(out, "torch") == {"0": "True", "1": "True"}, out  # warm: imported already
    randoms = _lines(out, "random")
    assert len(set(randoms.values())) == 2, f"both ranks drew the same random number: {out}"
    launched = {r: v.split() for r, v in _lines(out, "pid").items()}
    assert all(v[0] != v[2] for v in launched.values()), out  # forked: not the client's pid
    assert out.count("thread done") == 2 and len(_lines(out, "atexit")) == 2, out


def test_fresh_launches_start_a_new_interpreter(probe: Path) -> None:
    result = run_workers("env", 2, probe, ["threads"], timeout=60, fresh=True)
    assert _lines(result.output, "torch") == {"0": "False", "1": "False"}, result.output
    assert _lines(result.output, "pid") == {r: f"{p} launched None" for r, p in
                                            re.findall(r"\brank (\d) pid (\d+)", result.output)}


@pytest.mark.parametrize(("args", "codes", "text"), [
    (["raise"], [1, 1], "ValueError: raised by the script"),
    (["exit", "3"], [3, 3], ""),
    (["kill", "SIGKILL"], [-9, -9], ""),
    (["kill", "SIGTERM"], [-15, -15], ""),
])
def test_a_warm_rank_ends_as_a_fresh_one(probe: Path, args: list[str], codes: list[int],
                                          text: str) -> None:
    result = run_workers("env", 2, probe, args, timeout=60, check=False)
    assert result.returncodes == codes, result.output
    assert text in result.output
    if text:  # the traceback starts at the script, as python prints it
        assert "forkserver.py" not in result.output and "runpy" not in result.output, result.output


def test_a_signal_to_the_launched_process_reaches_the_rank(probe: Path, tmp_path: Path) -> None:
    """SIGTERM to what the launcher started (the client) ends the forked rank
    with SIGTERM; the client then dies of it too."""
    with _waiting_rank(probe, tmp_path) as (rank, client, outcome):
        os.kill(client, signal.SIGTERM)
    assert outcome["codes"] == [-15], outcome
    assert not _alive(rank)


def test_a_killed_client_takes_its_rank_with_it(probe: Path, tmp_path: Path) -> None:
    """The harness ends a hung run by killing the processes it started: the
    forked ranks must not survive them."""
    with _waiting_rank(probe, tmp_path) as (rank, client, outcome):
        os.kill(client, signal.SIGKILL)
    assert outcome["codes"] == [-9], outcome
    gone = time.monotonic() + 10
    while _alive(rank) and time.monotonic() < gone:
        time.sleep(0.05)
    assert not _alive(rank), "the rank outlived its killed client"


@contextlib.contextmanager
def _waiting_rank(probe: Path, tmp_path: Path) -> Iterator[tuple[int, int, dict[str, object]]]:
    """One warm rank that waits: yields its pid, its client's pid and a dict
    that holds the run's exit codes and output once the block has ended it."""
    marker = tmp_path / "started"
    outcome: dict[str, object] = {}

    def run() -> None:
        result = run_workers("env", 1, probe, ["wait", str(marker)], timeout=60, check=False)
        outcome.update(codes=result.returncodes, output=result.output)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    rank, client = map(int, marker.read_text().split())
    try:
        yield rank, client, outcome
    finally:
        thread.join(60)


def _alive(pid: int) -> bool:
    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


@pytest.mark.parametrize(("worker", "env", "flavour"), [
    ("torch_sharded.py", {}, "torch"),
    ("keras_train.py", {}, "tensorflow"),
    ("keras_torch_train.py", {}, "tensorflow"),
    ("keras_torch_train.py", {"KERAS_BACKEND": "torch"}, "keras-torch"),
    ("tf_collectives.py", {"KERAS_BACKEND": "torch"}, "tensorflow"),
    ("lightning_strategy.py", {}, "lightning"),
])
def test_each_worker_gets_the_server_of_what_it_imports(worker: str, env: dict[str, str],
                                                        flavour: str) -> None:
    """A Keras worker on the torch backend is forked from a server that never
    imported TensorFlow (a Keras process keeps its first backend); Lightning's
    from one that imported Lightning."""
    script = Path(__file__).parent / "workers" / worker
    assert harness._flavour(str(script), env) == flavour


def test_the_keras_torch_server_has_keras_on_torch_and_no_tensorflow(tmp_path: Path) -> None:
    probe = tmp_path / "keras_probe.py"
    probe.write_text("import os, sys\nimport keras\nimport dp_plugin.keras\n"
                     "print('rank', os.environ['RANK'], 'backend', keras.backend.backend(),\n"
                     "      'tensorflow', 'tensorflow' in sys.modules, flush=True)\n")
    result = run_workers("env", 2, probe, env={"KERAS_BACKEND": "torch"}, timeout=120)
    for rank in (0, 1):
        assert f"rank {rank} backend torch tensorflow False" in result.output, result.output
