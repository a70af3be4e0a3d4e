"""The core must load no framework at import time (STYLE.md, point 2)."""

import subprocess
import sys

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
        "dp_plugin.config", "dp_plugin.launch", "dp_plugin.fusion", "dp_plugin.scheduler",
        "dp_plugin.compression", "dp_plugin.horovod_names", "dp_plugin.timeline",
        "dp_plugin.agreement", "dp_plugin.check", "dp_plugin.collective",
        "dp_plugin.buffer", "dp_plugin.hooks",
        "dp_plugin.engines", "dp_plugin.engines.local", "dp_plugin.engines.torch_dist",
        "dp_plugin.engines.mpi", "dp_plugin.engines.horovod",
    ]
    assert _loaded_after("\n".join(f"import {m}" for m in modules)) == set()
