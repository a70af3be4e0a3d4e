"""Exceptions raised by dp_plugin.

Every message names the bad value, what was expected and the fix. Errors that
concern several ranks (layout mismatch, timeouts) are raised on every rank
involved, never left to hang.
"""

from __future__ import annotations

from collections.abc import Sequence


class DPPluginError(RuntimeError):
    """Base class of every error dp_plugin raises on purpose."""


class NotInitializedError(DPPluginError):
    """The core was used before ``init()`` (or after ``shutdown()``)."""

    def __init__(self, what: str = "dp_plugin") -> None:
        super().__init__(
            f"{what} was used before dp_plugin.init(); call init() once per process, "
            "after the launcher has started it and before any collective"
        )


class ConfigError(DPPluginError, ValueError):
    """A setting (a ``DP_PLUGIN_*`` variable or a ``Config`` field) is malformed.
    Also a ``ValueError``: the value is wrong, whoever passed it."""


class LaunchError(DPPluginError):
    """A launcher variable is malformed or inconsistent with the others."""


class LayoutMismatchError(DPPluginError):
    """Ranks registered different tensors (names, shapes, dtypes or order)."""


class CollectiveTimeoutError(DPPluginError):
    """A collective did not finish within ``DP_PLUGIN_TIMEOUT`` seconds."""


class EngineUnavailableError(DPPluginError):
    """The requested engine cannot run under this launcher or installation."""


class NonFiniteGradientError(DPPluginError):
    """A reduced gradient holds inf or nan and ``DP_PLUGIN_CHECK_FINITE=raise``."""


class JoinedRankError(DPPluginError):
    """A collective that a joined rank (``join()``) cannot answer was called
    while that rank was joined; raised on every rank, the joined one included."""

    @classmethod
    def refusing(cls, joined: Sequence[int], what: str, said: str = "",
                 where: str = "") -> JoinedRankError:
        """The one message: ``joined`` (global ranks) have joined and ``what``
        cannot run; ``said`` follows "joined" (Horovod's words), ``where``
        follows the list of what a joined rank answers."""
        return cls(
            f"rank(s) {', '.join(map(str, joined))} have called hvd.join(), and {what} cannot "
            f"run while a rank is joined{said}: a joined rank answers only allreduce, "
            f"grouped_allreduce, barrier and DistributedOptimizer steps{where}. Call it before "
            "join(), or call hvd.join() on this rank too: join() then returns the rank that "
            "joined last on every rank. Every rank that called it raises this error"
        )
