"""The lifecycle every engine shares: open, shut down, broken, and its parent.

One place for the states that make an engine refuse collectives, so that
no engine writes them again (``Engine`` inherits this class):

- ``shutdown`` is idempotent and local; it shuts down the channels made
  from the engine, then releases the library's resources (``_close``);
- a collective timeout marks the engine broken (``Handle.wait`` calls
  ``mark_broken``): the timed-out collective may still complete and write
  into its buffer, and the ranks no longer agree on the order of
  collectives, so every later collective raises;
- a subgroup (made with ``parent=``) is usable only while every ancestor
  is open and not broken; ``_timeout_breaks_parent`` makes a subgroup's
  timeout break its parent too, where they share library resources.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from dp_plugin.errors import DPPluginError


class Lifecycle(ABC):
    """Open / closed / broken state of an engine and of its ancestors."""

    name: ClassVar[str]
    _timeout_breaks_parent: ClassVar[bool] = False

    def __init__(self, parent: Lifecycle | None) -> None:
        self._parent = parent
        self._closed = False
        self._broken: str | None = None
        """The collective that timed out, once one has."""
        self._channels: list[Lifecycle] = []
        """Engines made by ``channel``: shut down with this one."""

    @property
    @abstractmethod
    def job_rank(self) -> int:
        """This process's rank in the job, which errors name (a subgroup's
        own rank differs: a process set's, a hierarchical all-reduce's
        cross-host group's)."""

    @property
    def closed(self) -> bool:
        """True once ``shutdown`` ran (here or, for a subgroup, on a parent)."""
        return self._closed or (self._parent is not None and self._parent.closed)

    def shutdown(self) -> None:
        """Release this engine's resources (idempotent; local, not
        collective). Collectives raise afterwards. A subgroup engine
        releases its group only, and must be shut down before its parent."""
        if self._closed:
            return
        self._closed = True
        for child in self._channels:
            child.shutdown()
        self._close()

    @abstractmethod
    def _close(self) -> None:
        """Release the library's resources; called once, by ``shutdown``."""

    def mark_broken(self, description: str) -> None:
        """Called when ``description`` timed out: refuse every later
        collective here, and in the subgroups (they check their parents)."""
        if self._broken is None:
            self._broken = description
        if self._parent is not None and self._timeout_breaks_parent:
            self._parent.mark_broken(description)

    def _check_usable(self, what: str) -> None:
        """Raise ``DPPluginError`` if collectives cannot run on this engine."""
        where = f"rank {self.job_rank}: {what}: the {self.name} engine"
        if self._broken is not None:
            raise DPPluginError(
                f"{where} is unusable because an earlier collective timed out "
                f"({self._broken}); it may still complete and write into its buffer, and the "
                "ranks no longer agree on the order of collectives. Restart the job"
            )
        if self._closed:
            again = ("create the subgroup again" if self._parent is not None
                     else "call dp_plugin.init() again")
            raise DPPluginError(f"{where} was shut down; {again}")
        ancestor = self._parent
        while ancestor is not None:
            if ancestor._closed or ancestor._broken is not None:
                state = ("was shut down" if ancestor._broken is None
                         else f"is broken ({ancestor._broken} timed out)")
                raise DPPluginError(
                    f"{where} this subgroup came from {state}, which ended the subgroup too; "
                    "create the subgroup again from a running engine"
                )
            ancestor = ancestor._parent
