"""azure:// against the conformance suite, on a real azurite server (a fresh prefix per test).

Small thresholds, so that the 32 and 256 MiB round trips go as staged blocks committed last and
are read back as parallel ranged GETs, and the smaller ones as single requests (the suite's
concurrent writers race 1 MiB objects: tests/test_azure.py races staged ones on their own).
"""

from __future__ import annotations

import uuid

import pytest
from servers.azurite import AzuriteServer

from connectors.azure import AzureConnector
from gateway.connector import Connector
from gateway.testing import ConnectorConformance, ConnectorFactory

MiB = 1 << 20
SMALL_PIECES = {
    "put_threshold": 2 * MiB,
    "block_size": 4 * MiB,
    "ranged_get_threshold": 2 * MiB,
    "range_size": 4 * MiB,
}


class TestAzureConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, azurite_server: AzuriteServer) -> ConnectorFactory:
        url = azurite_server.url(f"conformance-{uuid.uuid4().hex[:8]}")
        options = azurite_server.options(**SMALL_PIECES)

        async def make() -> Connector:
            return AzureConnector.from_url(url, **options)

        return make
