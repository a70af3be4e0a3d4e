"""Multi-process tests: marked ``multiproc`` and checked for leaks.

A test that leaves launcher variables (RANK, OMPI_*, HOROVOD_RANK, ...) in
the pytest process, or a torch.distributed process group initialized, fails:
the next test would silently inherit another job's identity.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multiproc.harness import launcher_variables

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.multiproc)


@pytest.fixture(autouse=True)
def _no_leaked_launch_state() -> Iterator[None]:
    before = launcher_variables()
    yield
    problems: list[str] = []
    after = launcher_variables()
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    if changed:
        problems.append(
            "launcher variables changed in the pytest process: "
            + ", ".join(f"{k}={after.get(k)!r} (was {before.get(k)!r})" for k in changed)
        )
        for k in changed:  # restore, so that one leak does not fail every later test
            if k in before:
                os.environ[k] = before[k]
            else:
                os.environ.pop(k, None)
    torch = sys.modules.get("torch")
    if torch is not None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            problems.append("a torch.distributed process group is still initialized")
            dist.destroy_process_group()
    if problems:
        pytest.fail("test leaked launch state: " + "; ".join(problems) +
                    ". Run workers through tests.multiproc.harness.run_workers, "
                    "and shut engines down in the test")
