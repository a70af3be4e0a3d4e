"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def kv_server() -> Iterator[int]:
    """Horovod's own rendezvous server (an HTTP key-value store, as horovodrun
    starts it) on a free port: yields the port."""
    from horovod.runner.http.http_server import KVStoreServer

    server = KVStoreServer(verbose=0)
    port = server.start_server()
    yield port
    server.shutdown_server()
