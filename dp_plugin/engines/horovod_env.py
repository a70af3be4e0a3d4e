"""The ``HOROVOD_*`` variables the horovod engine sets for Horovod's library.

Horovod reads its settings from the environment inside ``hvd.init()``.
When the horovod engine starts Horovod itself, ``library_settings(config)``
sets, around that call:

- ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` when the program asked for process sets
  (``Config.process_sets``), as ``hvd.init(process_sets="dynamic")`` does;
  without the request Horovod skips the check for new sets in every cycle.
- ``HOROVOD_FUSION_THRESHOLD`` for the library only, during ``hvd.init()``:
  dp_plugin's buckets arrive pre-fused, and Horovod fusing two of them again
  in one cycle costs a memcpy in and out of its own buffer (20-30% of a
  fused all-reduce, BENCHMARKS.md). The library gets the smaller of
  ``LIBRARY_FUSION_BYTES`` and dp_plugin's threshold (``0``: no fusion,
  when the user asked for none), so a user's small collectives are still
  fused and dp_plugin's buckets are not. The variable is restored right
  after, because ``Config.from_env`` reads the same name as dp_plugin's own
  threshold.

Never ``HOROVOD_CYCLE_TIME`` beside it. Horovod 0.28.1 keeps a setting read
from the environment *fixed* for the life of the process, and when the cycle
time and the fusion threshold are both fixed, the next ``hvd.init()`` (after
``shutdown()``) crashes with a segmentation fault: its ``ParameterManager``
writes the defaults into the now empty vector of tunable values. So the
library threshold is set only when the user has not set a cycle time (or has
set both, which fixes both anyway), and a re-init after an ``hvd.init()``
that saw both raises ``EngineUnavailableError`` instead of crashing. A 5 ms
cycle instead of Horovod's 1 ms was measured too: within 2-3% on the training
step, where the library threshold is worth 17-25% on fused all-reduces
(BENCHMARKS.md).
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
