"""``dp-plugin build-horovod``: Horovod 0.28.1 (PyTorch + Gloo, CPU) for this torch.

Downloads Horovod's source distribution with pip, raises its C++ standard
from 14 to 17 (torch >= 2.1 headers need C++17), gives Gloo process sets the
global context's network interface (Horovod's process-set contexts otherwise
bind to ``gethostname()``, which breaks multi-host jobs whose host name
resolves to loopback; see docs/horovod-build.md), builds a wheel against the
torch that ``--python`` imports and installs it. A Horovod it did not build
(no patch marker: a site's own NCCL or MPI build) is kept as it is, and
dp_plugin uses it; ``--force`` replaces it. The wheel is cached outside
any project, keyed by the Horovod, patch set, torch and Python versions
(``DP_PLUGIN_WHEEL_CACHE``, default ``~/.cache/dp_plugin/wheels``), so a
second install takes seconds.

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
# The patch set this file applies. It names the wheel cache directory and is
# written into the built package as ``horovod/dp_plugin_patches.py``, so an
# install or a cached wheel from an older patch set is rebuilt, and dp_plugin
# can tell at run time whether Horovod has the process-set interface fix.
PATCH_SET = "p2"
PATCH_MODULE = "horovod/dp_plugin_patches.py"
GLOO_CONTEXT = "horovod/common/gloo/gloo_context.cc"
PROCESS_SET_INIT = "void GlooContext::InitializeForProcessSet("
OLD_IFACE = "  device_attr.iface = gloo_iface_;\n"
# Horovod 0.28.1 never assigns a process set's gloo_iface_, so its device binds
# to the address of gethostname(); the global context's interface (horovodrun's
# HOROVOD_GLOO_IFACE) is the one every rank's peers can reach.
NEW_IFACE = "  gloo_iface_ = global_context.gloo_iface_;\n" + OLD_IFACE
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
                        help="reinstall even when Horovod is already installed, also over a "
                             "Horovod this command did not build (a site's NCCL or MPI build)")


def _ask(python: str, code: str) -> str | None:
    """What ``python -c code`` prints, or None when it fails."""
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def cache_dir(root: Path | None, torch_version: str, py_tag: str) -> Path:
    if root is None:
        env = os.environ.get("DP_PLUGIN_WHEEL_CACHE")
        xdg = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
        root = Path(env) if env else Path(xdg) / "dp_plugin" / "wheels"
    return root / f"horovod-{HOROVOD_VERSION}-{PATCH_SET}-torch{torch_version}-{py_tag}"


def patch_cxx_standard(src: Path) -> None:
    """C++14 -> C++17 in Horovod's two CMakeLists.txt; fails loudly if the line moved."""
    for rel in PATCHED_FILES:
        f = src / rel
        text = f.read_text()
        if OLD_STANDARD not in text:
            raise BuildError(f"{f} has no {OLD_STANDARD!r}; the patch no longer applies "
                             f"(is this Horovod {HOROVOD_VERSION}?)")
        f.write_text(text.replace(OLD_STANDARD, NEW_STANDARD))


def patch_process_set_iface(src: Path) -> None:
    """Process-set Gloo contexts take the global context's interface; fails loudly if moved."""
    f = src / GLOO_CONTEXT
    text = f.read_text()
    start = text.find(PROCESS_SET_INIT)
    at = text.find(OLD_IFACE, start) if start >= 0 else -1
    if at < 0 or NEW_IFACE in text:
        raise BuildError(f"{f} has no {OLD_IFACE.strip()!r} in {PROCESS_SET_INIT}...); the "
                         f"patch no longer applies (is this Horovod {HOROVOD_VERSION}?)")
    f.write_text(text[:at] + NEW_IFACE + text[at + len(OLD_IFACE):])


def mark_patch_set(src: Path) -> None:
    """Ship the patch set's name inside the wheel (read by ``installed_patch_set``)."""
    (src / PATCH_MODULE).write_text(
        '"""Written by dp_plugin\'s build-horovod: the patches this build carries."""\n'
        f"PATCH_SET = {PATCH_SET!r}\n"
        "PATCHES = ('C++17 for torch >= 2.1', 'Gloo process sets use the global interface')\n")


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
    patch_process_set_iface(src)
    mark_patch_set(src)
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
    patches = _ask(python, "from horovod.dp_plugin_patches import PATCH_SET; print(PATCH_SET)")
    if installed == HOROVOD_VERSION and patches == PATCH_SET and not force:
        return f"horovod {HOROVOD_VERSION} (patch set {PATCH_SET}) already installed"
    if patches is None and not force and not _from_our_cache(python, root):
        found = _site_horovod(python)
        if found is not None:
            return found
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
    check = ("import horovod.torch as h; from horovod.dp_plugin_patches import PATCH_SET; "
             f"assert h.gloo_built() and PATCH_SET == {PATCH_SET!r}")
    if _ask(python, check) is None:
        raise BuildError(f"{wheels[0]} installed but horovod.torch fails to import, was "
                         f"built without Gloo or lacks patch set {PATCH_SET}; delete {where} "
                         "and run this again")
    return f"installed {wheels[0]}"


_DESCRIBE_HOROVOD = """
import horovod
try:
    import horovod.torch as h
    built = [n for n in ("gloo", "mpi", "nccl") if getattr(h, n + "_built")()]
    torch_ext = "its torch extension built with " + (", ".join(built) or "no controller")
except Exception as exc:
    torch_ext = f"horovod.torch fails to import ({type(exc).__name__}: {exc})"
print(f"Horovod {horovod.__version__} at {horovod.__path__[0]}, {torch_ext}")
"""


def _from_our_cache(python: str, root: Path | None) -> bool:
    """Whether pip installed the Horovod from this command's wheel cache (an
    older patch set, before the builds carried their marker)."""
    url = _ask(python, "from importlib.metadata import distribution; "
                       "print(distribution('horovod').read_text('direct_url.json') or '')")
    return bool(url) and str(cache_dir(root, "", "").parent) in str(url)


def _site_horovod(python: str) -> str | None:
    """None where no Horovod is installed; else the site's own build (one
    build-horovod did not make) is kept: what dp_plugin does with it, or a
    ``BuildError`` where its torch extension does not import."""
    found = _ask(python, _DESCRIBE_HOROVOD)
    if found is None:
        return None
    uses = ("dp_plugin uses an installed Horovod as it is: the horovod engine "
            "(DP_PLUGIN_ENGINE=horovod, or auto under horovodrun) drives its horovod.torch "
            "and horovodrun launches the job; the gloo, nccl and mpi engines do not use it. "
            "build-horovod's own build adds only what a stock 0.28.1 lacks (C++17 for "
            "torch >= 2.1, the network interface for Gloo process sets across hosts).")
    if "fails to import" in found:
        raise BuildError(f"found a Horovod that build-horovod did not build: {found}. It was "
                         f"left as it is. {uses} Fix that build, or run `dp-plugin "
                         "build-horovod --force` to replace it with a CPU Gloo build (this "
                         "uninstalls it)")
    return (f"kept the Horovod already installed, which build-horovod did not build: {found}. "
            f"{uses} To replace it with build-horovod's CPU Gloo build anyway (it overwrites "
            "that build, e.g. an NCCL or MPI one), run `dp-plugin build-horovod --force`.")


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
