"""A fixture for single-process dp_plugin.torch tests: the local engine,
started fresh for each test (import ``local_engine`` into a test module)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import dp_plugin.torch as hvd
from dp_plugin.api import process_sets
from dp_plugin.config import Config
from dp_plugin.engines.base import Engine
from dp_plugin.launch import runtime


@pytest.fixture(autouse=True)
def local_engine() -> Iterator[Engine]:
    hvd.shutdown()
    engine = runtime.init(Config(engine="local"), env={})
    process_sets.setup(None, "dp_plugin.torch")
    yield engine
    hvd.shutdown()
