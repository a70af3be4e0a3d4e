"""dp_plugin installed the ways docs/install.md gives, into environments of
their own, and used from outside the repository: nothing in the package may
depend on the checkout.

- a wheel (``python -m build``) holds every subpackage (``dp_plugin.torch``,
  ``.tensorflow``, ``.keras``, ``.ray``) and the TensorFlow kernel's source;
- installed into a fresh venv that sees this environment's torch (as
  ``--system-site-packages`` sees a system-wide one), it trains 2 ranks under
  torchrun from a directory outside the repository;
- ``pip install git+file://...`` of a clone installs the same package.

Builds run without build isolation (``--no-isolation``,
``--no-build-isolation``): setuptools comes from this environment, so no
index is needed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multiproc.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("dp_plugin", "dp_plugin.cli", "dp_plugin.engines", "dp_plugin.torch",
               "dp_plugin.tensorflow", "dp_plugin.keras", "dp_plugin.ray")

TRAIN = '''
import sys
import torch
import dp_plugin
import dp_plugin.torch as hvd

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
for step in range(3):
    opt.zero_grad()
    x = torch.full((4, 8), float(hvd.rank() + 1))
    model(x).sum().backward()
    opt.step()
weights = hvd.allgather(model.weight.detach().reshape(1, -1))
assert torch.equal(weights[0], weights[1]), weights
print(f"rank {hvd.rank()} of {hvd.size()} OK, dp_plugin from {dp_plugin.__file__}", flush=True)
'''


def _run(cmd: list[str], timeout: float = 300, **kwargs: object) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                          **kwargs)  # type: ignore[call-overload]
    output = f"$ {' '.join(map(str, cmd))}\n{done.stdout}{done.stderr}"
    assert done.returncode == 0, output[-6000:]
    return output


def _copy_tracked(dest: Path) -> None:
    """The checkout's tracked files (a clone's content), without build outputs."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True,
                            check=False)
    if listed.returncode:
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
            ".venv", ".git", "build", "*.egg-info", "__pycache__", ".*_cache"))
        return
    for rel in listed.stdout.decode().split("\0"):
        if rel and (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)


def _fresh_venv(where: Path) -> Path:
    """A venv of its own whose interpreter also sees this environment's
    packages (torch, numpy) after its own, as a system-wide torch is seen
    with ``--system-site-packages``; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True,
                   timeout=120)
    python = where / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"], capture_output=True,
                             text=True, check=True).stdout.strip()
    # A plain path line: the editable dp_plugin of this environment (loaded by
    # its own .pth file) stays out of sight.
    (Path(purelib) / "test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def _pip_install(python: Path, *requirement: str) -> str:
    return _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                 "--no-deps", "--no-index", "--force-reinstall", *requirement])


def _clean_env(venv_python: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "DP_PLUGIN_", "RANK", "WORLD_SIZE", "MASTER_",
                                "LOCAL_", "TORCHELASTIC", "OMPI_", "PMI_", "HOROVOD_"))}
    env["PATH"] = f"{venv_python.parent}:/usr/bin:/bin"
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    src = tmp_path_factory.mktemp("src")
    _copy_tracked(src)
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out),
          str(src)])
    (found,) = out.glob("dp_plugin-*.whl")
    yield found


def test_the_wheel_holds_every_subpackage(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in SUBPACKAGES:
        assert f"{package.replace('.', '/')}/__init__.py" in names, (package, sorted(names))
    assert "dp_plugin/tensorflow/status_op.cc" in names
    assert not any(n.startswith(("adapters/", "tests/")) for n in names), sorted(names)


@pytest.mark.multiproc
def test_the_wheel_trains_two_ranks_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    python = _fresh_venv(tmp_path / "venv")
    _pip_install(python, str(wheel))
    outside = tmp_path / "project"
    outside.mkdir()
    (outside / "train.py").write_text(TRAIN)
    env = _clean_env(python)
    out = _run([str(python), "-m", "torch.distributed.run", "--nnodes", "1",
                "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
                str(free_port()), "train.py"], cwd=outside, env=env, timeout=240)
    for rank in (0, 1):
        assert f"rank {rank} of 2 OK, dp_plugin from {tmp_path / 'venv'}" in out, out
    check = _run([str(tmp_path / "venv" / "bin" / "dp-plugin"), "plan", "--model", "resnet50",
                  "--compute-ms", "100", "--alpha-us", "10", "--bandwidth-gbit", "25",
                  "--workers", "8"], cwd=outside, env=env)
    assert "resnet50" in check, check


def test_pip_installs_from_a_git_url(tmp_path: Path) -> None:
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                      check=False).returncode:
        pytest.skip("the checkout is not a git repository: no git URL to install from")
    clone = tmp_path / "clone"
    # A full clone: pip's own clone of a shallow one loops on "filtering not recognized".
    _run(["git", "clone", "--quiet", f"file://{ROOT}", str(clone)])
    python = _fresh_venv(tmp_path / "venv")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
          "--no-deps", "--no-index", "--no-build-isolation", "--force-reinstall",
          f"dp_plugin @ git+file://{clone}"], cwd=tmp_path)
    # Found, not imported: importing TensorFlow would only cost time here.
    probe = ("import importlib.util as u, pathlib; "
             f"specs = [u.find_spec(n) for n in {SUBPACKAGES!r}]; "
             "print(specs[0].origin); assert all(specs), specs; "
             "tf = pathlib.Path(u.find_spec('dp_plugin.tensorflow').origin).parent; "
             "assert (tf / 'status_op.cc').exists()")
    out = _run([str(python), "-c", probe], cwd=tmp_path, env=_clean_env(python))
    assert str(tmp_path / "venv") in out, out
