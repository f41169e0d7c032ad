"""``lm://host:port``: a client of an LMCache server (``lmcache_server``, or kvgate's own).

A connector is bytes in, bytes out (DESIGN §4): every object travels as dtype uint8, format
BINARY, shape ``[length, 0, 0, 0]``, which the stock server stores and echoes as sent and
kvgate's server stores as a uint8 tensor. The protocol is one request at a time per connection,
so a small pool of connections serves concurrent calls; every call has a timeout, and a
connection that failed or timed out mid-request is closed, never reused (its stream position
is unknown).

Mapping the contract onto a protocol that has only PUT, GET, EXIST, LIST and HEALTH:

- keys: a key that is an LMCache key string of at most 150 bytes goes on the wire as it is
  (the server parses it); any other key becomes ``kvgate@1@0@<sha256 of the key>@uint8``, an
  LMCache key no engine writes.
- put: PUT has no reply, so it is followed by an EXIST on the same connection: the put returns
  once the server has stored the object (read-after-write on any connection). An EXIST that
  answers "missing" means the server did not store it: kvgate's server drops a PUT over its
  ``max_payload`` and goes on (its store may also have refused the object). That is a
  ``CapacityError``, the object's problem, which neither the retries nor the circuit breaker
  count (``gateway.layers``): the server answered, so it is not an outage.
- delete: a tombstone PUT (``gateway.lmcache.wire``). kvgate's server deletes the key; the stock one
  stores the tombstone, which reads back as a miss. Against the stock server, ``exists`` and
  ``delete`` therefore GET the object after a positive EXIST, to tell a tombstone from data;
  against kvgate (recognised by its HEALTH reply) EXIST alone answers.
- objects are limited to 2 GiB - 1 (the protocol's int32 length); a larger put is a
  ``CapacityError`` before anything is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self, TypeVar

from pydantic import Field

from connectors._options import StrictOptions, parse_options, split_url
from gateway.config import redact_url
from gateway.connector import BaseConnector, as_parts, read_limit
from gateway.errors import (
    CapacityError,
    ConfigError,
    GatewayError,
    InvalidKey,
    OverReadLimit,
    Timeout,
    Unavailable,
)
from gateway.keys import Key
from gateway.lmcache.wire import (
    INT32_MAX,
    KEY_BYTES,
    KVGATE_MARK,
    REPLY,
    TOMBSTONE_SHAPE,
    Code,
    Command,
    Format,
    Reply,
    Request,
    WireError,
    encode_request,
    parse_reply,
)
from gateway.types import Buffer, BufferParts, Capabilities

T = TypeVar("T")
STREAM_LIMIT = 16 << 20  # a large payload is read without pausing the socket every 128 KiB
UINT8 = 6
PING_KEY = "kvgate@1@0@0@uint8"  # the stock server parses every header's key, HEALTH's too


class LmOptions(StrictOptions):
    timeout: float = Field(default=30.0, gt=0)
    """Seconds for one whole call (connecting, sending, the reply and its payload)."""
    connect_timeout: float = Field(default=5.0, gt=0)
    pool_size: int = Field(default=4, ge=1, le=256)
    """Connections kept open; also the number of calls in flight at once."""


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int


def parse_url(url: str) -> Address:
    parts = split_url(url, "lm")
    shown = redact_url(url)
    if "@" in parts.netloc or parts.path not in ("", "/"):
        raise ConfigError(f"{shown!r}: lm:// takes host:port, no user and no path")
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{shown!r}: bad port ({exc})") from None
    if port is None:
        raise ConfigError(f"{shown!r}: lm:// needs a port (lm://host:port)")
    return Address(parts.hostname or "127.0.0.1", port)


def _slices(raw: bytes, size: int) -> list[memoryview]:
    view = memoryview(raw)
    return [view[i : i + size] for i in range(0, len(raw), size)]


def wire_key(key: str) -> str:
    """The LMCache key string ``key`` travels as (module docs)."""
    try:
        ok = str(Key.parse(key)) == key and key == key.strip()
    except InvalidKey:
        ok = False
    if ok and len(key.encode("utf-8")) <= KEY_BYTES:
        return key
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    return f"kvgate@1@0@{int.from_bytes(digest, 'big'):x}@uint8"


class _Conn:
    """One open connection; ``broken`` once a call on it did not finish cleanly."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.broken = False

    async def reply(self) -> Reply:
        try:
            return parse_reply(await self.reader.readexactly(REPLY.size))
        except WireError as exc:
            raise Unavailable(f"lm:// server sent a bad reply header: {exc}") from None

    def close(self) -> None:
        self.writer.close()

    def gone(self) -> bool:
        """Whether the server closed this idle connection (it restarted, or dropped idle
        clients): reusing it would fail the next call, and a retry could meet another one."""
        return self.reader.at_eof() or self.writer.is_closing()


