"""memcached:// against the conformance suite, on a real memcached 1.6 (``-m 1024 -I 64m``).

Two runners: split into 1 MiB parts above 64 KiB (so the 256 MiB round trip goes through 256
parts, and the suite's MiB-sized objects through a few), and ``split=false`` (every object
one item, up to the 64 MiB item limit; the suite skips the 256 MiB round trip by
``max_object_size``).
"""

from __future__ import annotations

import pytest

from connectors.memcached import MemcachedConnector
from gateway.connector import Connector
from gateway.testing import ConnectorConformance, ConnectorFactory

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops


class TestMemcachedConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, memcached_server: str) -> ConnectorFactory:
        async def make() -> Connector:
            return MemcachedConnector.from_url(
                memcached_server,
                item_limit="64MiB",
                part_size="1MiB",
                inline_max="64KiB",  # MiB-sized objects of the suite go through parts too
                namespace="conf:",
            )

        return make


class TestMemcachedUnsplitConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, memcached_server: str) -> ConnectorFactory:
        async def make() -> Connector:
            return MemcachedConnector.from_url(
                memcached_server, item_limit="64MiB", split=False, namespace="conf-unsplit:"
            )

        return make
