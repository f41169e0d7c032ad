"""The lm:// connector: URL and options, key mapping, timeouts and failures on real sockets,
and objects it writes as seen by kvgate's server and by LMCache's stock server.

The conformance suite (tests/conformance/test_lm.py) covers the contract on both servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio
from servers.proc import free_port

from connectors.lm import LmConnector, parse_url, wire_key
from gateway.connector import limiting_reads
from gateway.errors import CapacityError, ConfigError, CorruptObject, Timeout, Unavailable
from gateway.keys import Key
from gateway.layers import CircuitBreakerLayer, RetryLayer, find_layer
from gateway.lmcache.server import close_lm, lm_stats, serve_lm
from gateway.lmcache.wire import KEY_BYTES
from gateway.store import Store

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops

torch = pytest.importorskip("torch")

LM_KEY = "llama@1@0@-1f@bfloat16@tp%2"
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest_asyncio.fixture
async def kvgate() -> AsyncIterator[tuple[Store, str]]:
    cfg = {"tiers": [{"url": "memory://", "capacity": 32 << 20}], "prefault": False}
    async with Store(cfg) as store:
        port = free_port()
        server = await serve_lm(store, "127.0.0.1", port)
        try:
            yield store, f"lm://127.0.0.1:{port}"
        finally:
            await close_lm(server)


def test_url_and_options() -> None:
    assert parse_url("lm://example:6555").port == 6555
    for bad in ("lm://h", "lm://u:p@h:1", "lm://h:1/path", "lm://h:1?x=1", "redis://h:1"):
        with pytest.raises(ConfigError):
            parse_url(bad)
    with pytest.raises(ConfigError, match="pool"):
        LmConnector.from_url("lm://h:1", pool="x")
    with pytest.raises(ConfigError):
        LmConnector.from_url("lm://h:1", timeout=0)


def test_wire_keys() -> None:
    assert wire_key(LM_KEY) == LM_KEY  # an LMCache key travels as it is
    mapped = [wire_key(k) for k in ("plain", "PLAIN", " plain", "m@1@0@0X1F@half", "x" * 200)]
    assert len(set(mapped)) == len(mapped)
    for m in mapped:
        assert str(Key.parse(m)) == m  # every wire key is an LMCache key ...
        assert len(m) <= KEY_BYTES  # ... that fits the header
    long_lm = str(Key("m" * 140, 1, 0, 1, "half"))
    assert wire_key(long_lm) != long_lm


async def test_objects_land_in_kvgates_store(kvgate: tuple[Store, str]) -> None:
    store, url = kvgate
    async with LmConnector.from_url(url) as conn:
        await conn.put(LM_KEY, [b"ab", b"cd"])
        stored = await store.get(LM_KEY)  # a uint8 tensor: dtype uint8, format BINARY
        assert isinstance(stored, torch.Tensor)
        assert bytes(stored.numpy()) == b"abcd"
        assert await conn.exists(LM_KEY)
        assert await conn.delete(LM_KEY)
        assert await store.get(LM_KEY) is None  # kvgate's server deleted it
        await store.put(LM_KEY, b"from the store")
        assert await conn.get(LM_KEY) == b"from the store"


async def test_pool_serves_concurrent_calls(kvgate: tuple[Store, str]) -> None:
    _, url = kvgate
    async with LmConnector.from_url(url, pool_size=3) as conn:
        items = [(f"k{i}", bytes([i]) * (100_000 + i)) for i in range(12)]
        await conn.put_many(items)
        assert await conn.get_many([k for k, _ in items]) == [v for _, v in items]
        assert isinstance(conn, LmConnector)
        assert len(conn._idle) <= 3


async def test_connections_the_server_closed_while_idle_are_not_reused() -> None:
    """The server restarted between calls: the pool's idle connections are dead, and the
    next call must not fail on one (nor its retry on the next)."""
    cfg = {"tiers": [{"url": "memory://", "capacity": 32 << 20}], "prefault": False}
    port = free_port()
    async with Store(cfg) as store:
        server = await serve_lm(store, "127.0.0.1", port)
        conn = LmConnector.from_url(f"lm://127.0.0.1:{port}", pool_size=3)
        try:
            await asyncio.gather(*(conn.put(f"k{i}", b"v" * 1000) for i in range(3)))
            await close_lm(server)  # closes its connections: the pool's are all dead now
            server = await serve_lm(store, "127.0.0.1", port)
            await asyncio.sleep(0.05)  # the closes reach the client
            await conn.put("after", b"w" * 1000)
            assert await conn.get("after") == b"w" * 1000
        finally:
            await conn.close()
            await close_lm(server)


class FakeServer:
    """A loopback server running ``handler``; ``close`` also closes its connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.writers: list[asyncio.StreamWriter] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        await self.handler(reader, writer)

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        self.server.close()
        for writer in self.writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        await self.server.wait_closed()


