"""``dp-plugin check``: what this installation can do, and why not.

Like ``horovodrun --check-build``: frameworks, engines and launchers, each
with the reason when it is unavailable, and which engine ``auto`` picks here.
Importing this module loads nothing; ``main()`` probes lazily. ``make check``
and ``python -m dp_plugin check`` print the same.

Its time is the frameworks' imports, and each row says how long its import
took: TensorFlow and Keras take most of it (about 5 s on a loaded 2-core
machine), PyTorch and Horovod's torch extension most of the rest. TensorFlow
is imported in a child interpreter while this one imports PyTorch, so the
two overlap, and TensorFlow's C++ start-up lines (absl, oneDNN), which it
writes straight to file descriptor 2, stay out of the report.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def _framework(module: str) -> tuple[bool, str]:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # report any import failure, it is the point of the tool
        return False, f"not importable: {type(exc).__name__}: {exc}"
    return True, str(getattr(mod, "__version__", "installed"))


def _tensorflow_probe() -> None:
    """What the child of ``_start_tensorflow_probe`` runs: TensorFlow's and
    Keras's versions, TensorFlow's import time and Keras's backend, as JSON."""
    start = time.perf_counter()
    ok, info = _framework("tensorflow")
    ok_k, info_k = _framework("keras")
    if ok:
        info += f", Keras {info_k if ok_k else 'missing'}"
    seconds = time.perf_counter() - start
    backend = importlib.import_module("keras").backend.backend() if ok_k else None
    print(json.dumps([ok, info, seconds, ok_k, info_k, backend]))


def _start_tensorflow_probe() -> subprocess.Popen[str]:
    """TensorFlow and Keras imported in a child interpreter: it runs while
    this process imports PyTorch, and its stderr (absl and oneDNN lines)
    is dropped."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    code = "from dp_plugin.cli.check import _tensorflow_probe; _tensorflow_probe()"
    return subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def _tensorflow_rows(probe: subprocess.Popen[str],
                     torch_ok: bool) -> list[tuple[str, bool, str]]:
    """The TensorFlow row and the Keras row, from the child's answer."""
    out, _ = probe.communicate()
    try:
        ok, info, seconds, ok_k, info_k, backend = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return [("TensorFlow", False, f"the import probe exited with status {probe.returncode} "
                 "and no answer (TensorFlow's native import crashed?); run `python -c "
                 "'import tensorflow'` to see its error")]
    return [("TensorFlow", ok, f"{info} (import {seconds:.1f} s)"),
            _keras_row(ok_k, info_k, backend, {"tensorflow": ok, "torch": torch_ok})]


def _timed(probe: Callable[[], tuple[bool, str]]) -> tuple[bool, str]:
    start = time.perf_counter()
    ok, info = probe()
    return ok, f"{info} (import {time.perf_counter() - start:.1f} s)"


def _lightning() -> tuple[bool, str]:
    """Lightning 2.x's version from its metadata: importing it takes seconds."""
    from importlib import metadata

    for dist in ("lightning", "pytorch-lightning"):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return True, (f"{dist} {version}, Trainer(strategy=\"horovod\") after "
                      "import dp_plugin.lightning")
    return False, "not installed: pip install 'dp_plugin[lightning]'"


def _torch() -> tuple[bool, str]:
    ok, info = _framework("torch")
    if ok:
        import torch

        info += (f", CUDA available ({torch.cuda.device_count()} device(s))"
                 if torch.cuda.is_available() else ", CUDA not available")
    return ok, info


def _horovod() -> tuple[bool, str]:
    ok, info = _framework("horovod")
    if ok:
        try:
            import horovod.torch as hvd

            info += f", torch extension {'with' if hvd.gloo_built() else 'WITHOUT'} Gloo"
        except Exception as exc:
            ok, info = False, f"horovod {info} but horovod.torch fails: {exc}"
    return ok, info


def _frameworks() -> list[tuple[str, bool, str]]:
    probe = _start_tensorflow_probe()
    rows = [("PyTorch", *_timed(_torch)), ("Lightning", *_lightning())]
    rows.extend(_tensorflow_rows(probe, torch_ok=rows[0][1]))
    rows.append(("mpi4py", *_timed(lambda: _framework("mpi4py"))))
    rows.append(("Horovod", *_timed(_horovod)))
    return rows


def find_launcher(tool: str) -> tuple[str | None, str]:
    """(path, where) of ``tool``: on PATH, else beside this interpreter (a
    virtual environment's ``bin/`` that is not on PATH, e.g. when
    ``dp-plugin`` is run by its full path)."""
    found = shutil.which(tool)
    if found:
        return found, "on PATH"
    for folder in dict.fromkeys((Path(sys.executable).parent, Path(sys.argv[0]).parent)):
        candidate = shutil.which(tool, path=str(folder))
        if candidate:
            return candidate, "beside the interpreter, not on PATH: call it by this path"
    return None, "not on PATH, nor beside the interpreter " + str(Path(sys.executable).parent)


def _keras_row(ok: bool, info: str, backend: str | None,
               found: dict[str, bool]) -> tuple[str, bool, str]:
    """Keras, its backend here, and the backends ``dp_plugin.keras`` serves with
    what is installed (TensorFlow and torch; JAX has Keras's own path)."""
    if ok:
        served = [name for name, here in found.items() if here]
        info += (f", backend {backend!r} (KERAS_BACKEND); dp_plugin.keras "
                 f"serves {' and '.join(served) or 'neither backend: install torch or tensorflow'}")
        if importlib.util.find_spec("jax") is not None:
            info += "; jax found: not served (use keras.distribution with jax.distributed)"
    return "Keras", ok, info


HELP = "frameworks, engines and launchers available here, and why not"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: the report reads the environment."""


def run(args: argparse.Namespace) -> int:
    return main()


def main() -> int:
    from dp_plugin.engines import availability_report, choose_engine
    from dp_plugin.launch.launchers import detect

    started = time.perf_counter()
    topo = detect()
    out = sys.stdout
    mark = {True: "[X]", False: "[ ]"}
    out.write("dp_plugin check\n\nFrameworks:\n")
    for name, ok, info in _frameworks():
        out.write(f"    {mark[ok]} {name:<11} {info}\n")
    out.write("\nEngines (for this process's launcher):\n")
    for name, avail in availability_report(topo).items():
        out.write(f"    {mark[avail.ok]} {name:<11} {avail.reason}\n")
    out.write("\nLaunchers:\n")
    for tool in ("horovodrun", "torchrun", "mpirun", "mpiexec", "srun"):
        path, where = find_launcher(tool)
        shown = where if path is None else path + ("" if where == "on PATH" else f" ({where})")
        out.write(f"    {mark[path is not None]} {tool:<11} {shown}\n")
    chosen, reason = choose_engine(topo)
    out.write(
        f"\nThis process: launcher {topo.launcher}, rank {topo.rank} of {topo.size}; "
        f"DP_PLUGIN_ENGINE=auto would pick '{chosen}' ({reason}).\n"
        f"The check took {time.perf_counter() - started:.1f} s, nearly all of it the imports "
        "timed above.\n"
    )
    if topo.launcher == "horovodrun" and topo.size > 1:
        out.write("Under horovodrun every rank takes part in one choice for the job at init(), "
                  "which rank 0 logs; DP_PLUGIN_ENGINE=horovod runs Horovod's ring.\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
