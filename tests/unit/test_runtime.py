"""init / shutdown / use-before-init of the process-wide runtime."""

from __future__ import annotations

import logging

import pytest

import dp_plugin
from dp_plugin.config import Config
from dp_plugin.errors import NotInitializedError
from dp_plugin.launch import runtime


@pytest.fixture(autouse=True)
def _clean_runtime():
    runtime.shutdown()
    yield
    runtime.shutdown()


def test_use_before_init_names_the_fix() -> None:
    for fn in (dp_plugin.engine, dp_plugin.rank, dp_plugin.size, dp_plugin.topology):
        with pytest.raises(NotInitializedError, match=r"call init\(\)"):
            fn()
    assert not dp_plugin.is_initialized()


def _engine_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    messages = (r.getMessage() for r in caplog.records)
    return [m for m in messages if m.startswith("dp_plugin: engine")]


def test_single_process_init_picks_local_and_is_idempotent(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="dp_plugin"):
        engine = dp_plugin.init(env={})
    assert engine.name == "local"
    assert (dp_plugin.rank(), dp_plugin.size()) == (0, 1)
    assert dp_plugin.init(env={}) is engine
    # the log line says why this engine
    assert [line.startswith("dp_plugin: engine local (single process") for line in
            _engine_lines(caplog)] == [True]
    dp_plugin.shutdown()
    assert not dp_plugin.is_initialized()


def test_explicit_engine_from_config(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="dp_plugin"):
        engine = dp_plugin.init(Config(engine="local"), env={})
    assert engine.name == "local"
    assert [line.startswith("dp_plugin: engine local (requested") for line in
            _engine_lines(caplog)] == [True]


def test_unknown_engine_in_env_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid values: auto, horovod, gloo, nccl, mpi, local"):
        dp_plugin.init(env={"DP_PLUGIN_ENGINE": "carrier-pigeon"})
    assert not dp_plugin.is_initialized()
