"""mooncake:// against the conformance suite, on a real master and a separate segment holder.

The connector contributes no memory, so every object crosses TCP to the holder's segment and
back. TCP only: RDMA cannot be tested here (no RDMA device).
"""

from __future__ import annotations

import pytest
from servers.mooncake import MooncakeCluster

from connectors.mooncake import MooncakeConnector
from gateway.connector import Connector
from gateway.testing import ConnectorConformance, ConnectorFactory

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops


class TestMooncakeConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self, mooncake_cluster: MooncakeCluster) -> ConnectorFactory:
        async def make() -> Connector:
            return MooncakeConnector.from_url(mooncake_cluster.url, **mooncake_cluster.options)

        return make
