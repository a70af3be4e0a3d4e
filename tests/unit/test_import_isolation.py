"""The core must load no framework at import time (STYLE.md, point 2)."""

import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "dp_plugin"

HEAVY = ("torch", "tensorflow", "keras", "mpi4py", "horovod")


def _loaded_after(statement: str) -> set[str]:
    code = (
        f"import sys\n{statement}\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()
    return set(filter(None, out.split(",")))


def test_import_dp_plugin_loads_no_framework() -> None:
    assert _loaded_after("import dp_plugin") == set()


def test_importing_every_core_module_loads_no_framework() -> None:
    modules = [
        "dp_plugin.config", "dp_plugin.launch.launchers", "dp_plugin.reduce.fusion",
        "dp_plugin.reduce.reducer",
        "dp_plugin.reduce.compression", "dp_plugin.api.horovod_names", "dp_plugin.api.timeline",
        "dp_plugin.agree.agreement", "dp_plugin.cli.check", "dp_plugin.reduce.collective",
        "dp_plugin.reduce.bucket", "dp_plugin.reduce.hooks",
        "dp_plugin.engines", "dp_plugin.engines.local", "dp_plugin.engines.torch_dist",
        "dp_plugin.engines.mpi", "dp_plugin.engines.horovod",
    ]
    assert _loaded_after("\n".join(f"import {m}" for m in modules)) == set()


def test_every_module_in_the_core_directory_loads_no_framework() -> None:
    """Walks dp_plugin/ itself, so a new core module (or one such as the old
    dp_plugin/keras.py, which imported the TensorFlow adapter) cannot escape
    the check by missing from the list above."""
    modules = sorted(
        "dp_plugin." + ".".join(path.relative_to(CORE).with_suffix("").parts)
        for path in CORE.rglob("*.py")
        if path.name != "__init__.py"
    )
    assert "dp_plugin.launch.launchers" in modules
    assert _loaded_after("\n".join(f"import {m}" for m in modules)) == set()
