"""gateway:// against the conformance suite, on a real kvgate service (uvicorn on loopback).

The service runs in its own process with a memory tier; the suite's keys carry a random prefix,
so one service serves the whole module.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from servers.gateway_server import GatewayServer, gateway_server_at

from connectors.gateway import GatewayConnector
from gateway.connector import Connector
from gateway.testing import ConnectorConformance, ConnectorFactory

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops


@pytest.fixture(scope="module")
def gateway_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    yield from gateway_server_at(tmp_path_factory.mktemp("gateway"))


class TestGatewayConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, gateway_server: GatewayServer) -> ConnectorFactory:
        async def make() -> Connector:
            return GatewayConnector.from_url(gateway_server.url, timeout=60.0)

        return make
