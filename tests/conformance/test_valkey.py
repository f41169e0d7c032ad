"""valkey://, valkeys:// and valkey+cluster:// against the conformance suite, on real servers.

Each runner uses its own namespace per test, so tests sharing a session server never see
each other's objects (the conformance keys carry a random prefix as well).
"""

from __future__ import annotations

import uuid

import pytest
from servers.valkey import TlsServer

from connectors.valkey import ValkeyConnector
from gateway.connector import Connector
from gateway.testing import ConnectorConformance, ConnectorFactory

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops


def _factory(url: str, **options: object) -> ConnectorFactory:
    namespace = f"kvgate-test-{uuid.uuid4().hex[:8]}:"

    async def make() -> Connector:
        return ValkeyConnector.from_url(url, namespace=namespace, **options)

    return make


class TestValkeyConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, valkey_server: str) -> ConnectorFactory:
        return _factory(valkey_server)


class TestValkeyTlsConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, valkey_tls_server: TlsServer) -> ConnectorFactory:
        return _factory(valkey_tls_server.url, tls_ca_file=str(valkey_tls_server.certs.ca))


class TestValkeyClusterConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, valkey_cluster: str) -> ConnectorFactory:
        return _factory(valkey_cluster)
