"""gs:// against the conformance suite, on gcp-storage-emulator (a fresh prefix per test).

Small thresholds, so that the 32 and 256 MiB round trips go as parts composed at the end and
are read back as parallel ranged GETs, and the smaller ones as single requests (the suite's
concurrent writers race 1 MiB objects: tests/test_gcs.py races composed ones on their own).
"""

from __future__ import annotations

import uuid

import pytest
from servers.gcs_emulator import GcsServer

from connectors.gcs import GcsConnector
from gateway.connector import Connector
from gateway.testing import ConnectorConformance, ConnectorFactory

MiB = 1 << 20
SMALL_PIECES = {
    "put_threshold": 2 * MiB,
    "part_size": 4 * MiB,
    "ranged_get_threshold": 2 * MiB,
    "range_size": 4 * MiB,
}


class TestGcsConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, gcs_server: GcsServer) -> ConnectorFactory:
        url = gcs_server.url(f"conformance-{uuid.uuid4().hex[:8]}")
        options = gcs_server.options(**SMALL_PIECES)

        async def make() -> Connector:
            return GcsConnector.from_url(url, **options)

        return make
