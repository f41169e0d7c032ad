"""A raw lm:// client for kvgate's lm:// server tests: it writes exactly what it is told
(valid or not) and reads exactly the reply, over a real loopback socket."""

from __future__ import annotations

import asyncio
import contextlib

from gateway.lmcache.wire import (
    REPLY,
    REQUEST,
    Command,
    Reply,
    Request,
    encode_request,
    parse_reply,
)
from gateway.store import Store

KEY = "llama@1@0@abc123@bfloat16"
IO_LIMIT = 5.0  # seconds: no test waits longer for a socket


class Server:
    def __init__(self, store: Store, port: int, handle: asyncio.Server | None = None) -> None:
        self.store = store
        self.port = port
        self.handle = handle  # what serve_lm returned

    async def connect(self) -> Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        return Client(reader, writer)


class Client:
    """A raw lm:// client: writes what it is told, reads exactly the reply."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, *chunks: bytes) -> None:
        for chunk in chunks:
            self.writer.write(chunk)
        await self.writer.drain()

    async def reply(self) -> tuple[Reply, bytes]:
        async with asyncio.timeout(IO_LIMIT):
            reply = parse_reply(await self.reader.readexactly(REPLY.size))
            payload = await self.reader.readexactly(reply.length) if reply.length else b""
        return reply, payload

    async def ask(self, req: Request) -> tuple[Reply, bytes]:
        await self.send(encode_request(req))
        return await self.reply()

    async def closed_by_server(self) -> bool:
        """Whether the server closes the connection, sending nothing (within IO_LIMIT); a reset
        counts as closed."""
        try:
            async with asyncio.timeout(IO_LIMIT):
                return await self.reader.read(1) == b""
        except ConnectionError:
            return True

    async def drained_until_closed(self) -> int:
        """Read and drop what the server sends until it closes (within IO_LIMIT): the bytes."""
        got = 0
        try:
            async with asyncio.timeout(IO_LIMIT):
                while chunk := await self.reader.read(1 << 20):
                    got += len(chunk)
        except ConnectionError:
            pass
        return got

    async def close(self) -> None:
        """Close this side; harmless when the server closed or reset it already."""
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


def put(key: str, payload: bytes, fmt: int, dtype: int, shape: tuple[int, ...]) -> bytes:
    dims = (*shape, 0, 0, 0, 0)[:4]
    header = encode_request(Request(Command.PUT, key, len(payload), fmt, dtype, dims))  # type: ignore[arg-type]
    return header + payload


def raw_header(command: int, length: int, fmt: int = 1, dtype: int = 3, key: str = KEY) -> bytes:
    """A header packed without validation (for the malformed cases)."""
    return REQUEST.pack(command, length, fmt, dtype, 0, 0, 0, 0, 0, key.encode().ljust(150))
