"""``exists_many`` beyond the conformance suite: the base class's bounded default (no task per
key, the first failure ends the batch), and Redis's pipelined form against a scripted peer, a
killed server and a stalled one (error kinds, the socket timeout honoured).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis
from servers.proc import free_port
from servers.redis import RedisNode
from servers.redis_script import Script, read_command
from servers.valkey import start_valkey

from connectors.redis import RedisConnector
from connectors.valkey import ValkeyConnector
from gateway.connector import BaseConnector
from gateway.errors import Timeout, Unavailable

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops
HANG_GUARD = 30.0  # seconds: only a hang trips it, never a slow run


class _Probed(BaseConnector):
    """A connector whose ``exists`` is the base class's input: present keys, a failing key,
    and a count of calls in flight."""

    scheme = "probed"

    def __init__(self, present: set[str], failing: str | None = None) -> None:
        self.present = present
        self.failing = failing
        self.calls = 0
        self.in_flight = 0
        self.most_in_flight = 0

    async def exists(self, key: str) -> bool:
        self.calls += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0)
            if key == self.failing:
                raise Unavailable("the backend went away")
            return key in self.present
        finally:
            self.in_flight -= 1


async def test_default_exists_many_is_bounded_and_in_order() -> None:
    keys = [f"k{i}" for i in range(1000)]
    conn = _Probed({k for i, k in enumerate(keys) if i % 7 == 0})
    conn.batch_concurrency = 5
    assert await conn.exists_many(keys) == [i % 7 == 0 for i in range(1000)]
    assert conn.most_in_flight == 5
    assert await conn.exists_many([]) == []


async def test_default_exists_many_stops_at_the_first_failure() -> None:
    keys = [f"k{i}" for i in range(1000)]
    conn = _Probed(set(keys), failing="k10")
    conn.batch_concurrency = 4
    with pytest.raises(Unavailable):
        await conn.exists_many(keys)
    assert conn.calls < 100, "the batch went on asking after a failure"
    assert conn.in_flight == 0, "calls still in flight after the batch failed"


# -- Redis ------------------------------------------------------------------------------------


def _present(key: bytes) -> bool:
    return key.endswith((b"0", b"3", b"7"))


async def test_pipelined_exists_replies_split_anywhere(
    scripted: Callable[[Script], Awaitable[str]], make_conn: Callable[..., RedisConnector]
) -> None:
    """Thousands of replies that arrive a few bytes at a time, CRLFs split across reads."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pending = b""
        while True:
            name, key = await read_command(reader)
            assert name == b"EXISTS"
            pending += b":1\r\n" if _present(key) else b":0\r\n"
            writer.write(pending[:3])  # 3 bytes at a time: CRLFs split across reads
            pending = pending[3:]
            if not reader._buffer:  # type: ignore[attr-defined]  # the pipeline is all read
                writer.write(pending)
                pending = b""
            await writer.drain()

    conn = make_conn(await scripted(script))
    keys = [f"key{i}" for i in range(3000)]
    want = [_present(conn.main_key(k)) for k in keys]
    async with asyncio.timeout(HANG_GUARD):
        assert await conn.exists_many(keys) == want
        assert await conn.exists_many(keys[:1]) == want[:1]  # the same connection, in step


async def test_pipelined_exists_error_reply_is_raised_as_its_kind(
    scripted: Callable[[Script], Awaitable[str]], make_conn: Callable[..., RedisConnector]
) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_command(reader)
            await read_command(reader)
            writer.write(b":1\r\n-LOADING Redis is loading the dataset in memory\r\n")

    conn = make_conn(await scripted(script))
    async with asyncio.timeout(HANG_GUARD):
        with pytest.raises(Unavailable, match="loading"):
            await conn.exists_many(["a", "b"])


async def test_pipelined_exists_refuses_what_is_not_a_one_line_reply(
    scripted: Callable[[Script], Awaitable[str]], make_conn: Callable[..., RedisConnector]
) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_command(reader)
        writer.write(b"$-1\r\n")  # one line, but a nil bulk: not what EXISTS answers
        await reader.read()

    conn = make_conn(await scripted(script))
    async with asyncio.timeout(HANG_GUARD):
        with pytest.raises(Unavailable, match="one-line reply"):
            await conn.exists_many(["a"])


async def test_exists_many_of_a_killed_server_is_unavailable(
    redis_factory: Callable[..., RedisNode], make_conn: Callable[..., RedisConnector]
) -> None:
    node = redis_factory()
    for fast in (True, False):
        conn = make_conn(node.url, fast_path=fast, namespace=f"killed-{fast}:")
        await conn.put("there", b"x")
        assert await conn.exists_many(["there", "not"]) == [True, False]
    node.kill()
    for conn_fast in (True, False):
        conn = make_conn(node.url, fast_path=conn_fast, socket_connect_timeout=2.0)
        async with asyncio.timeout(HANG_GUARD):
            with pytest.raises(Unavailable):
                await conn.exists_many(["there", "not"])


async def test_exists_many_of_a_stalled_server_times_out(
    redis_factory: Callable[..., RedisNode], make_conn: Callable[..., RedisConnector]
) -> None:
    node = redis_factory()
    conn = make_conn(node.url, socket_timeout=0.5)
    keys = [f"k{i}" for i in range(2000)]
    assert await conn.exists_many(keys) == [False] * len(keys)  # the connection is open
    assert node.proc is not None
    with node.proc.paused():
        async with asyncio.timeout(HANG_GUARD):
            with pytest.raises(Timeout):
                await conn.exists_many(keys)
    assert await conn.exists_many(keys[:3]) == [False] * 3  # a new connection, all well


# -- Valkey -----------------------------------------------------------------------------------


async def test_valkey_without_scripts_answers_by_batch(tmp_path: Path) -> None:
    """A server that refuses scripts (EVALSHA and EVAL renamed away) gets batches instead."""
    port = free_port()
    server = start_valkey(
        tmp_path / "valkey", port, "--rename-command", "EVALSHA", "", "--rename-command", "EVAL", ""
    )
    with redis.Redis(port=port) as plain, pytest.raises(redis.ResponseError, match="unknown"):
        plain.eval("return 1", 0)  # the server does refuse scripts
    conn = ValkeyConnector.from_url(f"valkey://127.0.0.1:{port}", request_timeout=2.0)
    try:
        await conn.put("there", b"x")
        keys = ["there", "not", "there", *(f"k{i}" for i in range(100))]
        want = [True, False, True, *([False] * 100)]
        async with asyncio.timeout(HANG_GUARD):
            assert await conn.exists_many(keys) == want
            assert await conn.exists_many(keys) == want  # batches from then on
        server.kill()  # glide reconnects until the request's own timeout
        async with asyncio.timeout(HANG_GUARD):
            with pytest.raises((Unavailable, Timeout)):
                await conn.exists_many(keys)
    finally:
        await conn.close()
        server.stop()
