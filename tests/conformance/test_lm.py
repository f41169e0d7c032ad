"""lm:// against the conformance suite: on kvgate's own lm:// server and on the stock
``lmcache_server`` of LMCache 0.5.6 (skipped locally without ``.ci/lmcache-env``, failed in CI).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from servers.proc import free_port

from connectors.lm import LmConnector
from gateway.connector import Connector
from gateway.lmcache.server import close_lm, serve_lm
from gateway.store import Store
from gateway.testing import ConnectorConformance, ConnectorFactory

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops


@pytest_asyncio.fixture
async def kvgate_lm_server() -> AsyncIterator[str]:
    """kvgate's lm:// server over a memory-only Store with room for the suite's 256 MiB."""
    cfg = {"tiers": [{"url": "memory://", "capacity": 640 << 20}], "prefault": False}
    async with Store(cfg) as store:
        port = free_port()
        server = await serve_lm(store, "127.0.0.1", port)
        try:
            yield f"lm://127.0.0.1:{port}"
        finally:
            await close_lm(server)


class TestLmKvgateConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, kvgate_lm_server: str) -> ConnectorFactory:
        async def make() -> Connector:
            return LmConnector.from_url(kvgate_lm_server, timeout=60.0)

        return make


class TestLmcacheServerConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, lmcache_server: str) -> ConnectorFactory:
        async def make() -> Connector:
            return LmConnector.from_url(lmcache_server, timeout=60.0)

        return make
