"""``dp-plugin build-horovod`` keeps a Horovod it did not build (a site's
NCCL or MPI build): it says what it found and how dp_plugin uses it, and
replaces it only with ``--force``. The environment is this interpreter with
a stand-in ``horovod`` package first on its path; pip is never run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dp_plugin.cli import build_horovod
from dp_plugin.cli.build_horovod import BuildError, build

TORCH_OK = '''
def gloo_built(): return False
def mpi_built(): return True
def nccl_built(): return True
'''


def site_horovod(tmp_path: Path, torch_init: str) -> None:
    """A Horovod 0.28.1 without build-horovod's marker, installed by no cache of ours."""
    pkg = tmp_path / "site" / "horovod"
    (pkg / "torch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '0.28.1'\n")
    (pkg / "torch" / "__init__.py").write_text(torch_init)
    info = tmp_path / "site" / "horovod-0.28.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: horovod\nVersion: 0.28.1\n")


@pytest.fixture
def no_pip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    """Records pip installs instead of running them; puts the stand-in first."""
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("DP_PLUGIN_WHEEL_CACHE", str(tmp_path / "cache"))
    real = subprocess.run
    installs: list[list[str]] = []

    def run(cmd: list[str], *args: Any, **kwargs: Any) -> Any:
        if "pip" in cmd:
            installs.append(list(cmd))
            raise AssertionError(f"pip must not run: {cmd}")
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(build_horovod.subprocess, "run", run)
    return installs


def test_a_sites_own_horovod_is_kept_and_explained(
        tmp_path: Path, no_pip: list[list[str]]) -> None:
    site_horovod(tmp_path, TORCH_OK)
    said = build(sys.executable)
    assert no_pip == []
    assert said.startswith("kept the Horovod already installed"), said
    assert f"Horovod 0.28.1 at {tmp_path / 'site' / 'horovod'}" in said, said
    assert "torch extension built with mpi, nccl" in said, said
    assert "dp_plugin uses an installed Horovod as it is" in said, said
    assert "dp-plugin build-horovod --force" in said, said


def test_a_broken_site_horovod_is_left_alone_with_the_fix(
        tmp_path: Path, no_pip: list[list[str]]) -> None:
    site_horovod(tmp_path, "raise ImportError('libcudart.so.12: cannot open')\n")
    with pytest.raises(BuildError, match=r"left as it is.*--force"):
        build(sys.executable)
    assert no_pip == []


def test_force_replaces_it(tmp_path: Path, no_pip: list[list[str]],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    site_horovod(tmp_path, TORCH_OK)
    def fake_wheel(python: str, out: Path, work: Path) -> None:
        out.mkdir()
        (out / "horovod-0.28.1-cp3-cp3-linux_x86_64.whl").write_bytes(b"")

    monkeypatch.setattr(build_horovod, "_build_wheel", fake_wheel)
    with pytest.raises(AssertionError, match="pip must not run"):
        build(sys.executable, force=True)  # reaches the install: the site build is replaced
    assert no_pip and "--force-reinstall" in no_pip[0]
