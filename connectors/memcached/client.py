"""A small client for memcached's text protocol, over connections this module owns.

Why not aiomcache's ``Client`` (it serves the raw baseline, ``baseline.py``): its ``acquire``
wrapper marks a connection broken only on ``Exception``, and ``CancelledError`` is not one, so
a call cancelled by a timeout puts its connection back in the pool with the reply still
unread (aio-libs/aiomcache#489, open). The next command on it reads the old reply: on
memcached 1.6.18 a ``delete`` after a timed-out ``set`` read that set's ``STORED``. A ``cas``
reading a stale ``STORED`` would report a commit that never happened. Its values must also be
``bytes`` (a memoryview part costs a copy, the command another, each read two more).

So this module speaks the few commands the connector needs itself:

- each connection is an ``asyncio.BufferedProtocol``. Reply lines are parsed from a small
  buffer; a value is received straight into its destination (``get_buffer`` hands the kernel
  the caller's memory). Values are written from the caller's memory in 1 MiB slices under
  flow control, so the transport never copies a whole part;
- a connection is checked out for one command sequence and goes back to the pool only if the
  sequence finished; on any exception, cancellation included, it is aborted first, so no
  reply is ever read by another command and nothing is written into a caller's buffer after
  the call is over;
- batches of parts are pipelined: a connection sends all its commands, then reads the
  replies in order. Each batch runs under a deadline of ``timeout`` (``gateway.deadlines``),
  re-armed by every reply and every flushed slice: the timeout bounds time without progress,
  so a long batch of large parts is not cut off, and a server that stops answering is;
- replies are parsed strictly. A ``VALUE`` of another key or length than asked for, a bad
  line, or a connection that ends mid-reply (a truncated reply, a server that vanished) is an
  error and the connection is dropped; the caller's buffer then holds garbage and the
  caller does not use it;
- errors map to kvgate's kinds in one place, ``MemcachedClient._mapped``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, Literal, TypeVar

from gateway.connector import Allocator, read_limit
from gateway.deadlines import Deadlines
from gateway.errors import CapacityError, GatewayError, Timeout, Unavailable
from gateway.parts import ValueOverReadLimit, bounded_all
from gateway.transport import stream_transport
from gateway.types import Buffer

T = TypeVar("T")
Store = Literal[b"set", b"add", b"cas"]
DeleteOutcome = Literal["deleted", "changed", "missing"]

_RECV_BUFFER = 256 * 1024
_MAX_LINE = 8 * 1024
_WRITE_SLICE = 1 << 20
_JOIN_BELOW = 16 * 1024  # smaller pieces of commands are joined: one write, one packet
_PARTS_PER_TRIP = 16  # values one connection asks for per round trip when reading parts
_HIGH_WATER, _LOW_WATER = 256 << 10, 64 << 10
_CRLF = b"\r\n"
_STORE_REPLIES = {b"STORED": True, b"NOT_STORED": False, b"EXISTS": False, b"NOT_FOUND": False}


class ConnectionClosed(ConnectionError):
    """The server closed the connection (or it was aborted) before the reply was whole."""


class ProtocolError(Exception):
    """A reply this client does not expect: the connection is out of step, so it is dropped."""


class ServerError(Exception):
    """A ``SERVER_ERROR``, ``CLIENT_ERROR`` or ``ERROR`` reply (the text is the message)."""


class Connection(asyncio.BufferedProtocol):
    """One connection: ``write`` commands, then ``readline``/``readinto`` their replies."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray(_RECV_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0  # unread bytes are _buf[_start:_end]
        self._end = 0
        self._into: memoryview | None = None  # the rest of a value being received in place
        self._waiter: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None  # set while writing is paused
        self._reading_paused = False
        self.lost: BaseException | None = None

    # -- asyncio callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = stream_transport(transport)
        transport.set_write_buffer_limits(high=_HIGH_WATER, low=_LOW_WATER)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._into is not None:
            return self._into  # the kernel writes the value where it belongs
        if self._end == len(self._buf):
            self._compact()
            if self._end == len(self._buf):  # not expected (reading pauses first): grow
                self._buf.extend(bytes(len(self._buf)))
                self._view = memoryview(self._buf)
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._into is not None:
            self._into = self._into[nbytes:]
            if self._into.nbytes == 0:
                self._into = None
                self._wake()
            return
        self._end += nbytes
        if self._end == len(self._buf) and self._start == 0 and self.transport is not None:
            # Full of unread replies: wait for the reader instead of growing without bound.
            self.transport.pause_reading()
            self._reading_paused = True
        self._wake()

    def eof_received(self) -> bool | None:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        # _into stays set: readinto must see that its value never came whole.
        self.lost = exc or ConnectionClosed("the server closed the connection")
        self._wake()
        self.resume_writing()

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    # -- reading --------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        """Until more bytes arrived (or the connection is gone: then raise)."""
        if self.lost is not None:
            raise ConnectionClosed(f"connection lost mid-reply: {self.lost}")
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _compact(self) -> None:
        if self._start:
            pending = self._end - self._start
            self._buf[:pending] = self._view[self._start : self._end]
            self._start, self._end = 0, pending

    def _consumed(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        if self._reading_paused and self.transport is not None:
            self._compact()
            self._reading_paused = False
            self.transport.resume_reading()

    async def readline(self) -> bytes:
        """The next reply line, without its CRLF."""
        while True:
            end = self._buf.find(_CRLF, self._start, self._end)
            if end >= 0:
                line = bytes(self._view[self._start : end])
                self._start = end + 2
                self._consumed()
                return line
            if self._end - self._start > _MAX_LINE:
                raise ProtocolError("a reply line without an end")
            await self._wait()

    async def readinto(self, dst: memoryview) -> None:
        """Fill ``dst`` with the next ``dst.nbytes`` bytes of the reply."""
        have = min(self._end - self._start, dst.nbytes)
        if have:
            dst[:have] = self._view[self._start : self._start + have]
            self._start += have
            self._consumed()
        if have == dst.nbytes:
            return
        # The buffer is empty now: the rest goes straight from the socket into dst.
        self._into = dst[have:]
        self._consumed()  # resume reading if it was paused
        while self._into is not None:
            await self._wait()

    async def read_value(self, dst: memoryview) -> None:
        """A value's data block into ``dst``, then its CRLF."""
        await self.readinto(dst)
        trailer = bytearray(2)
        await self.readinto(memoryview(trailer))
        if trailer != _CRLF:
            raise ProtocolError("a value not ended by CRLF")

    # -- writing --------------------------------------------------------------------------

    async def write(self, chunks: Sequence[Buffer], progress: Progress) -> None:
        """Send ``chunks``: runs of small ones joined into one write (one packet, not one per
        piece of a command), large ones in slices, waiting for the socket between them."""
        small: list[Buffer] = []
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            if view.nbytes < _JOIN_BELOW:
                small.append(view)
                continue
            if small:
                await self._send(b"".join(small), progress)
                small = []
            for start in range(0, view.nbytes, _WRITE_SLICE):
                await self._send(view[start : start + _WRITE_SLICE], progress)
        if small:
            await self._send(b"".join(small), progress)

    async def _send(self, data: Buffer, progress: Progress) -> None:
        if self.lost is not None:
            raise ConnectionClosed(f"connection lost while writing: {self.lost}")
        assert self.transport is not None
        self.transport.write(data)
        if self._writable is not None:
            await self._writable
            progress()

    @property
    def usable(self) -> bool:
        """Open and between replies (nothing unread): a new command may start."""
        return (
            self.lost is None
            and self.transport is not None
            and self._into is None
            and self._start == self._end
        )

    def abort(self) -> None:
        """Close at once; nothing is written into a caller's buffer after this."""
        self._into = None
        if self.lost is None:
            self.lost = ConnectionClosed("aborted")
        if self.transport is not None:
            self.transport.abort()


Progress = Callable[[], None]
"""Re-arms a batch's deadline: the timeout bounds time without a reply, not batch length."""


def _check_reply(line: bytes) -> bytes:
    """``line``, unless it is an error reply: then raise it."""
    if line.startswith((b"SERVER_ERROR", b"CLIENT_ERROR")) or line == b"ERROR":
        raise ServerError(line.decode(errors="replace"))
    return line


def _value_header(line: bytes, key: bytes, with_cas: bool) -> tuple[int, int]:
    """(length, cas) of a ``VALUE <key> <flags> <bytes> [<cas>]`` line for ``key``."""
    fields = line.split()
    if len(fields) != (5 if with_cas else 4) or fields[0] != b"VALUE" or fields[1] != key:
        raise ProtocolError(f"expected the VALUE of {key!r}, got {line[:80]!r}")
    try:
        length, cas = int(fields[3]), int(fields[4]) if with_cas else 0
    except ValueError:
        raise ProtocolError(f"bad VALUE line {line[:80]!r}") from None
    if length < 0:
        raise ProtocolError(f"bad VALUE length in {line[:80]!r}")
    return length, cas


def store_command(
    verb: Store, key: bytes, value: Sequence[Buffer], exptime: int, cas: int = 0
) -> list[Buffer]:
    """``<verb> <key> 0 <exptime> <bytes> [<cas>]`` and the value, as a scatter list."""
    size = sum(memoryview(v).nbytes for v in value)
    tail = b" %d\r\n" % cas if verb == b"cas" else _CRLF
    return [b"%s %s 0 %d %d%s" % (verb, key, exptime, size, tail), *value, _CRLF]


async def _first_error(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coros`` concurrently; on a failure cancel the rest and raise that failure."""
    if len(coros) == 1:
        return [await coros[0]]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coros]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [t.result() for t in tasks]


def _stripes(n: int, ways: int) -> list[range]:
    """``range(n)`` cut into at most ``ways`` contiguous, non-empty, near-equal ranges."""
    ways = max(1, min(ways, n))
    bounds = [n * i // ways for i in range(ways + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(ways)]


class MemcachedClient:
    """The commands the connector needs, over a pool of at most ``pool_size`` connections."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        name: str,
        pool_size: int,
        stripes: int,
        timeout: float,
        connect_timeout: float,
    ) -> None:
        self.host = host
        self.port = port
        self.name = name  # how errors name the server (a URL without secrets)
        self.stripes = stripes
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._deadlines = Deadlines(timeout)  # one timer for every command's deadline
        self._slots = asyncio.Semaphore(pool_size)
        self._idle: list[Connection] = []
        self._closed = False

    # -- connections and errors -----------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _session(self, what: str) -> AsyncIterator[tuple[Connection, Progress]]:
        """A connection for one command sequence, its deadline, and errors mapped."""
        with self._mapped(what):
            async with self._slots:  # waiting for a free connection is not the server's time
                if self._closed:
                    raise GatewayError(f"{self.name}: the connector is closed")
                conn = self._idle_connection() or await self._connect()
                try:
                    with self._deadlines.start() as deadline:
                        yield conn, deadline.extend
                except BaseException:
                    conn.abort()  # mid-sequence: its replies must never reach another command
                    raise
                if conn.usable and not self._closed:
                    self._idle.append(conn)
                else:
                    conn.abort()

    @contextlib.contextmanager
    def _mapped(self, what: str) -> Iterator[None]:
        """The one place where failures become kvgate's error kinds."""
        try:
            yield
        except GatewayError:
            raise
        except TimeoutError as exc:  # before OSError, of which it is a subclass
            raise Timeout(f"{self.name}: {what}: no reply within {self.timeout:g} s") from exc
        except ServerError as exc:
            message = str(exc)
            lowered = message.lower()
            if "too large" in lowered:  # an item over the server's -I: parts are item_limit
                raise CapacityError(
                    f"{self.name}: {what}: {message} (is the tier's item_limit over the "
                    "server's -I item size?)"
                ) from exc
            if "out of memory" in lowered:
                raise CapacityError(f"{self.name}: {what}: {message}") from exc
            raise GatewayError(f"{self.name}: {what}: the server replied {message!r}") from exc
        except ProtocolError as exc:
            raise GatewayError(f"{self.name}: {what}: protocol error: {exc}") from exc
        except OSError as exc:  # refused, reset, closed mid-reply, unreachable
            raise Unavailable(f"{self.name}: {what}: {exc or type(exc).__name__}") from exc

    def _idle_connection(self) -> Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if conn.usable:
                return conn
            conn.abort()  # closed by the server while idle
        return None

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(Connection, self.host, self.port)
        except TimeoutError:
            raise Timeout(f"{self.name}: no connection within {self.connect_timeout:g} s") from None
        return conn

    async def close(self) -> None:
        """Close idle connections; ones in use close when their command ends. Idempotent."""
        self._closed = True
        while self._idle:
            self._idle.pop().abort()

    # -- single commands ------------------------------------------------------------------

    async def version(self) -> str:
        async with self._session("version") as (conn, progress):
            await conn.write([b"version\r\n"], progress)
            line = _check_reply(await conn.readline())
        if not line.startswith(b"VERSION "):
            raise GatewayError(f"{self.name}: unexpected reply to version: {line[:80]!r}")
        return line[8:].decode(errors="replace")

    async def get(self, key: bytes, *, with_cas: bool = False) -> tuple[bytearray, int] | None:
        """The value of ``key`` in a new buffer and its CAS (0 unless ``with_cas``), or None."""
        verb = b"gets" if with_cas else b"get"
        async with self._session(f"{verb.decode()} {key!r}") as (conn, progress):
            await conn.write([b"%s %s\r\n" % (verb, key)], progress)
            line = _check_reply(await conn.readline())
            if line == b"END":
                return None
            length, cas = _value_header(line, key, with_cas)
            value = bytearray(length)
            await conn.read_value(memoryview(value))
            if await conn.readline() != b"END":
                raise ProtocolError(f"more than one value for {key!r}")
        return value, cas

    async def get_into_after(
        self, key: bytes, prefix: bytes, alloc: Allocator
    ) -> tuple[bool, memoryview] | None:
        """The value of ``key``, or None. If it starts with ``prefix``: (True, the rest), read
        straight into ``alloc(size of the rest)`` (a new buffer if alloc gives none);
        otherwise (False, the whole value) in a new buffer, and ``alloc`` is not called."""
        async with self._session(f"get {key!r}") as (conn, progress):
            await conn.write([b"get %s\r\n" % key], progress)
            line = _check_reply(await conn.readline())
            if line == b"END":
                return None
            length, _ = _value_header(line, key, with_cas=False)
            limit = read_limit()
            if limit is not None and length > limit:  # the value is not read: the session
                raise ValueOverReadLimit(  # ends, and its connection with it
                    f"{self.name}: {key!r} holds {length} bytes, over the {limit} a reader takes"
                )
            head = memoryview(bytearray(min(len(prefix), length)))
            await conn.readinto(head)
            if head == prefix:
                given = alloc(length - len(prefix))
                dst = memoryview(bytearray(length - len(prefix))) if given is None else given
                await conn.read_value(dst)
                found = (True, dst)
            else:
                whole = memoryview(bytearray(length))
                whole[: head.nbytes] = head
                await conn.read_value(whole[head.nbytes :])
                found = (False, whole)
            if await conn.readline() != b"END":
                raise ProtocolError(f"more than one value for {key!r}")
        return found

    async def store(
        self, verb: Store, key: bytes, value: Sequence[Buffer], exptime: int, cas: int = 0
    ) -> bool:
        """``set``/``add``/``cas``: True if stored; False if ``add`` found the key, or ``cas``
        found it changed or gone."""
        async with self._session(f"{verb.decode()} {key!r}") as (conn, progress):
            await conn.write(store_command(verb, key, value, exptime, cas), progress)
            line = _check_reply(await conn.readline())
        stored = _STORE_REPLIES.get(line)
        if stored is None:
            raise GatewayError(f"{self.name}: unexpected reply to {verb!r}: {line[:80]!r}")
        return stored

    async def cas_and_size(self, key: bytes) -> tuple[int, int] | None:
        """(CAS, value length) of ``key`` without its value (meta ``mg <key> c s``), or None."""
        async with self._session(f"mg {key!r}") as (conn, progress):
            await conn.write([b"mg %s c s\r\n" % key], progress)
            line = _check_reply(await conn.readline())
        if line == b"EN":
            return None
        fields = line.split()
        flags = {f[:1]: f[1:] for f in fields[1:]}
        try:
            if fields[0] != b"HD":
                raise ValueError
            return int(flags[b"c"]), int(flags[b"s"])
        except (ValueError, KeyError, IndexError):
            raise GatewayError(f"{self.name}: unexpected reply to mg: {line[:80]!r}") from None

    async def delete_if(self, key: bytes, cas: int) -> DeleteOutcome:
        """Delete ``key`` only if its CAS is still ``cas`` (meta ``md <key> C<cas>``)."""
        async with self._session(f"delete {key!r}") as (conn, progress):
            await conn.write([b"md %s C%d\r\n" % (key, cas)], progress)
            line = _check_reply(await conn.readline())
        outcome: dict[bytes, DeleteOutcome] = {b"HD": "deleted", b"EX": "changed", b"NF": "missing"}
        found = outcome.get(line.split(b" ", 1)[0])
        if found is None:
            raise GatewayError(f"{self.name}: unexpected reply to md: {line[:80]!r}")
        return found

    # -- pipelined batches, spread over up to ``stripes`` connections ---------------------

    async def _pipelined(
        self, what: str, commands: Sequence[Sequence[Buffer]], expect: dict[bytes, T]
    ) -> list[T]:
        """Send ``commands`` on one connection, then read one status line per command."""
        async with self._session(what) as (conn, progress):
            # As one write: runs of small chunks across commands leave in one send, not one
            # send per command (1024 ``mg`` took 25 ms as 1024 sends; aiomcache's one
            # ``get k1 .. kN`` line took 10).
            await conn.write([chunk for command in commands for chunk in command], progress)
            replies = []
            for _ in commands:
                line = _check_reply(await conn.readline())
                progress()
                if line not in expect:
                    raise ProtocolError(f"unexpected reply to {what}: {line[:80]!r}")
                replies.append(expect[line])
        return replies

    async def _striped(
        self, what: str, commands: Sequence[Sequence[Buffer]], expect: dict[bytes, T]
    ) -> list[T]:
        if not commands:
            return []
        stripes = _stripes(len(commands), self.stripes)
        results = await _first_error(
            [self._pipelined(what, [commands[i] for i in s], expect) for s in stripes]
        )
        return [r for stripe in results for r in stripe]

    async def set_many(self, items: Sequence[tuple[bytes, Buffer]], exptime: int) -> None:
        """``set`` every (key, value); raises if any is not stored."""
        commands = [store_command(b"set", key, [value], exptime) for key, value in items]
        stored = await self._striped("set part", commands, _STORE_REPLIES)
        if not all(stored):
            raise GatewayError(f"{self.name}: a part was not stored")

    async def touch_many(self, keys: Sequence[bytes], exptime: int) -> None:
        """Give every existing key in ``keys`` this exptime (absent ones are fine)."""
        commands = [[b"touch %s %d\r\n" % (key, exptime)] for key in keys]
        await self._pipelined_small("touch", commands, {b"TOUCHED": True, b"NOT_FOUND": False})

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        commands = [[b"delete %s\r\n" % key] for key in keys]
        await self._pipelined_small("delete", commands, {b"DELETED": True, b"NOT_FOUND": False})

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is present (meta ``mg <key>``: no value is sent back)."""
        commands = [[b"mg %s\r\n" % key] for key in keys]
        return await self._pipelined_small("exists", commands, {b"HD": True, b"EN": False})

    async def _pipelined_small(
        self, what: str, commands: Sequence[Sequence[Buffer]], expect: dict[bytes, T]
    ) -> list[T]:
        # Tiny commands: one connection does them all in one round trip.
        return await self._pipelined(what, commands, expect) if commands else []

    async def get_many_into(self, keys: Sequence[bytes], dsts: Sequence[memoryview]) -> bool:
        """Fill ``dsts[i]`` with the value of ``keys[i]``; False if any is missing or has
        another length (the destinations then hold garbage).

        Up to ``stripes`` connections at once, each asking for the next run of up to
        ``_PARTS_PER_TRIP`` values in one pipelined round trip; a missing value ends the read
        after the runs in flight. (``keys`` and ``dsts`` may make their items when indexed:
        only a run's worth exists at a time.)
        """

        def run(i: int) -> Awaitable[bool]:
            span = range(i * _PARTS_PER_TRIP, min(len(keys), (i + 1) * _PARTS_PER_TRIP))
            return self._get_stripe([keys[j] for j in span], [dsts[j] for j in span])

        return await bounded_all(-(-len(keys) // _PARTS_PER_TRIP), self.stripes, run)

    async def _get_stripe(self, keys: Sequence[bytes], dsts: Sequence[memoryview]) -> bool:
        async with self._session("get part") as (conn, progress):
            await conn.write([b"".join(b"get %s\r\n" % key for key in keys)], progress)
            whole = True
            for key, dst in zip(keys, dsts, strict=True):
                line = _check_reply(await conn.readline())
                if line == b"END":
                    whole = False
                    continue
                length, _ = _value_header(line, key, with_cas=False)
                if length == dst.nbytes:
                    await conn.read_value(dst)
                else:  # stays in step: the value is read and dropped
                    whole = False
                    await conn.read_value(memoryview(bytearray(length)))
                if await conn.readline() != b"END":
                    raise ProtocolError(f"more than one value for {key!r}")
                progress()
        return whole
