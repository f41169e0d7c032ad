"""s3:// against the conformance suite, on a real SeaweedFS server (a fresh prefix per test).

The default thresholds apply: the 256 MiB round trip goes through a multipart upload and
parallel ranged GETs, the smaller objects through single requests (tests/test_s3.py drives both
paths with small thresholds too).
"""

from __future__ import annotations

import uuid

import pytest
from servers.s3 import S3Server

from connectors.s3 import S3Connector
from gateway.connector import Connector
from gateway.testing import ConnectorConformance, ConnectorFactory

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops


class TestS3Conformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, s3_server: S3Server) -> ConnectorFactory:
        url = s3_server.url(f"conformance-{uuid.uuid4().hex[:8]}")
        options = s3_server.options()

        async def make() -> Connector:
            return S3Connector.from_url(url, **options)

        return make
