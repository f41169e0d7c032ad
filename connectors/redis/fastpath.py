"""The fast path: parts and commits on connections of our own, with no copies of the payload.

redis-py with hiredis parses a reply into a new ``bytes`` object, which the connector then
copies into the caller's buffer; and on Python 3.11 its writes join each command into one new
``bytes`` before the socket sees it. For values of several MiB that caps a striped get near
1 GB/s and a put near 1.3 GB/s on loopback. The fast path moves the bulk data itself, over
``asyncio.BufferedProtocol`` connections:

- ``GET part``: the reply is received straight into the destination slice (``get_buffer``
  hands the kernel the caller's memory): one copy, socket -> slab;
- ``SET part value PX ms`` and the commit transaction: values (memoryviews of the caller's
  data) are written in 1 MiB slices under flow control, so the transport never joins or
  buffers a whole part.

Two kinds of request:

- ``INTO``: one bulk reply of exactly ``len(dst)`` bytes, received into ``dst``. ``$-1`` is a
  miss; a bulk of another length is ``WRONG_SIZE`` and the connection is closed (its body is
  not drained);
- ``get_object``: ``GET`` of a main key: a value of at most ``small_max`` bytes (a manifest)
  comes back whole; a longer one must start with the inline tag byte, and the object after it
  is received straight into a buffer from the caller's allocator;
- ``replies(n)``: ``n`` small replies (status, integer, error, short bulk, array of those),
  parsed whole and returned as Python values; error replies come back as the redis-py
  exception objects redis-py would raise for them (not raised: the caller sees every reply of a
  ``MULTI`` block, so the connection stays in step).

For both, a ``-MOVED``/``-ASK`` error (a cluster slot moved) makes the call return ``MOVED``, and
the caller asks redis-py, which follows the redirection and refreshes its slot map. Anything
that is not valid RESP, or bytes no request asked for, is a protocol error and closes the
connection; no whole reply within ``socket_timeout`` is ``Timeout`` and closes it; a dropped
connection is ``Unavailable``.

A request that ends early (timeout, cancellation, error) aborts its transport before it returns,
and the protocol forgets the destination, so nothing is written into the caller's buffer after
the call is over.

Connections log in as redis-py's do (``AUTH [user] password``, ``SELECT db``), to the endpoint
``RedisClient.endpoint_for`` names, over the same TLS context. At most ``per_node`` are open
per server node; idle ones are reused and dropped when the server closes them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from redis._parsers import BaseParser
from redis.exceptions import AskError, ReadOnlyError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from connectors.fanout import run_all
from connectors.redis.client import Endpoint, RedisClient
from connectors.redis.resp import Incomplete, ProtocolError, command, parse_reply, set_command
from gateway.connector import read_limit
from gateway.deadlines import Deadlines
from gateway.transport import stream_transport
from gateway.types import Buffer

_SCRATCH = 1024  # reply lines and small replies: `$N\r\n` plus whatever came with it
_MAX_SMALL_REPLY = 64 * 1024
_WRITE_SLICE = 1 << 20
_COALESCE = 64 << 10  # pieces of a request under this are joined before they are written
# Flow control: pause after 256 KiB queued in the transport, resume under 64 KiB. Writing in
# slices against these marks keeps the transport from copying a whole part into its buffer.
_HIGH_WATER, _LOW_WATER = 256 << 10, 64 << 10
_IDLE, _HEAD, _BODY, _TRAILER, _REPLIES, _TAG, _DEAD, _LINES = range(8)
_CRLF = b"\r\n"
# One-line replies (lines()): how long one may be, and the common ones decoded by a dict lookup
# rather than by parse_reply (a pipelined EXISTS of 4096 keys is 4096 replies).
_MAX_LINE = 512
_LINES_READ = 64 * 1024
_COMMON_LINES: dict[bytes, object] = {b":0": 0, b":1": 1, b"+OK": b"OK"}

HIT: Final = "hit"
MISS: Final = "miss"
WRONG_SIZE: Final = "wrong size"
MOVED: Final = "moved"
FOREIGN: Final = "foreign"  # a value longer than small_max whose first byte is not the tag
TOO_LARGE: Final = "too large"  # an inline value over the reader's read_limit()
Allocator = Callable[[int], memoryview | None]
_EXISTS = b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%s\r\n"


# Failures after which a node may no longer be the one to talk to (OSError: refused, reset).
_TOPOLOGY_ERRORS = (RedisConnectionError, RedisTimeoutError, ReadOnlyError)


def _one_line(line: bytes) -> object:
    """A one-line reply that ``_COMMON_LINES`` does not hold: integer, status or error."""
    if line[:1] == b"-":
        return BaseParser.parse_error(line[1:].decode(errors="replace"))  # type: ignore[no-untyped-call]
    if line[:1] == b":":
        try:
            return int(line[1:])
        except ValueError:
            raise ProtocolError(f"bad integer reply {line[:40]!r}") from None
    if line[:1] == b"+":
        return line[1:]
    raise ProtocolError(f"expected a one-line reply, got {line[:40]!r}")


class FastConnection(asyncio.BufferedProtocol):
    """One connection: ``get_into`` and ``call`` send a command and take its reply."""

    def __init__(self, name: str, timeout: float) -> None:
        self.name = name
        self.timeout = timeout  # seconds for a whole request: writing it and its reply
        self._deadlines = Deadlines(timeout)  # one timer, not one per request
        self.transport: asyncio.Transport | None = None
        self.usable = False
        self._scratch = bytearray(_SCRATCH)
        self._head = bytearray()  # bytes of a reply line or of small replies
        self._state = _IDLE
        self._dst: memoryview | None = None
        self._filled = 0
        self._trailer = 0
        self._count = 0  # small replies expected
        self._lines_seen = 0  # lines(): CRLFs counted so far in _head
        self._lines_buffer: bytearray | None = None  # lines(): what replies are read into
        self._alloc: Allocator | None = None  # get_object: where an inline object goes
        self._tag = 0  # get_object: the first byte an inline object starts with
        self._small_max = 0  # get_object: values up to this long come back whole
        self._limit: int | None = None  # get_object: the reader's read_limit()
        self._length = 0  # get_object: the value's length
        self._result: object = HIT  # what a completed bulk reply resolves to
        self._waiter: asyncio.Future[object] | None = None
        self._writable: asyncio.Future[None] | None = None  # set while paused

    # -- asyncio callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = stream_transport(transport)
        transport.set_write_buffer_limits(high=_HIGH_WATER, low=_LOW_WATER)
        self.usable = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.usable = False
        why = f": {exc}" if exc else ""
        self._fail(RedisConnectionError(f"connection to {self.name} lost{why}"))
        self._state = _DEAD
        self._dst = None
        self.resume_writing()  # a writer waiting for room finds the connection gone

    def eof_received(self) -> bool | None:
        return False  # close our side too; connection_lost follows

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._state == _LINES:  # many small replies: take them in large reads
            if self._lines_buffer is None:
                self._lines_buffer = bytearray(_LINES_READ)
            return memoryview(self._lines_buffer)
        if self._state == _BODY and self._dst is not None:
            return self._dst[self._filled :]
        if self._state == _TRAILER:
            return memoryview(self._scratch)[: self._trailer]
        if self._state == _TAG:  # one byte, so that the object itself lands in its buffer
            return memoryview(self._scratch)[:1]
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        if self._state == _BODY and self._dst is not None:
            self._filled += nbytes  # the kernel wrote straight into the destination
            if self._filled == self._dst.nbytes:
                self._state, self._trailer = _TRAILER, 2
            return
        if self._state == _LINES and self._lines_buffer is not None:
            self._parse_lines(memoryview(self._lines_buffer)[:nbytes])
            return
        self._feed(memoryview(self._scratch)[:nbytes])

    # -- parsing --------------------------------------------------------------------------

    def _feed(self, data: memoryview) -> None:
        while data.nbytes:
            if self._state == _REPLIES:
                self._head += data
                self._parse_replies()
                return
            if self._state == _LINES:
                self._parse_lines(data)
                return
            if self._state == _HEAD:
                self._head += data
                end = self._head.find(_CRLF)
                if end < 0:
                    if len(self._head) > _MAX_SMALL_REPLY:
                        self._violation("a reply line without an end")
                    return
                line = bytes(self._head[:end])
                data = memoryview(bytes(self._head[end + 2 :]))
                self._head.clear()
                self._on_line(line)
            elif self._state == _BODY and self._dst is not None:
                n = min(data.nbytes, self._dst.nbytes - self._filled)
                self._dst[self._filled : self._filled + n] = data[:n]
                self._filled += n
                data = data[n:]
                if self._filled == self._dst.nbytes:
                    self._state, self._trailer = _TRAILER, 2
            elif self._state == _TRAILER:
                n = min(data.nbytes, self._trailer)
                if data[:n] != _CRLF[2 - self._trailer : 2 - self._trailer + n]:
                    self._violation("a bulk reply not ended by CRLF")
                    return
                self._trailer -= n
                data = data[n:]
                if self._trailer == 0:
                    self._done(self._result)
            elif self._state == _TAG:
                tag, data = data[0], data[1:]
                self._on_tag(tag)
            elif self._state == _DEAD:
                return  # aborted: whatever still arrives is dropped
            else:
                self._violation("bytes that no request asked for")
                return

    def _on_line(self, line: bytes) -> None:
        """The first line of an INTO reply."""
        kind, rest = line[:1], line[1:]
        if kind == b"-":  # a server error: the reply is complete, the connection fine
            error = BaseParser.parse_error(rest.decode(errors="replace"))  # type: ignore[no-untyped-call]
            self._state = _IDLE
            self._dst = self._alloc = None
            self._result = HIT
            self._fail(error)
            return
        if kind != b"$":
            self._violation(f"expected a bulk reply, got {line[:40]!r}")
            return
        try:
            length = int(rest)
        except ValueError:
            self._violation(f"bad bulk length {rest[:40]!r}")
            return
        if length == -1:
            self._done(MISS)
        elif self._alloc is not None:
            self._on_object_length(length)
        elif self._dst is None or length != self._dst.nbytes:
            self.usable = False  # the body is not drained: the connection must go
            self._state = _DEAD
            self._dst = None
            self._resolve(WRONG_SIZE)
        elif length == 0:
            self._state, self._trailer = _TRAILER, 2
        else:
            self._state = _BODY

    def _on_object_length(self, length: int) -> None:
        """get_object: a short value is read whole; a longer one is an inline object (its
        first byte the tag), read into a buffer from the allocator."""
        if length <= self._small_max:
            value = bytearray(length)
            self._dst, self._filled, self._result = memoryview(value), 0, ("small", value)
            self._state, self._trailer = (_BODY, 0) if length else (_TRAILER, 2)
        else:
            self._length = length
            self._state = _TAG

    def _on_tag(self, tag: int) -> None:
        if tag != self._tag:
            self.usable = False  # not an object of ours; its body is not drained
            self._state = _DEAD
            self._resolve(FOREIGN)
            return
        assert self._alloc is not None
        size = self._length - 1
        if self._limit is not None and size > self._limit:
            self.usable = False  # its body is not drained: the connection must go
            self._state = _DEAD
            self._resolve(TOO_LARGE)
            return
        try:
            given = self._alloc(size)
        except Exception as exc:  # the caller's allocator failed: the request fails with it
            self._fail(exc)
            self.abort()
            return
        dst = memoryview(bytearray(size)) if given is None else given
        if dst.nbytes != size:
            self._violation(f"the allocator gave {dst.nbytes} bytes for {size}")
            return
        self._dst, self._filled, self._result = dst, 0, ("inline", dst)
        self._state = _BODY

    def _parse_replies(self) -> None:
        replies: list[object] = []
        pos = 0
        try:
            while len(replies) < self._count:
                reply, pos = parse_reply(self._head, pos)
                replies.append(reply)
        except Incomplete:
            if len(self._head) > _MAX_SMALL_REPLY:
                self._violation("a reply too large for a small one")
            return
        except ProtocolError as exc:
            self._violation(str(exc))
            return
        if pos != len(self._head):
            self._violation("bytes after the replies asked for")
            return
        self._head.clear()
        self._done(replies)

    def _parse_lines(self, data: memoryview) -> None:
        """lines(): count CRLFs as bytes come (a CRLF split over two reads counts once,
        when its LF arrives); once ``_count`` lines are here, decode them all at once."""
        start = max(len(self._head) - 1, 0)
        self._head += data
        self._lines_seen += self._head.count(_CRLF, start)
        if self._lines_seen < self._count:
            if len(self._head) > (self._count + 1) * _MAX_LINE:
                self._violation("one-line replies longer than any such reply")
            return
        if self._lines_seen > self._count or not self._head.endswith(_CRLF):
            self._violation("bytes after the replies asked for")
            return
        lines = bytes(self._head).split(_CRLF)
        lines.pop()  # the empty string after the last CRLF
        common = _COMMON_LINES
        replies = [common.get(line, self) for line in lines]
        for i, reply in enumerate(replies):
            if reply is self:  # not a common one: an error, another integer or status
                try:
                    replies[i] = _one_line(lines[i])
                except ProtocolError as exc:
                    self._violation(str(exc))
                    return
        self._head.clear()
        self._done(replies)

    def _done(self, result: object) -> None:
        self._state = _IDLE
        self._dst = None
        self._alloc = None
        self._result = HIT
        self._resolve(result)

    def _resolve(self, result: object) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(result)

    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    def _violation(self, what: str) -> None:
        self._fail(RedisConnectionError(f"protocol error from {self.name}: {what}"))
        self.abort()

    # -- requests -------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """Between requests, in a known state (a new request may start)."""
        return self._state == _IDLE

    def abort(self) -> None:
        """Close at once; nothing is written into a destination after this."""
        self.usable = False
        self._state = _DEAD
        self._dst = None
        self._alloc = None
        if self.transport is not None:
            self.transport.abort()

    async def get_into(self, cmd: bytes, dst: memoryview) -> object:
        """Send ``cmd`` (a GET); its bulk reply goes into ``dst``: HIT, MISS or WRONG_SIZE.
        An error reply raises its redis-py exception."""
        self._dst, self._filled, self._alloc = dst, 0, None
        return await self._request([cmd], _HEAD)

    async def get_object(self, cmd: bytes, alloc: Allocator, tag: int, small_max: int) -> object:
        """Send ``cmd`` (a GET of a main key). Returns MISS; ``("small", value)`` for a value
        of at most ``small_max`` bytes; ``("inline", buffer)`` for a longer value starting
        with byte ``tag``, the rest received into ``alloc(length - 1)`` (or a new buffer);
        FOREIGN for a longer value that does not start with ``tag``; TOO_LARGE for an inline
        value over ``read_limit()`` (nothing allocated)."""
        self._alloc, self._tag, self._small_max = alloc, tag, small_max
        # Read here, in the reader's context: the protocol's callbacks run in the loop's.
        self._limit = read_limit()
        return await self._request([cmd], _HEAD)

    async def call(self, chunks: Sequence[Buffer], replies: int) -> list[object]:
        """Send the commands in ``chunks``; their ``replies`` replies, errors as values."""
        self._count = replies
        result = await self._request(chunks, _REPLIES)
        assert isinstance(result, list)
        return result

    async def lines(self, chunks: Sequence[Buffer], replies: int) -> list[object]:
        """Like ``call``, for commands whose replies are all one line (integer, status or
        error, not bulk or array): a pipeline of many small commands (EXISTS of many keys)
        parsed in one pass."""
        self._count, self._lines_seen = replies, 0
        result = await self._request(chunks, _LINES)
        assert isinstance(result, list)
        return result

    async def _request(self, chunks: Sequence[Buffer], state: int) -> object:
        if not self.usable or self.transport is None or self._state != _IDLE:
            raise RedisConnectionError(f"connection to {self.name} is not usable")
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        self._head.clear()
        self._state = state
        try:
            with self._deadlines.start():
                await self._write(chunks, waiter)
                return await waiter
        except TimeoutError:
            self.abort()
            raise RedisTimeoutError(
                f"no reply from {self.name} within {self.timeout:g} s"
            ) from None
        except BaseException:
            if not waiter.done() or self._state != _IDLE:
                self.abort()  # cancelled mid-request: stop touching the caller's buffers
            raise
        finally:
            self._waiter = None

    async def _write(self, chunks: Sequence[Buffer], waiter: asyncio.Future[object]) -> None:
        transport = self.transport
        assert transport is not None
        for chunk in coalesce(chunks):
            view = memoryview(chunk).cast("B")
            for start in range(0, view.nbytes, _WRITE_SLICE):
                if waiter.done():  # the server answered before the command was whole
                    self.abort()
                    return
                transport.write(view[start : start + _WRITE_SLICE])
                if self._writable is not None:
                    await self._writable
                if not self.usable:
                    return  # lost: the waiter has the error


def coalesce(chunks: Sequence[Buffer], small: int = _COALESCE) -> list[Buffer]:
    """``chunks`` with each run of small ones joined into one bytes object; large ones as
    they are (never copied).

    A put's commands are a dozen pieces (``MULTI``, ``GETRANGE``, ``STRLEN``, the ``SET``
    header, the tag byte, the frame head, the payload, the tail, ``EXEC``); the transport
    sends each write at once while its buffer is empty, so unjoined they cost a ``send``
    system call each, and the server a read each. Joined: the head, the payload, the tail.
    """
    out: list[Buffer] = []
    run: list[Buffer] = []
    for chunk in chunks:
        if memoryview(chunk).nbytes < small:
            run.append(chunk)
            continue
        if run:
            out.append(b"".join(run))
            run = []
        out.append(chunk)
    if run:
        out.append(b"".join(run))
    return out


class FastPath:
    """A small pool of ``FastConnection`` per server node, and the commands it runs."""

    def __init__(self, client: RedisClient, *, per_node: int) -> None:
        self.client = client
        self.per_node = per_node
        self.timeout = client.options.socket_timeout
        self.connect_timeout = client.options.socket_connect_timeout
        self._idle: dict[Endpoint, list[FastConnection]] = {}
        self._slots: dict[Endpoint, asyncio.Semaphore] = {}
        self._closed = False

    async def read_into(self, key: bytes, dst: memoryview) -> bool | None:
        """True: ``dst`` holds the value of ``key``; False: a miss or another length; None:
        the key's slot moved (ask redis-py)."""
        reply = await self._run(key, "get part", lambda c: c.get_into(command(b"GET", key), dst))
        return None if reply == MOVED else reply == HIT

    async def read_object(self, key: bytes, alloc: Allocator, tag: int, small_max: int) -> object:
        """``FastConnection.get_object`` of ``key``; None when the key's slot moved."""
        reply = await self._run(
            key, "get", lambda c: c.get_object(command(b"GET", key), alloc, tag, small_max)
        )
        return None if reply == MOVED else reply

    async def write(self, key: bytes, value: Sequence[memoryview], px: int | None) -> bool:
        """``SET key value [PX px]``; False: the key's slot moved (ask redis-py)."""
        reply = await self.call(key, "put part", set_command(key, value, px), 1)
        if reply is None:
            return False
        if isinstance(reply[0], Exception):
            raise self.client.error(reply[0], "put part")
        return True

    async def call(
        self, key: bytes, what: str, chunks: Sequence[Buffer], replies: int
    ) -> list[object] | None:
        """Commands on ``key``'s node; their replies (errors as values), or None when the
        key's slot moved (ask redis-py)."""
        result = await self._run(key, what, lambda c: c.call(chunks, replies))
        if result == MOVED:
            return None
        assert isinstance(result, list)
        for reply in result:
            if isinstance(reply, AskError):
                return None
            if isinstance(reply, ReadOnlyError):
                self.client.suspect(await self.client.endpoint_for(key))
        return result

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Whether each of ``keys`` exists: one ``EXISTS`` per key, each node's keys pipelined
        in one request, the nodes in parallel. None when a key's slot moved (ask redis-py)."""
        groups: dict[Endpoint, list[int]] = {}
        if self.client.cluster is None:
            groups[await self.client.endpoint_for(keys[0])] = list(range(len(keys)))
        else:
            for i, key in enumerate(keys):
                groups.setdefault(await self.client.endpoint_for(key), []).append(i)
        flags = [False] * len(keys)
        moved = False

        def ask(at: list[int]) -> Callable[[], Awaitable[None]]:
            async def one() -> None:
                nonlocal moved
                chunks = [b"".join([_EXISTS % (len(keys[i]), keys[i]) for i in at])]
                replies = await self._run(keys[at[0]], "exists", lambda c: c.lines(chunks, len(at)))
                if replies == MOVED:
                    moved = True
                    return
                assert isinstance(replies, list)
                for i, reply in zip(at, replies, strict=True):
                    if isinstance(reply, AskError):  # MOVED too: a slot moved
                        moved = True
                    elif isinstance(reply, Exception):
                        raise self.client.error(reply, "exists")
                    else:
                        flags[i] = reply == 1

            return one

        jobs = [ask(at) for at in groups.values()]
        await (jobs[0]() if len(jobs) == 1 else run_all(jobs))
        return None if moved else flags

    async def _run(
        self,
        key: bytes,
        what: str,
        request: Callable[[FastConnection], Awaitable[object]],
    ) -> object:
        endpoint = await self.client.endpoint_for(key)
        if self.client.cluster is None:
            self._forget_all_but(endpoint)  # a failover moved the master: drop the old one's
        slots = self._slots.get(endpoint)
        if slots is None:
            slots = self._slots[endpoint] = asyncio.Semaphore(self.per_node)
        async with slots:
            conn: FastConnection | None = None
            try:
                conn = self._idle_conn(endpoint) or await self._connect(endpoint)
                reply = await request(conn)
            except AskError:
                self._release(endpoint, conn)
                return MOVED  # MOVED or ASK: redis-py follows it, refreshing its slot map
            except (RedisError, OSError) as exc:
                self._release(endpoint, conn)
                if not isinstance(exc, RedisError) or isinstance(exc, _TOPOLOGY_ERRORS):
                    self.client.suspect(endpoint)  # the master may have moved: ask again
                raise self.client.error(exc, what) from exc
            except BaseException:
                if conn is not None:
                    conn.abort()
                raise
            self._release(endpoint, conn)
            return reply

    def _release(self, endpoint: Endpoint, conn: FastConnection | None) -> None:
        """Keep a connection that is between requests; close any other."""
        if conn is None:
            return
        if conn.usable and conn.idle and not self._closed:
            self._idle.setdefault(endpoint, []).append(conn)
        else:
            conn.abort()

    def _idle_conn(self, endpoint: Endpoint) -> FastConnection | None:
        idle = self._idle.get(endpoint)
        while idle:
            conn = idle.pop()
            if conn.usable:
                return conn
            conn.abort()  # closed by the server while idle
        return None

    async def _connect(self, endpoint: Endpoint) -> FastConnection:
        loop = asyncio.get_running_loop()
        factory: Callable[[], FastConnection] = lambda: FastConnection(  # noqa: E731
            str(endpoint), self.timeout
        )
        try:
            async with asyncio.timeout(self.connect_timeout):
                if endpoint.path is not None:
                    _, conn = await loop.create_unix_connection(factory, endpoint.path)
                else:
                    _, conn = await loop.create_connection(
                        factory,
                        endpoint.host,
                        endpoint.port,
                        ssl=self.client.ssl_context,
                        server_hostname=self.client.server_hostname(endpoint),
                    )
        except TimeoutError:
            raise RedisTimeoutError(
                f"connecting to {endpoint} took over {self.connect_timeout:g} s"
            ) from None
        try:
            await self._login(conn)
        except BaseException:
            conn.abort()
            raise
        return conn

    async def _login(self, conn: FastConnection) -> None:
        login = self.client.login
        commands = []
        if login.password is not None:
            user = [login.username.encode()] if login.username else []
            commands.append(command(b"AUTH", *user, login.password.encode()))
        if login.db:
            commands.append(command(b"SELECT", b"%d" % login.db))
        if not commands:
            # A server that wants a password answers NOAUTH here, before any data is sent:
            # a large value on an unauthenticated connection gets it reset instead, which
            # would read as "unavailable" rather than as the configuration error it is.
            commands.append(command(b"PING"))
        if commands:
            for reply in await conn.call(commands, len(commands)):
                if isinstance(reply, Exception):
                    raise reply

    def _forget_all_but(self, endpoint: Endpoint) -> None:
        for other in [e for e in self._idle if e != endpoint]:
            for conn in self._idle.pop(other):
                conn.abort()

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                with contextlib.suppress(Exception):
                    conn.abort()
        self._idle.clear()
