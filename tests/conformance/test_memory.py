"""memory:// against the conformance suite, plus what only the memory connector does."""

from __future__ import annotations

import uuid

import pytest

from connectors.memory import MemoryConnector
from gateway.connector import Connector
from gateway.errors import CapacityError, ConfigError
from gateway.testing import ConnectorConformance, ConnectorFactory

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops


class TestMemoryConformance(ConnectorConformance):
    @pytest.fixture
    def connector_factory(self) -> ConnectorFactory:
        # A named space, so that the suite's instances share it (and persistence is skipped
        # by capability: persistent=False).
        url = f"memory://conformance-{uuid.uuid4().hex}"

        async def make() -> Connector:
            return MemoryConnector.from_url(url)

        return make


async def test_named_instances_share_and_private_ones_do_not() -> None:
    name = f"shared-{uuid.uuid4().hex}"
    a, b = MemoryConnector.from_url(f"memory://{name}"), MemoryConnector(name)
    private = MemoryConnector.from_url("memory://")
    await a.put("k", b"v")
    assert await b.get("k") == b"v"
    assert await private.get("k") is None
    await a.close()
    assert await MemoryConnector(name).get("k") == b"v"  # the space outlives its instances
    with pytest.raises(ConfigError, match="already open"):
        MemoryConnector(name, capacity=10)


async def test_capacity_evicts_by_policy_and_rejects_oversized() -> None:
    lru = MemoryConnector(capacity=30, eviction="lru")
    fifo = MemoryConnector.from_url("memory://", capacity=30, eviction="fifo")
    for conn in (lru, fifo):
        for key in "abc":
            await conn.put(key, b"x" * 10)
        await conn.get("a")  # a hit: LRU keeps it, FIFO does not care
        await conn.put("d", [b"y" * 5, b"y" * 5])
        assert conn.usage() == (30, 30)
        with pytest.raises(CapacityError):
            await conn.put("big", b"z" * 31)
        assert not await conn.exists("big")
    assert sorted(lru.objects) == ["a", "c", "d"]
    assert sorted(fifo.objects) == ["b", "c", "d"]


def test_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="'capacty'"):
        MemoryConnector.from_url("memory://", capacty=10)
    with pytest.raises(ConfigError, match="capacity"):
        MemoryConnector.from_url("memory://", capacity=-1)
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        MemoryConnector.from_url("memory://", eviction="random")
    with pytest.raises(ConfigError, match="not a memory:// URL"):
        MemoryConnector.from_url("file:///tmp")


async def test_objects_is_the_real_storage() -> None:
    conn = MemoryConnector()
    await conn.put("k", bytearray(b"abc"))
    assert conn.objects == {"k": b"abc"}
    conn.objects["k"] = b"xyz"  # how tests corrupt an object on purpose
    assert await conn.get("k") == b"xyz"