async def test_server_that_never_answers_times_out() -> None:
    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # read everything, answer nothing

    server = FakeServer(swallow)
    port = await server.start()
    try:
        conn = LmConnector.from_url(f"lm://127.0.0.1:{port}", timeout=0.3, connect_timeout=0.3)
        with pytest.raises(Timeout):
            await conn.get("k")
        await conn.close()
    finally:
        await server.close()


async def test_refused_and_reset_connections_are_unavailable() -> None:
    conn = LmConnector.from_url(f"lm://127.0.0.1:{free_port()}", timeout=1.0)
    with pytest.raises(Unavailable):
        await conn.exists("k")
    await conn.close()

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(186)
        writer.write(b"\x00" * 36)  # code 0: not an lm:// reply
        await writer.drain()

    server = FakeServer(hang_up)
    port = await server.start()
    try:
        conn = LmConnector.from_url(f"lm://127.0.0.1:{port}", timeout=1.0)
        with pytest.raises(Unavailable):
            await conn.get("k")
        assert conn._idle == []  # the broken connection was not kept
        await conn.close()
    finally:
        await server.close()


async def test_stock_server_tombstones(lmcache_server: str) -> None:
    async with LmConnector.from_url(lmcache_server) as conn:
        assert await conn.ping()
        await conn.put(LM_KEY, b"chunk")
        assert await conn.get(LM_KEY) == b"chunk"
        assert await conn.delete(LM_KEY)
        assert not await conn.exists(LM_KEY)  # the stock server still holds the tombstone
        assert await conn.get(LM_KEY) is None
        assert not await conn.delete(LM_KEY)
        await conn.put(LM_KEY, b"again")
        assert await conn.get(LM_KEY) == b"again"


async def test_an_answer_longer_than_the_reader_takes_is_refused_unread(
    kvgate: tuple[Store, str],
) -> None:
    """The length in a GET reply is the server's word: over read_limit() it is corrupt, and
    the connection is dropped before a byte of it is read."""
    _, url = kvgate
    conn = LmConnector.from_url(url)
    try:
        await conn.put("big", bytes(4 << 20))
        with limiting_reads(1 << 20), pytest.raises(CorruptObject, match="over"):
            await conn.get("big")
        assert len(await conn.get("big") or b"") == 4 << 20  # no limit: read whole
    finally:
        await conn.close()


async def test_puts_over_the_servers_limit_are_refused_objects_not_an_outage() -> None:
    """kvgate's server reads and drops a PUT over its ``max_payload`` and keeps the connection;
    the EXIST after it answers "missing" and the put is a CapacityError. Through a Store's
    lm:// tier (its layers: retries, a breaker that opens after 5 failures) six of them are
    neither retried nor counted as failures: the breaker stays closed, and a small put and get
    then go through on the same connection."""
    backing_cfg = {"tiers": [{"url": "memory://", "capacity": 32 << 20}], "prefault": False}
    async with Store(backing_cfg) as backing:
        port = free_port()
        server = await serve_lm(backing, "127.0.0.1", port, max_payload=64 << 10)
        try:
            tier = {"url": f"lm://127.0.0.1:{port}", "breaker": {"failures": 5}}
            async with Store({"tiers": [tier], "prefault": False}) as store:
                stack = store.tiers[0].connector
                breaker = find_layer(stack, CircuitBreakerLayer)
                retry = find_layer(stack, RetryLayer)
                assert breaker is not None
                assert retry is not None
                for i in range(6):
                    with pytest.raises(CapacityError, match="did not store"):
                        await store.put(f"big{i}", bytes(256 << 10), durable=True)
                assert breaker.state == "closed"
                assert retry.retries == 0  # not sent again: the object is the problem
                await store.put("small", b"fits", durable=True)
                assert await store.get("small") == b"fits"
                assert lm_stats(server).connections == 1  # the one connection went on
        finally:
            await close_lm(server)


async def test_a_put_over_the_protocols_limit_is_a_capacity_error() -> None:
    """Over lm://'s int32 length the object cannot travel at all: refused before any byte is
    sent (no connection needed), as the object's problem rather than the server's."""
    huge = mmap.mmap(-1, 1 << 31)  # 2 GiB of address space, none of it touched
    conn = LmConnector.from_url(f"lm://127.0.0.1:{free_port()}")
    try:
        with memoryview(huge) as view, pytest.raises(CapacityError, match="2 GiB"):
            await conn.put("k", view)
    finally:
        huge.close()
        await conn.close()
