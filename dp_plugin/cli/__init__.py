"""The ``dp-plugin`` command (also ``python -m dp_plugin``).

Subcommands, one module each (``SUBCOMMANDS``, each with its ``HELP``); none
imports a framework until it runs, so ``dp-plugin check`` starts fast and
``dp-plugin plan`` needs no torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

SUBCOMMANDS: dict[str, str] = {
    "check": "dp_plugin.cli.check",
    "build-horovod": "dp_plugin.cli.build_horovod",
    "bench": "dp_plugin.cli.bench",
    "plan": "dp_plugin.cli.plan",
    "k8s": "dp_plugin.cli.k8s",
}
"""name -> module; each module has ``HELP``, ``add_arguments(parser)`` and ``run(args)``."""


def int_list(what: str, minimum: int, example: str) -> Callable[[str], list[int]]:
    """An argparse type: integers >= ``minimum`` separated by commas (``what`` names them)."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: give {what} >= {minimum} as integers "
                                             f"separated by commas, e.g. {example}")
        return values
    return parse


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parsed arguments; bad input exits with status 2 and argparse's message."""
    parser = argparse.ArgumentParser(
        prog="dp-plugin", description="dp_plugin: check, build Horovod, benchmark, plan.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(module=module)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    try:
        return int(args.module.run(args) or 0)
    except KeyboardInterrupt:
        sys.stderr.write("dp-plugin: interrupted\n")
        return 130
