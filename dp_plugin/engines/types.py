"""Small types of the engine interface: reduce ops, availability, started collectives."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dp_plugin.engines.handle import Handle

Started = tuple[Handle, Callable[[], Any]]
"""A collective in flight and the function that returns its output once
the handle is done (``allgather_async``, ``reducescatter_async``)."""


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        if isinstance(op, ReduceOp):
            return op
        try:
            return cls(str(op).lower())
        except ValueError:
            valid = ", ".join(o.value for o in cls)
            raise ValueError(f"reduce op {op!r} is not known; valid ops: {valid}") from None


@dataclass(frozen=True)
class Availability:
    """Whether an engine can run here, and why (shown by ``make check``)."""

    ok: bool
    reason: str
