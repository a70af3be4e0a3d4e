"""``dp-plugin check``: what this installation can do, and why not.

Like ``horovodrun --check-build``: frameworks, engines and launchers, each
with the reason when it is unavailable, and which engine ``auto`` picks here.
Importing this module loads nothing; ``main()`` probes lazily. ``make check``
and ``python -m dp_plugin check`` print the same.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys


def _framework(module: str) -> tuple[bool, str]:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # report any import failure, it is the point of the tool
        return False, f"not importable: {type(exc).__name__}: {exc}"
    return True, str(getattr(mod, "__version__", "installed"))


def _frameworks() -> list[tuple[str, bool, str]]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep the report readable
    rows = []
    ok, info = _framework("torch")
    if ok:
        import torch

        info += (f", CUDA available ({torch.cuda.device_count()} device(s))"
                 if torch.cuda.is_available() else ", CUDA not available")
    rows.append(("PyTorch", ok, info))
    ok, info = _framework("tensorflow")
    if ok:
        ok_k, info_k = _framework("keras")
        info += f", Keras {info_k if ok_k else 'missing'}"
    rows.append(("TensorFlow", ok, info))
    rows.append(("mpi4py", *_framework("mpi4py")))
    ok, info = _framework("horovod")
    if ok:
        try:
            import horovod.torch as hvd

            info += f", torch extension {'with' if hvd.gloo_built() else 'WITHOUT'} Gloo"
        except Exception as exc:
            ok, info = False, f"horovod {info} but horovod.torch fails: {exc}"
    rows.append(("Horovod", ok, info))
    return rows


HELP = "frameworks, engines and launchers available here, and why not"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: the report reads the environment."""


def run(args: argparse.Namespace) -> int:
    return main()


def main() -> int:
    from dp_plugin.engines import availability_report, choose_engine
    from dp_plugin.launch import detect

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
        path = shutil.which(tool)
        out.write(f"    {mark[path is not None]} {tool:<11} {path or 'not on PATH'}\n")
    chosen, reason = choose_engine(topo)
    out.write(
        f"\nThis process: launcher {topo.launcher}, rank {topo.rank} of {topo.size}; "
        f"DP_PLUGIN_ENGINE=auto would pick '{chosen}' ({reason}).\n"
    )
    if topo.launcher == "horovodrun" and topo.size > 1:
        out.write("Under horovodrun every rank takes part in one choice for the job at init(), "
                  "which rank 0 logs; DP_PLUGIN_ENGINE=horovod runs Horovod's ring.\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
