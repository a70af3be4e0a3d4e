"""docs/from-ddp.md runs as written: each of its ``python`` blocks is a whole
program, run under torchrun at 2 ranks; the DDP script and its dp_plugin
rewrite end with the same weights (the page's claim that only the
distribution changes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.multiproc.harness import run_workers

PAGE = Path(__file__).resolve().parents[2] / "docs" / "from-ddp.md"


def blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", PAGE.read_text(), flags=re.S | re.M)


def test_the_page_has_its_three_programs() -> None:
    found = blocks()
    assert len(found) == 3, found
    assert "DistributedDataParallel" in found[0] and "dp_plugin" not in found[0]
    assert "DistributedDataParallel" not in found[1] and "import dp_plugin.torch" in found[1]


def _run(code: str, where: Path, name: str) -> str:
    script = where / name
    script.write_text(code)
    result = run_workers("torchrun", 2, script,
                         env={"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "60"},
                         timeout=240)
    assert result.returncodes == [0], result.output  # torchrun's: 0 when every rank's is
    return result.output


@pytest.mark.multiproc
def test_the_ddp_script_and_its_rewrite_end_with_the_same_weights(tmp_path: Path) -> None:
    ddp, ours, _ = blocks()
    weights = []
    for code, name in ((ddp, "ddp_train.py"), (ours, "dp_train.py")):
        output = _run(code, tmp_path, name)
        found = re.findall(r"weights (-?[0-9.e+-]+)", output)
        assert len(found) == 1, output  # rank 0 only
        weights.append(float(found[0]))
    assert weights[1] == pytest.approx(weights[0], rel=1e-5, abs=1e-6), weights


@pytest.mark.multiproc
def test_the_accumulation_and_comm_hook_program_runs(tmp_path: Path) -> None:
    output = _run(blocks()[2], tmp_path, "accumulate.py")
    for rank in (0, 1):
        assert f"rank {rank} done" in output, output
