"""scripts/two_hosts.py: the BERT example across two network namespaces.

Two "hosts" joined by a veth pair; torchrun with c10d rendezvous and
``--nnodes 2`` (Gloo: it must find the veth interface itself through
dp_plugin.netif, else rank 1 cannot connect), and MPICH's mpiexec reaching
host B through the script (MPI engine). The namespaces must be gone
afterwards. Skipped where namespaces cannot be
created (not root, or no iproute2).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.multiproc.harness import free_port, run_workers

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "two_hosts.py"
TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "16",
        "--vocab-size", "500", "--global-batch", "8", "--steps", "4", "--warmup-steps", "1",
        "--log-every", "1", "--checkpoint-every", "0", "--no-progress"]


def _namespaces_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = "dp2h-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces (`ip netns add` says: {made.stderr.strip()})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("dp2h-")}


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_bert_runs_across_two_namespaces(launcher: str, tmp_path: Path) -> None:
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    before = _namespaces()
    result = run_workers("env", 1, SCRIPT,
                         args=["--launcher", launcher, "--port", str(free_port()),
                               "--timeout", "200", "--",
                               *TINY, "--output-dir", str(tmp_path)],
                         env={"DP_PLUGIN_TIMEOUT": "60"}, timeout=240)
    assert "summary: workers 2" in result.output, result.output
    assert re.search(r"step 4 loss \d", result.output), result.output
    assert f"({launcher})" in result.output and "launchers exited with [0" in result.output
    assert _namespaces() == before, "namespaces were left behind"
