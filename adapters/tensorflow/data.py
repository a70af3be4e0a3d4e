"""``shard(dataset)``: each rank reads its own part of a ``tf.data`` dataset."""

from __future__ import annotations

from typing import Any

from dp_plugin.launch import runtime


def shard(dataset: Any) -> Any:
    """``dataset.shard(size(), rank())``: rank r keeps elements r, r + size, r + 2*size, ...

    Shard before shuffling, batching and repeating, so that each rank's batches
    come from disjoint examples. Ranks get ``len // size`` or one more
    element: with ``steps_per_epoch`` unset, ranks could then run different
    numbers of steps; drop the remainder (``dataset.take``) or set
    ``steps_per_epoch``.
    """
    engine = runtime.engine()
    return dataset.shard(engine.size, engine.rank)
