"""Process-wide state: the detected topology and the chosen engine.

``init()`` is the one entry point. It is idempotent (a second call returns
the same engine) and every function that needs an engine before it raises
``NotInitializedError``. ``shutdown()`` releases the engine; ``init()`` may
be called again afterwards.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import replace

from dp_plugin.config import Config
from dp_plugin.engines.base import Engine
from dp_plugin.errors import NotInitializedError
from dp_plugin.launch.launchers import Topology, detect

log = logging.getLogger("dp_plugin")

_lock = threading.Lock()
_engine: Engine | None = None


def init(config: Config | None = None, env: Mapping[str, str] | None = None, *,
         process_sets: bool = False) -> Engine:
    """Detect the launcher, choose and start the engine; return it.

    Collective: every rank of the job must call it. ``config`` defaults to
    ``Config.from_env(env)``; ``env`` defaults to ``os.environ``.
    ``process_sets``: the program will add process sets (an adapter's
    ``init(process_sets=...)``); sets ``Config.process_sets``.
    """
    global _engine
    from dp_plugin.engines import choose_for_job, create_engine

    with _lock:
        if _engine is not None:
            return _engine
        config = Config.from_env(env) if config is None else config
        if process_sets:
            config = replace(config, process_sets=True)
        topo = detect(env)
        name, reason = choose_for_job(config.engine, topo, config)
        _engine = create_engine(name, topo, config)
        if topo.rank == 0:
            log.info(
                "dp_plugin: engine %s (%s); launcher %s, %d rank(s), %d per host",
                name, reason, topo.launcher, topo.size, topo.local_size,
            )
        return _engine


def is_initialized() -> bool:
    return _engine is not None


def engine() -> Engine:
    """The running engine; raises ``NotInitializedError`` before ``init()``."""
    if _engine is None:
        raise NotInitializedError()
    return _engine


def topology() -> Topology:
    return engine().topology


def rank() -> int:
    return engine().rank


def size() -> int:
    return engine().size


def shutdown() -> None:
    """Release the engine. Collective for engines whose teardown is (MPI, gloo)."""
    global _engine
    with _lock:
        engine, _engine = _engine, None
        if engine is not None:
            engine.shutdown()
