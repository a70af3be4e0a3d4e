"""Where the test suite's time goes: each test's wall time beside the CPU time
of everything it ran (ranks, launchers, warm servers' forks, daemons), as a
table, longest first.

    sudo .venv/bin/python benchmarks/suite_cpu.py [PYTEST ARGS...]
    sudo .venv/bin/python benchmarks/suite_cpu.py tests/multiproc/test_tf_elastic.py -p no:xdist

Each pytest process moves itself into a cgroup-v1 ``cpuacct`` group of its
own (``/sys/fs/cgroup/cpuacct/dp_suite_cpu_<pid>_<worker>``); every process
it starts, and every daemon those start, stays in that group, so the
group's CPU counter across a test is that test's CPU time (a warm server
started during a test is charged to it). Needs root and cgroup v1's
``cpuacct``; exits 77 saying so where either is missing.

What to read: a test whose CPU time is close to its wall time (two tests
side by side on two cores each get one) is CPU-bound and gains nothing from
more test processes; a test whose wall time is far above its CPU time
waits (a deadline, a poll, a launcher) and would. CPU time holds up under
load from other sessions far better than wall time does.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
_state: dict[str, Any] = {}


def _usage() -> float:
    return int((_state["group"] / "cpuacct.usage").read_text()) / 1e9


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    group = CPUACCT / f"dp_suite_cpu_{os.environ['SUITE_CPU_RUN']}_{worker}"
    group.mkdir(exist_ok=True)
    (group / "cgroup.procs").write_text(str(os.getpid()))
    _state["group"] = group


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    cpu, wall = _usage(), time.monotonic()
    yield
    row = [item.nodeid, time.monotonic() - wall, _usage() - cpu]
    # A line per test, written at once (what xdist workers wrote from
    # pytest_unconfigure never reached the file).
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(Path(os.environ["SUITE_CPU_OUT"]) / f"{worker}.jsonl", "a") as out:
        out.write(json.dumps(row) + "\n")


def main(args: list[str]) -> int:
    if os.geteuid() != 0 or not (CPUACCT / "cpuacct.usage").exists():
        print("suite_cpu: needs root and cgroup v1's cpuacct at /sys/fs/cgroup/cpuacct",
              file=sys.stderr)
        return 77
    here = Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory(prefix="suite_cpu_") as out:
        os.environ.update(SUITE_CPU_RUN=str(os.getpid()), SUITE_CPU_OUT=out,
                          PYTHONPATH=os.pathsep.join(
                              p for p in (str(here), os.environ.get("PYTHONPATH")) if p))
        sys.path.insert(0, str(here))
        started = time.monotonic()
        code = pytest.main([*args, "-p", "suite_cpu"])
        wall = time.monotonic() - started
        rows = [json.loads(line) for f in Path(out).glob("*.jsonl")
                for line in f.read_text().splitlines()]
    (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))  # out of the group (no xdist)
    for group in CPUACCT.glob(f"dp_suite_cpu_{os.getpid()}_*"):
        for _ in range(50):  # daemons stopped by the last test may take a moment to exit
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    rows.sort(key=lambda r: -r[1])
    print("\n| test | wall (s) | CPU (s) | CPU / wall |\n|---|---|---|---|")
    for nodeid, seconds, cpu in rows:
        if seconds >= 1.0:
            print(f"| `{nodeid}` | {seconds:.1f} | {cpu:.1f} | {cpu / seconds:.2f} |")
    total_wall, total_cpu = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"\n{len(rows)} tests: {total_wall:.0f} s of test time, {total_cpu:.0f} s of CPU; "
          f"the session took {wall:.0f} s; load average now {os.getloadavg()[0]:.1f}")
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
