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
from dp_plugin.launch import Topology, detect

log = logging.getLogger("dp_plugin")

_lock = threading.Lock()
_engine: Engine | None = None
_alternates: dict[str, Engine] = {}
"""Engines started beside ``_engine`` for autotune to time (``alternates``)."""
_alternate_channels: dict[tuple[str, str], Engine] = {}
"""Their channels by (engine, name): a scheduler re-planned under the same
name (``add_param_group``) reuses its channels instead of making more."""


def init(config: Config | None = None, env: Mapping[str, str] | None = None, *,
         process_sets: bool = False) -> Engine:
    """Detect the launcher, choose and start the engine; return it.

    Collective: every rank of the job must call it. ``config`` defaults to
    ``Config.from_env(env)``; ``env`` defaults to ``os.environ``.
    ``process_sets``: the program will add process sets (an adapter's
    ``init(process_sets=...)``); sets ``Config.process_sets``.
    """
    global _engine, _alternates
    from dp_plugin.engines import choose_engine, create_engine, start_alternates

    with _lock:
        if _engine is not None:
            return _engine
        config = Config.from_env(env) if config is None else config
        if process_sets:
            config = replace(config, process_sets=True)
        topo = detect(env)
        if config.engine == "auto":
            name, reason = choose_engine(topo)
        else:
            name, reason = config.engine, "requested by DP_PLUGIN_ENGINE / Config.engine"
        _engine = create_engine(name, topo, config)
        if config.engine == "auto" and config.autotune and topo.size > 1:
            try:
                _alternates = start_alternates(_engine, topo, config)
            except BaseException:
                _engine.shutdown()
                _engine = None
                raise
        if topo.rank == 0:
            tried = f"; autotune also times {', '.join(_alternates)}" if _alternates else ""
            log.info(
                "dp_plugin: engine %s (%s); launcher %s, %d rank(s), %d per host%s",
                name, reason, topo.launcher, topo.size, topo.local_size, tried,
            )
        return _engine


def is_initialized() -> bool:
    return _engine is not None


def engine() -> Engine:
    """The running engine; raises ``NotInitializedError`` before ``init()``."""
    if _engine is None:
        raise NotInitializedError()
    return _engine


def alternates(engine: Engine, name: str) -> dict[str, Engine]:
    """The engines autotune may move ``engine``'s gradients to, by name, the
    one in use first; empty unless ``engine`` (or the channel it is) comes
    from the engine ``init()`` started under ``auto`` with
    ``DP_PLUGIN_AUTOTUNE=1`` (``engines.start_alternates``). Each other
    engine gives a channel of its own, named ``name``, so that no two
    schedulers' buckets meet (the same ``name`` again gets the same
    channels). Collective when it makes channels: every rank calls it at
    the same point."""
    with _lock:
        if _engine is None or not _alternates:
            return {}
        if engine is not _engine and engine not in _engine.channels:
            return {}
        for other, alternate in _alternates.items():
            if (other, name) not in _alternate_channels:
                _alternate_channels[other, name] = alternate.channel(name)
        return {engine.name: engine, **{n: _alternate_channels[n, name] for n in _alternates}}


def topology() -> Topology:
    return engine().topology


def rank() -> int:
    return engine().rank


def size() -> int:
    return engine().size


def shutdown() -> None:
    """Release the engine (and autotune's others). Collective for engines
    whose teardown is (MPI, gloo)."""
    global _engine, _alternates
    with _lock:
        engines = [*_alternates.values(), *([] if _engine is None else [_engine])]
        _engine, _alternates = None, {}
        _alternate_channels.clear()  # shut down with their engines
        errors = []
        for engine in engines:  # every one, even after a failure: each is collective
            try:
                engine.shutdown()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
