"""The ``HOROVOD_*`` variables the horovod engine sets for Horovod's library.

Horovod reads its settings from the environment inside ``hvd.init()``.
When the horovod engine starts Horovod itself, ``library_settings(config)``
sets, around that call:

- ``HOROVOD_CYCLE_TIME=5`` (ms) unless the user set it: dp_plugin hands
  Horovod a few large, pre-fused collectives per step, and Horovod's 1 ms
  background cycle only steals cores from backward (BENCHMARKS.md). It
  stays set, as a user's would.
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
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from dp_plugin.config import Config

DEFAULT_CYCLE_TIME_MS = "5"
"""HOROVOD_CYCLE_TIME when the engine initializes Horovod and the user set none."""
LIBRARY_FUSION_BYTES = 1 << 20
"""Horovod's own fusion threshold under dp_plugin (1 MiB): below dp_plugin's buckets."""


def library_fusion(config: Config) -> str:
    """HOROVOD_FUSION_THRESHOLD for Horovod's library under ``config``."""
    if config.fusion_threshold <= 1:  # the user's HOROVOD_FUSION_THRESHOLD=0: no fusion
        return "0"
    return str(min(config.fusion_threshold, LIBRARY_FUSION_BYTES))


@contextlib.contextmanager
def library_settings(config: Config) -> Iterator[None]:
    """Set Horovod's variables for an ``hvd.init()`` inside the block (see above)."""
    os.environ.setdefault("HOROVOD_CYCLE_TIME", DEFAULT_CYCLE_TIME_MS)
    if config.process_sets:
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    before = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    os.environ["HOROVOD_FUSION_THRESHOLD"] = library_fusion(config)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HOROVOD_FUSION_THRESHOLD", None)
        else:
            os.environ["HOROVOD_FUSION_THRESHOLD"] = before
