"""``python -m dp_plugin.check``: kept for old scripts; ``dp-plugin check`` is the command.

The report itself lives in ``dp_plugin.cli.check``.
"""

from __future__ import annotations

import sys

from dp_plugin.cli.check import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
