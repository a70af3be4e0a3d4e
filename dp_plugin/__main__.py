"""``python -m dp_plugin``: the same as the ``dp-plugin`` command."""

from __future__ import annotations

import sys

from dp_plugin.cli import main

if __name__ == "__main__":
    sys.exit(main())