class LmConnector(BaseConnector):
    scheme: ClassVar[str] = "lm"

    def __init__(self, address: Address, options: LmOptions | None = None) -> None:
        self.address = address
        self.options = options or LmOptions()
        # persistent: objects outlive the gateway (not a restart of the LMCache server).
        # batch: exists_many pipelines its EXISTs on one connection
        self.capabilities = Capabilities(batch=True, persistent=True, max_object_size=INT32_MAX)
        self.batch_concurrency = self.options.pool_size
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(self.options.pool_size)
        self._kvgate_server: bool | None = None  # known after the first connection
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        return cls(parse_url(url), parse_options(LmOptions, url, options))

    def __repr__(self) -> str:
        return f"LmConnector(lm://{self.address.host}:{self.address.port})"

    # -- connections ----------------------------------------------------------------------

    async def _open(self) -> _Conn:
        try:
            async with asyncio.timeout(self.options.connect_timeout):
                reader, writer = await asyncio.open_connection(
                    self.address.host, self.address.port, limit=STREAM_LIMIT
                )
        except TimeoutError:
            raise Timeout(f"{self!r}: connect timed out") from None
        except OSError as exc:
            raise Unavailable(f"{self!r}: cannot connect: {exc}") from None
        conn = _Conn(reader, writer)
        if self._kvgate_server is None:  # which server is it? (exists needs to know)
            try:
                writer.write(encode_request(Request(Command.HEALTH, PING_KEY)))
                health = await conn.reply()
            except BaseException:
                conn.close()
                raise
            self._kvgate_server = health.shape[3] == KVGATE_MARK
        return conn

    @contextlib.asynccontextmanager
    async def _conn(self) -> AsyncIterator[_Conn]:
        if self._closed:
            raise GatewayError(f"{self!r} is closed")
        async with self._slots:
            conn = self._idle.pop() if self._idle else None
            while conn is not None and conn.gone():
                conn.close()
                conn = self._idle.pop() if self._idle else None
            try:
                async with asyncio.timeout(self.options.timeout):
                    if conn is None:
                        conn = await self._open()
                    yield conn
            except TimeoutError:
                if conn is not None:
                    conn.broken = True
                raise Timeout(f"{self!r}: no answer in {self.options.timeout}s") from None
            except (OSError, asyncio.IncompleteReadError) as exc:
                if conn is not None:
                    conn.broken = True
                raise Unavailable(f"{self!r}: connection failed: {exc!r}") from None
            except BaseException:
                if conn is not None:
                    conn.broken = True
                raise
            finally:
                if conn is not None:
                    if conn.broken or self._closed:
                        conn.close()
                    else:
                        self._idle.append(conn)

    async def _call(self, fn: Callable[[_Conn], Awaitable[T]]) -> T:
        async with self._conn() as conn:
            return await fn(conn)

    # -- the contract ---------------------------------------------------------------------

    async def get(self, key: str) -> Buffer | None:
        wkey = wire_key(key)

        async def run(conn: _Conn) -> bytes | None:
            conn.writer.write(encode_request(Request(Command.GET, wkey)))
            reply = await conn.reply()
            if reply.code != Code.OK:
                return None
            limit = read_limit()
            if limit is not None and reply.length > limit:  # the connection is dropped
                raise OverReadLimit(f"lm:// answered {reply.length} bytes, over {limit}")
            data = await conn.reader.readexactly(reply.length) if reply.length else b""
            return None if reply.is_tombstone else data

        return await self._call(run)

    async def put(self, key: str, data: BufferParts) -> None:
        parts = as_parts(data)
        size = sum(p.nbytes for p in parts)
        if size > INT32_MAX:
            raise CapacityError(f"{self!r}: {size} bytes is over lm://'s 2 GiB limit")
        header = Request(Command.PUT, wire_key(key), size, Format.BINARY, UINT8, (size, 0, 0, 0))
        if not await self._send(header, parts):
            raise CapacityError(
                f"{self!r}: the server did not store {key!r} "
                "(over its size limit, or its store refused it)"
            )

    async def _send(self, header: Request, parts: list[memoryview]) -> bool:
        """PUT, then EXIST on the same connection: True once the server has the key."""

        async def run(conn: _Conn) -> bool:
            conn.writer.write(encode_request(header))
            for part in parts:
                conn.writer.write(part)
            conn.writer.write(encode_request(Request(Command.EXIST, header.key)))
            await conn.writer.drain()
            return (await conn.reply()).code == Code.OK

        return await self._call(run)

    async def exists(self, key: str) -> bool:
        wkey = wire_key(key)

        async def run(conn: _Conn) -> bool:
            conn.writer.write(encode_request(Request(Command.EXIST, wkey)))
            return (await conn.reply()).code == Code.OK

        if not await self._call(run):
            return False
        return bool(self._kvgate_server) or await self.get(key) is not None

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """The protocol has no batch EXIST, but a connection answers its requests in order:
        every EXIST goes out on one connection at once, then their replies are read (one
        round trip rather than one per key). The stock server's positives are then read
        back, ``batch_concurrency`` at a time, to tell tombstones from data (``exists``)."""
        if not keys:
            return []
        requests = b"".join(encode_request(Request(Command.EXIST, wire_key(k))) for k in keys)

        async def run(conn: _Conn) -> list[bool]:
            conn.writer.write(requests)  # replies are read while the transport sends
            raw = await conn.reader.readexactly(REPLY.size * len(keys))
            try:
                replies = [parse_reply(r) for r in _slices(raw, REPLY.size)]
            except WireError as exc:
                raise Unavailable(f"lm:// server sent a bad reply header: {exc}") from None
            return [r.code == Code.OK for r in replies]

        flags = await self._call(run)
        if self._kvgate_server:
            return flags
        found = [i for i, flag in enumerate(flags) if flag]
        data = await self._each(len(found), lambda j: self.get(keys[found[j]]))
        for i, got in zip(found, data, strict=True):
            flags[i] = got is not None
        return flags

    async def delete(self, key: str) -> bool:
        if not await self.exists(key):
            return False
        tomb = Request(Command.PUT, wire_key(key), 0, Format.UNDEFINED, 0, TOMBSTONE_SHAPE)
        await self._send(tomb, [])
        return True

    async def ping(self) -> bool:
        async def run(conn: _Conn) -> bool:
            conn.writer.write(encode_request(Request(Command.HEALTH, PING_KEY)))
            return (await conn.reply()).code == Code.OK

        return await self._call(run)

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
            with contextlib.suppress(Exception):
                await conn.writer.wait_closed()
