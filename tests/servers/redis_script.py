"""A scripted stand-in for a Redis server, for the fast path's edge cases that a real server
never produces on demand (a reply cut short, a stall mid-reply, garbage): each connection is
answered by a script after the PING every fast-path connection opens with."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from connectors.redis import RedisConnector

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_command(reader: asyncio.StreamReader) -> list[bytes]:
    """One RESP command's arguments."""
    count = int((await reader.readline())[1:])
    args = []
    for _ in range(count):
        size = int((await reader.readline())[1:])
        args.append((await reader.readexactly(size + 2))[:-2])
    return args


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[[Script], Awaitable[str]]]:
    """A TCP peer that answers each connection with a script; yields its redis:// URL."""
    servers: list[asyncio.Server] = []

    async def start(script: Script) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                # A fast-path connection opens with a PING (it finds out about NOAUTH early).
                assert await read_command(reader) == [b"PING"]
                writer.write(b"+PONG\r\n")
                await script(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        return f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


@pytest.fixture
async def make_conn() -> AsyncIterator[Callable[..., RedisConnector]]:
    """Build Redis connectors that are closed at the end of the test."""
    made: list[RedisConnector] = []

    def make(url: str, **options: Any) -> RedisConnector:
        conn = RedisConnector.from_url(url, **options)
        made.append(conn)
        return conn

    yield make
    for conn in made:
        await conn.close()
