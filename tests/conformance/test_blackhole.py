"""blackhole:// against the conformance suite: every put accepted, every read a miss."""

from __future__ import annotations

import pytest

from connectors.blackhole import BlackholeConnector
from gateway.connector import Connector
from gateway.errors import ConfigError
from gateway.testing import ConnectorConformance, ConnectorFactory

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops


class TestBlackholeConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self) -> ConnectorFactory:
        async def make() -> Connector:
            return BlackholeConnector.from_url("blackhole://")

        return make


async def test_counts_what_it_discards() -> None:
    conn = BlackholeConnector()
    await conn.put("a", [b"abc", memoryview(b"de")])
    await conn.put_many([("b", b"x" * 10)])
    assert conn.bytes_discarded == 15
    assert conn.puts == 2


def test_takes_no_options() -> None:
    with pytest.raises(ConfigError, match="'capacity'"):
        BlackholeConnector.from_url("blackhole://", capacity=1)
    with pytest.raises(ConfigError, match="no host or path"):
        BlackholeConnector.from_url("blackhole://somewhere")
