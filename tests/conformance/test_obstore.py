"""obstore+s3:// against the conformance suite, on a real SeaweedFS server (a fresh prefix per
test). The 256 MiB round trip goes as one PutObject and one GET (the defaults)."""

from __future__ import annotations

import uuid

import pytest
from servers.s3 import S3Server

from connectors.obstore import ObstoreS3Connector
from gateway.connector import Connector
from gateway.testing import ConnectorConformance, ConnectorFactory

# obstore's futures resolve through the running loop: asyncio's and uvloop (`kvgate serve`).
pytestmark = pytest.mark.both_loops


class TestObstoreS3Conformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, s3_server: S3Server) -> ConnectorFactory:
        url = f"obstore+s3://{s3_server.bucket}/conformance-{uuid.uuid4().hex[:8]}"
        options = s3_server.options()

        async def make() -> Connector:
            return ObstoreS3Connector.from_url(url, **options)

        return make
