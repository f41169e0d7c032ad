"""The Redis connectors against the conformance suite, on real redis-server processes.

One runner per mode: standalone over TCP (default options, and small parts read through
redis-py instead of the fast path), TLS, unix socket, a 3-node Cluster and Sentinel.
"""

from __future__ import annotations

from typing import Any

import pytest
from servers.redis import RedisClusterGroup, RedisNode, SentinelGroup

from connectors.redis import RedisConnector
from gateway.connector import Connector
from gateway.testing import ConnectorConformance, ConnectorFactory

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops


def _factory(url: str, **options: Any) -> ConnectorFactory:
    async def make() -> Connector:
        return RedisConnector.from_url(url, **options)

    return make


class TestRedisConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, redis_server: RedisNode) -> ConnectorFactory:
        return _factory(redis_server.url)


class TestRedisSmallPartsNoFastPathConformance(ConnectorConformance):
    """Many small parts, read by redis-py GETs (the fast path off)."""

    @pytest.fixture
    def connector_factory(self, redis_server: RedisNode) -> ConnectorFactory:
        return _factory(
            redis_server.url,
            part_size=1 << 20,
            inline_max=4096,
            fast_path=False,
            namespace="kvgate-small:",
        )


class TestRedisTlsConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, redis_tls_server: RedisNode) -> ConnectorFactory:
        return _factory(redis_tls_server.url, **redis_tls_server.options())


class TestRedisUnixConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, redis_unix_server: RedisNode) -> ConnectorFactory:
        return _factory(redis_unix_server.url, db=1)


class TestRedisClusterConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, redis_cluster: RedisClusterGroup) -> ConnectorFactory:
        return _factory(redis_cluster.url, part_size=1 << 20)


class TestRedisSentinelConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, redis_sentinel: SentinelGroup) -> ConnectorFactory:
        return _factory(redis_sentinel.url, min_replicas_ack=1)
