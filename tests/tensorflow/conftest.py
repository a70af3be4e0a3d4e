"""Every test here runs on a fresh one-process runtime (the local engine)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import dp_plugin.tensorflow as dp
from dp_plugin.config import Config
from dp_plugin.launch import runtime


@pytest.fixture(autouse=True)
def _local_runtime() -> Iterator[None]:
    runtime.shutdown()
    runtime.init(Config(engine="local"), env={})
    yield
    dp.shutdown()  # also forgets the process sets a test registered
