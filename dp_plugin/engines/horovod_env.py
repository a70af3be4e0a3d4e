"""The ``HOROVOD_*`` variables the horovod engine sets for Horovod's library
around its ``hvd.init()``: ``library_settings(config)``. What it sets and why
(dynamic process sets, a 1 MiB library fusion threshold, never
``HOROVOD_CYCLE_TIME`` beside it: Horovod 0.28.1's re-init crash) is
docs/configuration.md, the horovod engine's paragraph; the measurements are
in docs/benchmarks-history.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from dp_plugin.config import Config
from dp_plugin.errors import EngineUnavailableError

LIBRARY_FUSION_BYTES = 1 << 20
"""Horovod's own fusion threshold under dp_plugin (1 MiB): below dp_plugin's buckets."""
_FIXED = ("HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD")
_both_fixed = False
"""An ``hvd.init()`` of this process ran with both of ``_FIXED`` set."""


def library_fusion(config: Config) -> str:
    """HOROVOD_FUSION_THRESHOLD for Horovod's library under ``config``."""
    if config.fusion_threshold <= 1:  # the user's HOROVOD_FUSION_THRESHOLD=0: no fusion
        return "0"
    return str(min(config.fusion_threshold, LIBRARY_FUSION_BYTES))


@contextlib.contextmanager
def library_settings(config: Config) -> Iterator[None]:
    """Set Horovod's variables for an ``hvd.init()`` inside the block (see above)."""
    global _both_fixed
    if _both_fixed:
        raise EngineUnavailableError(
            "hvd.init() cannot run again in this process: an earlier hvd.init() here ran with "
            "both HOROVOD_CYCLE_TIME and HOROVOD_FUSION_THRESHOLD set, and Horovod 0.28.1 then "
            "crashes the next one (segmentation fault; both stay fixed in its ParameterManager). "
            "Set at most one of them before the first init() (DP_PLUGIN_FUSION_THRESHOLD sets "
            "dp_plugin's buckets without touching Horovod's), start a new process, or use "
            "DP_PLUGIN_ENGINE=gloo"
        )
    if config.process_sets:
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    before = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    if "HOROVOD_CYCLE_TIME" not in os.environ or before is not None:
        os.environ["HOROVOD_FUSION_THRESHOLD"] = library_fusion(config)
    _both_fixed = all(name in os.environ for name in _FIXED)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HOROVOD_FUSION_THRESHOLD", None)
        else:
            os.environ["HOROVOD_FUSION_THRESHOLD"] = before
