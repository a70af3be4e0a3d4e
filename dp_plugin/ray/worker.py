"""The Ray actor that hosts one dp_plugin rank (``RayExecutor``'s workers).

It holds no collective state of its own: the executor sets the variables a
torchrun launch would (``executor``'s module docstring), and the user's
function calls ``hvd.init()`` as under torchrun. One process per actor, for
the life of the executor: ``init()``/``shutdown()`` may run many times in it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any


class Worker:
    """One rank's process. Methods are called through Ray (``.remote``)."""

    def __init__(self) -> None:
        self.executable: Any = None

    def node(self) -> tuple[str, str]:
        """(Ray node id, the node's IP address as Ray knows it)."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def set_env(self, env: Mapping[str, str]) -> None:
        os.environ.update({k: str(v) for k, v in env.items()})

    def start_executable(self, cls: type | None, args: list[Any], kwargs: dict[str, Any]) -> None:
        """Make the object ``execute`` hands to its functions (Horovod's
        ``executable_cls``); None without a class."""
        self.executable = cls(*args, **kwargs) if cls is not None else None

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` in this process."""
        return fn(self.executable)

    def call(self, fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)`` in this process."""
        return fn(*args, **kwargs)
