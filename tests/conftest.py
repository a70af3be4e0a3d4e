"""Which tests may run beside which under pytest-xdist (``make test`` runs two
test processes, ``-n 2 --dist loadgroup``; docs/testing.md).

Most tests are independent: each launch has its own port, temporary
directory and deadline, and the harness's MPICH segment bookkeeping is shared
between test processes. The tests that make network namespaces, shape links
or start daemons (SLURM, Ray, the rehearsal cluster) run in one group, one
after another in one process: they name host-wide things (namespaces, veth
links, hosts files, ``/etc/netns``) and sweep stale ones by prefix, and
``test_faults.py`` looks for its workers among all processes. Their time is
mostly waiting on links and daemons, which is what the other process fills.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
HOST_WIDE = (_HERE / "examples", _HERE / "schedulers", _HERE / "multiproc" / "test_faults.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if any(path == p or p in path.parents for p in HOST_WIDE):
            item.add_marker(pytest.mark.xdist_group("host_wide"))
