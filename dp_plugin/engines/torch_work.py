"""The handle of one in-flight torch.distributed collective (a ``Work``).

Used by the gloo and nccl engines (``torch_dist.py``); a library failure
becomes a ``DPPluginError`` naming the collective, or the timeout error of
the base ``Handle`` when the library reports a timeout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dp_plugin.engines.handle import Handle
from dp_plugin.errors import DPPluginError

if TYPE_CHECKING:
    from dp_plugin.engines.torch_dist import TorchDistEngine


class PollHandle(Handle):
    """An in-flight torch.distributed ``Work``. Poll ``Work.is_completed``
    (with the base class's backoff, at most 1 ms late), then ``wait`` to
    surface errors and, for NCCL, order the current stream after the
    collective.

    Not ``future.then(callback)``: that callback runs Python on Gloo's thread,
    and a script that exits right after its last collective aborted ("terminate
    called without an active exception") in about 1 run in 5 at 3 ranks.
    """

    def __init__(self, work: Any, engine: TorchDistEngine, description: str) -> None:
        super().__init__(description, engine.rank, engine.config.timeout_s, engine._mark_broken,
                         engine.wait_board())
        self._work = work

    def _test(self) -> bool:
        if not self._work.is_completed():
            return False
        try:
            self._work.wait()
        except Exception as exc:
            raise _library_error(self, exc) from exc
        return True


def _library_error(handle: Handle, exc: Exception) -> DPPluginError:
    text = str(exc)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return handle.timeout_error()
    return DPPluginError(
        f"rank {handle.rank}: {handle.description} failed: {text.strip().rstrip('.')}."
        f"{handle.report()} Another rank has probably died or closed its connection; check "
        "the other ranks' logs"
    )
