"""``dp-plugin build-horovod``: Horovod 0.28.1 (PyTorch + Gloo, CPU) for this torch.

Downloads Horovod's source distribution with pip, raises its C++ standard
from 14 to 17 (torch >= 2.1 headers need C++17; see docs/horovod-build.md),
builds a wheel against the torch that ``--python`` imports and installs it.
The wheel is cached outside any project, keyed by the Horovod, torch and
Python versions (``DP_PLUGIN_WHEEL_CACHE``, default
``~/.cache/dp_plugin/wheels``), so a second install takes seconds.

Standard library only: ``scripts/build_horovod.sh`` runs this file directly,
before dp_plugin itself is installed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HELP = "build and install Horovod 0.28.1 (PyTorch, Gloo) against the installed torch"
HOROVOD_VERSION = "0.28.1"
PATCHED_FILES = ("CMakeLists.txt", "horovod/torch/CMakeLists.txt")
OLD_STANDARD, NEW_STANDARD = "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)"
BUILD_ENV = {"HOROVOD_WITH_PYTORCH": "1", "HOROVOD_WITH_GLOO": "1", "HOROVOD_WITHOUT_MPI": "1",
             "HOROVOD_WITHOUT_TENSORFLOW": "1", "HOROVOD_WITHOUT_MXNET": "1"}


class BuildError(RuntimeError):
    """A step failed; the message says which and what to do."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter whose environment gets Horovod (default: this one)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="wheel cache (default: $DP_PLUGIN_WHEEL_CACHE or "
                             "~/.cache/dp_plugin/wheels)")
    parser.add_argument("--force", action="store_true",
                        help="reinstall even when Horovod is already installed")


def _ask(python: str, code: str) -> str | None:
    """What ``python -c code`` prints, or None when it fails."""
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def cache_dir(root: Path | None, torch_version: str, py_tag: str) -> Path:
    if root is None:
        env = os.environ.get("DP_PLUGIN_WHEEL_CACHE")
        xdg = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
        root = Path(env) if env else Path(xdg) / "dp_plugin" / "wheels"
    return root / f"horovod-{HOROVOD_VERSION}-torch{torch_version}-{py_tag}"


def patch_cxx_standard(src: Path) -> None:
    """C++14 -> C++17 in Horovod's two CMakeLists.txt; fails loudly if the line moved."""
    for rel in PATCHED_FILES:
        f = src / rel
        text = f.read_text()
        if OLD_STANDARD not in text:
            raise BuildError(f"{f} has no {OLD_STANDARD!r}; the patch no longer applies "
                             f"(is this Horovod {HOROVOD_VERSION}?)")
        f.write_text(text.replace(OLD_STANDARD, NEW_STANDARD))


def _build_wheel(python: str, out: Path, work: Path) -> None:
    pip = [python, "-m", "pip"]
    subprocess.run([*pip, "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    f"horovod=={HOROVOD_VERSION}", "-d", str(work)], check=True)
    with tarfile.open(work / f"horovod-{HOROVOD_VERSION}.tar.gz") as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4
            tar.extractall(work, filter="data")
        else:  # pragma: no cover - older interpreters
            tar.extractall(work)
    src = work / f"horovod-{HOROVOD_VERSION}"
    patch_cxx_standard(src)
    env = dict(os.environ, MAKEFLAGS=f"-j{os.cpu_count() or 1}", **BUILD_ENV)
    log = work / "build.log"
    with log.open("w") as f:
        done = subprocess.run([*pip, "wheel", "--no-build-isolation", "--no-deps", "-w",
                               str(out), str(src)], env=env, stdout=f, stderr=subprocess.STDOUT,
                              check=False)
    if done.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise BuildError(f"the build failed; last lines of its log:\n{tail}")


def build(python: str, root: Path | None = None, force: bool = False) -> str:
    """Install Horovod into ``python``'s environment; returns what was done."""
    torch_version = _ask(python, "import torch; print(torch.__version__.split('+')[0])")
    if torch_version is None:
        raise BuildError(f"{python} cannot import torch; install torch>=2.1 first "
                         "(pip install torch), then run this again")
    installed = _ask(python, "import horovod.torch, horovod; print(horovod.__version__)")
    if installed == HOROVOD_VERSION and not force:
        return f"horovod {HOROVOD_VERSION} already installed"
    py_tag = _ask(python, "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
    where = cache_dir(root, torch_version, str(py_tag))
    wheels = sorted(where.glob(f"horovod-{HOROVOD_VERSION}-*.whl"))
    if not wheels:
        print(f"build_horovod: building horovod {HOROVOD_VERSION} for torch {torch_version} "
              f"({py_tag}); a few minutes", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            _build_wheel(python, Path(tmp) / "out", Path(tmp))
            where.mkdir(parents=True, exist_ok=True)
            for whl in (Path(tmp) / "out").glob("horovod-*.whl"):
                shutil.copy2(whl, where / whl.name)
        wheels = sorted(where.glob(f"horovod-{HOROVOD_VERSION}-*.whl"))
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--force-reinstall", str(wheels[0])], check=True)
    if _ask(python, "import horovod.torch as h; assert h.gloo_built()") is None:
        raise BuildError(f"{wheels[0]} installed but horovod.torch fails to import or was "
                         f"built without Gloo; delete {where} and run this again")
    return f"installed {wheels[0]}"


def run(args: argparse.Namespace) -> int:
    try:
        print(f"build_horovod: {build(args.python, args.cache_dir, args.force)}")
    except (BuildError, subprocess.CalledProcessError) as exc:
        print(f"build_horovod: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="build_horovod", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
