"""docs/torch.md's mixed-precision program runs as written: under torchrun at
2 ranks, GradScaler with ``synchronize()`` / ``skip_synchronize()``, then
``save_checkpoint`` / ``load_checkpoint`` of the model, optimizer and scaler."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.multiproc.harness import run_workers

PAGE = Path(__file__).resolve().parents[2] / "docs" / "torch.md"


def amp_program() -> str:
    section = PAGE.read_text().split("## Mixed precision (AMP)", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"^```python\n(.*?)^```$", section, flags=re.S | re.M)
    assert len(found) == 1, "docs/torch.md's AMP section should hold one python program"
    return found[0]


def test_the_amp_program_uses_the_scaler_and_the_checkpoint() -> None:
    code = amp_program()
    for needed in ("GradScaler", "opt.synchronize()", "skip_synchronize()",
                   "hvd.save_checkpoint", "hvd.load_checkpoint"):
        assert needed in code, needed


@pytest.mark.multiproc
def test_the_amp_program_runs_at_two_ranks(tmp_path: Path) -> None:
    script = tmp_path / "amp_train.py"
    script.write_text(amp_program())
    checkpoint = tmp_path / "amp.pt"
    result = run_workers("torchrun", 2, script, args=[str(checkpoint)],
                         env={"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "60"},
                         timeout=240)
    assert result.returncodes == [0], result.output  # torchrun's: 0 when every rank's is
    assert re.search(r"step 4 loss [0-9.]+ scale [0-9.]+", result.output), result.output
    assert checkpoint.exists(), result.output
