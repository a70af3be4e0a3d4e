"""docs/migrating.md is what scripts/migrating_table.py generates from the installed modules.

Regenerate with ``python scripts/migrating_table.py`` after changing a public
name of dp_plugin.torch / .tensorflow / .keras or the script's NOTES.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_migrating_page_is_up_to_date() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "migrating_table.py"), "--check"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
