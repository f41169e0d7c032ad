"""LMCache's ``lm://`` protocol served on top of a Store, so LMCache can use kvgate unchanged.

``serve_lm(store, host, port)`` starts an asyncio server speaking the protocol byte for byte
(``gateway.lmcache.wire``). Objects land in the Store under the LMCache key string, so an HTTP GET
of the same key sees them:

- a PUT whose dtype code names a dtype and whose shape (trailing zeros stripped) holds exactly
  ``length`` bytes is stored as a tensor of that dtype and shape, with its memory format;
  anything else (no dtype, a shape that does not fit) as bytes. A GET answers with the stored
  format, dtype and shape; bytes, and tensors whose dtype or rank the wire cannot carry, go
  back as uint8 ``[length, 0, 0, 0]``. A kvgate tombstone PUT deletes the key.
- LIST is answered (200 with an empty list: kvgate does not enumerate its tiers over lm://);
  the stock server never answers it.
- A malformed or truncated header, an unknown command or a negative length closes that one
  connection; a key that is not an LMCache key string is a miss (GET, EXIST) or dropped (PUT,
  after reading its payload). Store failures are misses, never crashes.
- A PUT over ``max_payload`` is not stored, and the connection goes on: PUT has no reply to
  refuse it with, and closing would cut off a healthy client (LMCache's never reconnects;
  kvgate's connector would count an outage) over one object. Its payload is read and dropped
  as it arrives (into one small scratch buffer per server, never kept), at the pace every
  payload must keep (below), and the key's older object, if any, is deleted: the PUT replaced
  it, so the EXIST a client may send next answers "missing" and no reader takes the older
  object for the one refused. One log line per interval, not one per PUT.

What a client's numbers cannot do (the protocol has no authentication: see ``serve``):

- make the server allocate: a PUT's payload buffer is a mapping of untouched pages that become
  memory only as the bytes arrive, and the bytes received and not yet stored are charged, as
  they arrive, to one server-wide ``ArrivalBudget`` (``payload_budget``): past it a connection
  stops reading until stored payloads give bytes back. Declared lengths cost no new memory,
  real ones are bounded together; buffers kept between PUTs are bounded together too. A large
  tensor payload is received straight into the store's pool (the put keeps it: no copy), which
  is taken when its length is declared; what all payloads hold that way is bounded to an
  eighth of the pool (``StagingAllowance``), so a stalled declaration can make the memory tier
  evict at most that much, never the room other puts need;
- hold a connection: a request must never stall for ``request_timeout`` seconds and, after
  that long, must average ``min_rate`` bytes a second (so a trickle is closed long before its
  end); a reply must be taken as fast; past that the connection is closed;
- lock others out: ``max_connections`` bounds the connections, and a full server makes room
  for a new one by closing an idle one: first one that never sent a whole request (an idle
  flood's; the oldest first), then one idle between requests for ``RECLAIM_IDLE`` s, the most
  recently opened first (so long-lived engine connections go last); only when none is idle is
  the newcomer refused, with a log line.
  Idle connections are otherwise kept as long as they like (``idle_timeout`` None), because
  LMCache's client opens one connection when it starts and never reconnects: closing an idle
  engine's connection would cut it off for good.

Why a ``BufferedProtocol`` rather than stream readers: payloads are received straight into one
reused buffer per connection (no per-chunk allocation and copy), and GET replies are written
from the cache's memory on a duplicate of the socket, header and payload in one ``sendmsg``,
so the transport never copies a chunk. A client that goes away mid-reply costs its connection
only (no error logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.errors import GatewayError, InvalidKey
from gateway.host_memory import anonymous_memory
from gateway.keys import Key
from gateway.lmcache.arrival_budget import ArrivalBudget
from gateway.lmcache.wire import (
    CODE_OF_DTYPE,
    DTYPE_OF_CODE,
    FOUND,
    HEALTHY,
    INT32_MAX,
    MISS,
    REQUEST,
    Code,
    Command,
    Reply,
    Request,
    WireError,
    encode_reply,
    pad_shape,
    parse_request,
    strip_shape,
)
from gateway.log_limit import RepeatLimiter
from gateway.memory import Slab
from gateway.objects import HAS_TORCH, ITEMSIZE, ObjectMeta, torch_dtype
from gateway.staging_allowance import StagingAllowance
from gateway.store import Store
from gateway.transport import stream_transport

log = logging.getLogger("kvgate.lmserver")
T = TypeVar("T")
D = TypeVar("D")

KEEP_BUFFER = 64 << 20  # a connection keeps its receive buffer up to this size between PUTs
KEEP_TOTAL = 256 << 20  # ... and all connections together keep at most this much
MAP_FROM = 1 << 20  # payload buffers from this size on are mappings of untouched pages
MIN_READ = 64 << 10  # the smallest read of a payload near the budget's limit
DROP_READ = 256 << 10  # the scratch an oversized PUT's payload is read into and dropped
DIRECT_SEND = 256 << 10  # GET payloads from this size on are sent without the transport
STAGE_FROM = 256 << 10  # tensor payloads from this size on are received into the store's pool
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_REQUEST_TIMEOUT = 30.0  # seconds a request may take to arrive, from its first byte
MIN_RATE = 1 << 20  # bytes/s a payload, received or sent, must at least average
RECLAIM_IDLE = 0.5  # seconds idle after which a full server may close a connection
SWEEP_EVERY = 0.5  # seconds between checks of the connections' pace


async def serve_lm(
    store: Store,
    host: str,
    port: int,
    *,
    max_payload: int | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    idle_timeout: float | None = None,
    payload_budget: int | None = None,
    min_rate: int = MIN_RATE,
) -> asyncio.Server:
    """Start serving lm:// on ``host:port``; ``close_lm(server)`` stops it.

    ``max_payload``: the largest PUT (default and at most ``max_object_size``).
    ``request_timeout``: seconds a request may stall; after that long from its first byte it
    must also average ``min_rate`` bytes a second (a header: arrive whole); the same bounds
    taking a reply. ``idle_timeout``: close a
    connection idle (between requests) that long; None keeps it (see the module docstring).
    ``payload_budget``: bytes received and not yet stored, all connections together (default
    twice ``max_payload``); past it a connection stops reading until some are stored.
    """
    await store.open()
    limit = min(max_payload or store.config.max_object_size, INT32_MAX)
    budget = ArrivalBudget(payload_budget or 2 * limit)
    state = _Shared(store, limit, max_connections, request_timeout, idle_timeout, budget)
    state.min_rate = min_rate
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _LmProtocol(state), host, port)
    state.sweeper = loop.create_task(state.sweep(), name="kvgate-lm-sweeper")
    _SHARED[server] = state
    log.info("lm:// server on %s:%d", host, port)
    return server


class _Shared:
    """What every connection of one server shares."""

    def __init__(
        self,
        store: Store,
        max_payload: int,
        max_connections: int,
        request_timeout: float,
        idle_timeout: float | None,
        budget: ArrivalBudget,
    ) -> None:
        self.store = store
        self.max_payload = max_payload
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self.idle_timeout = idle_timeout
        self.budget = budget
        self.open: set[_LmProtocol] = set()
        self.min_rate = MIN_RATE
        self.kept = 0  # bytes of receive buffers connections keep between PUTs
        # Payloads being received into the store's pool, bounded (``StagingAllowance``).
        self.staging = StagingAllowance(store, budget.limit)
        # What oversized PUTs' payloads are read into: never read back, so all connections
        # share it (each read fills it and is dropped before the next one starts).
        self.scratch = memoryview(bytearray(DROP_READ))
        self.lines = RepeatLimiter()  # one line per kind of trouble, not one per connection
        self.sweeper: asyncio.Task[None] | None = None

    @property
    def connections(self) -> int:
        return len(self.open)

    def note(self, kind: str, message: str, *args: object) -> None:
        """A warning about ``kind``, at most one per RepeatLimiter interval (with a count)."""
        unlogged = self.lines.admit(kind)
        if unlogged is not None:
            more = f" ({unlogged} more since the last such line)" if unlogged else ""
            log.warning("lm:// " + message + more, *args)

    def admit(self) -> bool:
        """Room for one more connection: a full server closes an idle one to make it (see
        ``_LmProtocol.reclaim_rank`` for which); none idle, the newcomer is refused."""
        if len(self.open) < self.max_connections:
            return True
        now = asyncio.get_running_loop().time()
        ranked = [(rank, c) for c in self.open if (rank := c.reclaim_rank(now)) is not None]
        if not ranked:  # a client sending a payload, or being served, keeps its connection
            self.note(
                "refused",
                "server full (%d connections, none idle): a new connection was refused",
                len(self.open),
            )
            return False
        victim = min(ranked, key=lambda pair: pair[0])[1]
        self.note(
            "reclaimed",
            "server full (%d connections): closed one idle for %.1f s (%d requests served) "
            "to admit a new one",
            len(self.open),
            victim.idle_for(now),
            victim.served,
        )
        victim.close("reclaimed for a new connection")
        return True

    async def sweep(self) -> None:
        """Close connections whose request is overdue, or idle past ``idle_timeout``."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SWEEP_EVERY)
            now = loop.time()
            for conn in list(self.open):
                if conn.overdue(now):
                    self.note("overdue", "closed a connection whose request was overdue")
                    conn.close("request overdue")
                elif self.idle_timeout is not None and conn.idle_for(now) > self.idle_timeout:
                    conn.close("idle timeout")


_SHARED: weakref.WeakKeyDictionary[asyncio.Server, _Shared] = weakref.WeakKeyDictionary()


class _LmProtocol(asyncio.BufferedProtocol):
    """One client connection: read a header, then its payload, handle it, repeat."""

    def __init__(self, shared: _Shared) -> None:
        self.shared = shared
        self.transport: asyncio.Transport | None = None
        self.header = bytearray(REQUEST.size)
        self.buffer: memoryview = memoryview(b"")  # the payload buffer, reused across PUTs
        self.target = memoryview(self.header)  # what get_buffer fills now
        self.got = 0
        self.request: Request | None = None
        self.started: float | None = None  # when the request being received began arriving
        self.last_byte = 0.0  # when the latest bytes arrived
        self.served = 0  # requests handled on this connection
        self.parked_at: float | None = None  # reading stopped by the payload budget, since
        self.handling = False  # a request is being handled (reading is paused meanwhile)
        self.idle_since = self.opened_at = asyncio.get_running_loop().time()
        self.task: asyncio.Task[None] | None = None
        self.direct: socket.socket | None = None
        self.can_write: asyncio.Event = asyncio.Event()
        self.can_write.set()
        self._kept = False  # the buffer counts in the server's kept bytes
        self.staged: Slab | None = None  # the store's memory this PUT's payload goes into
        self.dropping: Request | None = None  # a PUT over max_payload whose payload arrives

    # -- transport callbacks --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = stream_transport(transport)
        # Pause as soon as anything is buffered, so that can_write means "buffer empty".
        transport.set_write_buffer_limits(high=0)
        if not self.shared.admit():
            transport.close()
            return
        self.shared.open.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.shared.open.discard(self)
        self.can_write.set()  # a writer waiting for room finds the transport closing
        if self.task is not None:
            self.task.cancel()
        if self.direct is not None:
            self.direct.close()
            self.direct = None
        self._drop_buffer()
        if self.task is None or self.task.done():
            self._give_back()
        else:  # the task gives them back as it ends; so does this, should it never start
            self.task.add_done_callback(lambda _: self._give_back())

    def overdue(self, now: float) -> bool:
        """Whether the request being received is late: stalled for ``request_timeout``, or
        behind its pace (after ``request_timeout`` s, ``min_rate`` bytes a second on average:
        a trickle that would hold the connection for ever is late long before its end)."""
        if self.started is None or self.parked_at is not None:  # parked: the server's wait
            return False
        timeout = self.shared.request_timeout
        due = self.started + timeout + self.got / self.shared.min_rate
        return now > due or now - self.last_byte > timeout

    def reclaim_rank(self, now: float) -> tuple[int, float] | None:
        """Where this connection stands when a full server must close one (lowest first), or
        None when it must not: a request under way keeps its connection.

        First a connection that never sent a whole request (an idle flood's), or has sent
        part of a header for RECLAIM_IDLE s (LMCache's client sends one in one piece), the
        oldest first, so that each newcomer gets the longest time to speak. Then one that has
        served requests and been idle RECLAIM_IDLE s, the most recently opened first: an
        engine's connection, opened when it started and never reopened (LMCache's client
        does not reconnect), is the last to go.
        """
        if self.handling or self.request is not None or self.dropping is not None:
            return None
        if self.started is not None:
            return (0, self.started) if now - self.started >= RECLAIM_IDLE else None
        if self.served == 0:
            return (0, self.opened_at)
        if now - self.idle_since >= RECLAIM_IDLE:
            return (1, -self.opened_at)
        return None

    def idle_for(self, now: float) -> float:
        """Seconds this connection has given the server nothing to do: between requests, or
        in a header that has not arrived whole (LMCache's client sends one in one piece);
        0 while a payload arrives or a request is handled."""
        if self.handling or self.request is not None or self.dropping is not None:
            return 0.0
        if self.started is not None:  # part of a header
            return now - self.started
        return now - self.idle_since

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        # At most the rest of the current header or payload: a read never crosses into the
        # next request, so pipelined requests wait in the socket until this one is handled.
        # A payload's read is also kept to what the payload budget has room for; a dropped
        # one's goes into the scratch (it costs no budget: nothing of it is kept).
        if self.dropping is not None:
            return self.shared.scratch[: self.dropping.length - self.got]
        if self.request is not None:
            room = self.shared.budget.room(self, MIN_READ)
            if room is not None:
                return self.target[self.got : self.got + room]
        return self.target[self.got :]

    def buffer_updated(self, nbytes: int) -> None:
        self.last_byte = now = self._now()
        if self.started is None:  # the first bytes of a request
            self.started = now
        self.got += nbytes
        if self.dropping is not None:
            if self.got == self.dropping.length:
                self._dropped(self.dropping)
            return
        within = self.request is None or self.shared.budget.charge(self, nbytes)
        if self.got < len(self.target):
            if not within:  # over the payload budget: wait for stored payloads to give back
                assert self.transport is not None
                self.transport.pause_reading()
                self.parked_at = now
                self.shared.budget.park(self)  # may resume it at once (see ArrivalBudget)
            return
        if self.request is None:
            self._header_done()
        else:
            self._start(self.request, self.target)

    def eof_received(self) -> bool:
        return False  # close; a request cut short is dropped

    # -- the request cycle ----------------------------------------------------------------

    def close(self, why: str) -> None:
        """Close the connection (from the server: reclaimed, overdue)."""
        self.shared.open.discard(self)
        self._close(why)

    def _close(self, why: str) -> None:
        log.debug("lm:// closing a connection: %s", why)
        if self.transport is not None:
            self.transport.close()

    def _abort(self, why: str) -> None:
        """Close without sending what the transport still holds (to a client that does not
        read, it would never go)."""
        log.debug("lm:// aborting a connection: %s", why)
        if self.transport is not None:
            self.transport.abort()

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _header_done(self) -> None:
        try:
            req = parse_request(self.header)
        except WireError as exc:
            self._close(str(exc))
            return
        if req.command != Command.PUT or req.length == 0:
            if req.command == Command.GET and self._answer_from_memory(req):
                return
            self._start(req, memoryview(b""))
            return
        if req.length > self.shared.max_payload:
            self._drop(req)
            return
        self._receive(req)

    def _drop(self, req: Request) -> None:
        """Read ``req``'s payload, over ``max_payload``, and keep none of it (module docs)."""
        self.shared.note(
            "oversized put",
            "a PUT of %d bytes is over max_payload (%d bytes): its payload is read and "
            "dropped, not stored, and the connection goes on",
            req.length,
            self.shared.max_payload,
        )
        self.dropping = req
        self.got = 0
        self.started = self._now()  # the payload's pace counts from here, as a kept one's

    def _dropped(self, req: Request) -> None:
        """The whole payload of an oversized PUT has been read: delete what the key held."""
        self.dropping = None
        key = _canonical_key(req.key)
        if key is None:
            self._served()
            return
        self._begin(lambda: self._forget(key))

    async def _forget(self, key: str) -> None:
        await self._guard(self.shared.store.delete(key), False)

    def resume(self) -> None:
        """The payload budget lets this connection read again (``ArrivalBudget.Receiver``)."""
        if self.parked_at is None or self.transport is None or self.transport.is_closing():
            return
        now = self._now()
        if self.started is not None:  # the time parked was the server's, not the client's
            self.started += now - self.parked_at
        self.parked_at = None
        self.last_byte = now
        self.transport.resume_reading()

    def _receive(self, req: Request) -> None:
        """Receive ``req``'s payload, from the next byte on, into the store's memory when it
        gives some (``_stage``), else into the connection's buffer."""
        self.staged = self._stage(req)
        if self.staged is not None:
            self.target = self.staged.view()
        else:
            if self.buffer.nbytes < req.length:
                self._drop_buffer()
                self.buffer = _untouched(req.length)
            self.target = self.buffer[: req.length]
        self.request = req
        self.got = 0
        now = self._now()
        self.started = now  # the payload's pace counts from here

    def _start(self, req: Request, payload: memoryview) -> None:
        self._begin(lambda: self._handle(req, payload))

    def _begin(self, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work()`` in a task, reading nothing more from the client until it is done."""
        assert self.transport is not None
        self.transport.pause_reading()  # one request at a time per connection
        self.handling = True
        self.started = None
        self.task = asyncio.get_running_loop().create_task(self._run(work))

    def _answer_from_memory(self, req: Request) -> bool:
        """Answer a GET that the memory tier holds from this callback: no task and no
        coroutines per request, which with the rest of the Python around the send took about
        40% of the server's busy time (py-spy, 1 MiB GETs in a loop). A reply that the socket
        or the transport does not take at once is finished by a task, within the time a reply
        may take, as on the task's own path. False leaves the GET to the handler task: an
        invalid key, a key the memory tier does not hold (a lower tier may), earlier replies
        not yet taken, no duplicate socket to be had."""
        transport = self.transport
        if transport is None or transport.is_closing() or not self.can_write.is_set():
            return False
        key = _canonical_key(req.key)
        if key is None:
            return False
        try:
            return self._send_from_memory(transport, key)
        except Exception:  # a bug here must cost one connection, never the server
            log.exception("lm:// GET from memory failed; closing its connection")
            self._close("internal error")
            return True

    def _send_from_memory(self, transport: asyncio.Transport, key: str) -> bool:
        data = self.shared.store.stored_in_memory(key)
        if data is None:
            return False
        reply = _reply_for(data.meta)
        if reply is None:  # what the handler task would answer too, from the same copy
            log.warning("lm:// GET %s: %d bytes do not fit lm://", key, data.meta.nbytes)
            transport.write(encode_reply(MISS))
            self._served_or_draining(0)
            return True
        header = encode_reply(reply)
        view = data.host()
        if view.nbytes < DIRECT_SEND:
            transport.writelines((header, view))
            self._served_or_draining(view.nbytes)
            return True
        try:
            sock = self._direct_socket()
        except OSError:
            return False  # the handler task tries again and reports what fails
        try:
            sent = _send_now(sock, header, view)
        except ConnectionError:  # the client went away: only its loss
            self._close("client gone while sending a reply")
            return True
        if sent == len(header) + view.nbytes:
            self._served()
            return True
        self._begin(lambda: self._send_within_limit(header, view, sent))
        return True

    def _served_or_draining(self, nbytes: int) -> None:
        """After a reply went to the transport: served, or, when the transport keeps part of
        it, a task waits until it is sent (within the time a reply of ``nbytes`` may take) and
        no request is read meanwhile."""
        if self.can_write.is_set():
            self._served()
            return
        self._begin(lambda: self._within_reply_limit(nbytes, self.can_write.wait))

    def _served(self) -> None:
        """A request answered without a task: ready for the next one."""
        self.started = None
        self.idle_since = self._now()
        self.served += 1
        self.got = 0

    def _stage(self, req: Request) -> Slab | None:
        """A slab of the store's pool for a large tensor payload under a valid key: the put
        then keeps the received bytes instead of copying them (``Store.reserve``; 4 MiB puts
        ran at about half ``lmcache_server``'s speed with the copy). What all payloads being
        received hold that way is bounded (``StagingAllowance``)."""
        if req.length < STAGE_FROM or not _is_tensor_payload(req):
            return None
        if _canonical_key(req.key) is None:
            return None
        return self.shared.staging.reserve(req.length)

    def _give_back(self) -> None:
        """Budget bytes and the staged slab back (idempotent)."""
        self.shared.budget.release(self)
        self._unstage()

    def _unstage(self) -> None:
        if self.staged is not None:
            self.shared.staging.give_back(self.staged)
            self.staged = None

    async def _run(self, work: Callable[[], Awaitable[None]]) -> None:
        try:
            if not self.can_write.is_set():  # the client has not taken earlier replies yet
                async with asyncio.timeout(self.shared.request_timeout):
                    await self.can_write.wait()
            await work()
        except TimeoutError:
            self.shared.note("slow reader", "closed a connection that did not take its reply")
            self._abort("replies not taken in time")
            return
        except Exception:  # a bug here must cost one connection, never the server
            log.exception("lm:// request failed; closing its connection")
            self._close("internal error")
            return
        finally:
            self._give_back()  # the store holds its own copy (or the staged slab) now
            self.handling = False
            self.idle_since = self._now()
            self.served += 1
        self._keep_or_drop_buffer()
        self.request = None
        self.target = memoryview(self.header)
        self.got = 0
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.resume_reading()

    def _keep_or_drop_buffer(self) -> None:
        """Keep the payload buffer for the next PUT unless it is large or too many are kept."""
        size = self.buffer.nbytes
        if self.buffer.readonly or not size:
            return
        if self._kept:
            return
        if size > KEEP_BUFFER or self.shared.kept + size > KEEP_TOTAL:
            self._drop_buffer()
            return
        self._kept = True
        self.shared.kept += size

    def _drop_buffer(self) -> None:
        if self._kept:
            self.shared.kept -= self.buffer.nbytes
            self._kept = False
        self.buffer = memoryview(b"")

    async def _handle(self, req: Request, payload: memoryview) -> None:
        store = self.shared.store
        if req.command == Command.HEALTH:
            self._write(encode_reply(HEALTHY))
            return
        if req.command == Command.LIST:
            self._write(encode_reply(Reply(Code.OK, 0)))
            return
        key = _canonical_key(req.key)
        if key is None:
            log.debug("lm:// %s with an invalid key: %r", req.command.name, req.key)
            key = ""
        if req.command == Command.PUT:
            if key:
                await self._put(key, req, payload)
        elif req.command == Command.EXIST:
            found = bool(key) and await self._guard(store.contains(key), False)
            self._write(encode_reply(FOUND if found else MISS))
        else:  # GET
            await self._get(key)

    async def _get(self, key: str) -> None:
        store = self.shared.store
        data = await self._guard(store.get_stored(key), None) if key else None
        if data is None:
            self._write(encode_reply(MISS))
            return
        reply = _reply_for(data.meta)
        if reply is None:
            log.warning("lm:// GET %s: %d bytes do not fit lm://", key, data.meta.nbytes)
            self._write(encode_reply(MISS))
            return
        await self._send_within_limit(encode_reply(reply), data.host())

    async def _send_within_limit(self, reply: bytes, view: memoryview, sent: int = 0) -> None:
        """``_send``, from byte ``sent`` of the reply on, within the time a reply may take."""
        await self._within_reply_limit(view.nbytes, lambda: self._send(reply, view, sent))

    async def _within_reply_limit(self, nbytes: int, work: Callable[[], Awaitable[object]]) -> None:
        """``work()`` within the time a reply of ``nbytes`` may take: a client that does not
        read loses its turn and its connection (aborted: a close would wait to send it the
        rest, and what is buffered holds a lease on the cache)."""
        limit = self.shared.request_timeout + nbytes / self.shared.min_rate
        try:
            async with asyncio.timeout(limit):
                await work()
        except TimeoutError:
            self.shared.note("slow reader", "closed a connection that did not take its reply")
            self._abort("reply not taken in time")

    async def _send(self, reply: bytes, view: memoryview, sent: int = 0) -> None:
        """The reply header and its payload, in one write where the socket takes it; from
        byte ``sent`` on when a first send already took that much.

        LMCache's client reads the header with one ``recv(36)`` and does not loop: the header
        leads the first segment either way (36 bytes are less than any segment), so sending
        it with the payload is safe and saves the client a wake-up and the server a call.
        """
        assert self.transport is not None
        if view.nbytes < DIRECT_SEND:
            self.transport.writelines((reply, view))
            await self.can_write.wait()
            return
        await self.can_write.wait()  # the transport's buffer is empty: bytes cannot interleave
        if self.transport.is_closing():
            return
        sock = self._direct_socket()
        try:
            if not sent:
                sent = _send_now(sock, reply, view)
            loop = asyncio.get_running_loop()
            if sent < len(reply):
                await loop.sock_sendall(sock, reply[sent:])
                sent = len(reply)
            # view (a lease on the cache) lives until the payload is sent.
            if sent - len(reply) < view.nbytes:
                await loop.sock_sendall(sock, view[sent - len(reply) :])
        except (ConnectionError, BrokenPipeError):  # the client went away: only its loss
            self._close("client gone while sending a reply")

    def _direct_socket(self) -> socket.socket:
        """A duplicate of the connection's socket, for payloads sent without a copy.

        Python 3.11's transport copies whatever the socket does not take at once into its own
        buffer (a 32 MiB chunk costs a fresh 30 MiB copy); ``loop.sock_sendall`` sends from
        the caller's memory. The duplicate is used only while the transport has nothing
        buffered, from a task while reading is paused or in one call from the protocol's
        callback (which pauses reading before it returns when the call did not send it all),
        so bytes never interleave.
        """
        if self.direct is None:
            assert self.transport is not None
            fd = self.transport.get_extra_info("socket").fileno()
            self.direct = socket.socket(fileno=os.dup(fd))
            self.direct.setblocking(False)
        return self.direct

    async def _guard(self, call: Awaitable[T], default: D) -> T | D:
        """A store failure is a miss for the client (and a log line for the operator)."""
        try:
            return await call
        except GatewayError as exc:
            self.shared.note(f"store {exc.kind}", "store call failed: %s", exc)
            return default

    async def _put(self, key: str, req: Request, payload: memoryview) -> None:
        store = self.shared.store
        if req.is_tombstone:
            await self._guard(store.delete(key), False)
            return
        obj = _payload_object(req, payload)
        await self._guard(store.put(key, obj, fmt=req.fmt, staged=self.staged), None)

    def _write(self, data: bytes | memoryview) -> None:
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.write(data)


def _untouched(nbytes: int) -> memoryview:
    """A payload buffer whose memory is taken as the bytes arrive: a large one is a mapping of
    untouched pages (a bytearray would be zeroed, all of it, before a byte arrived)."""
    if nbytes < MAP_FROM:
        return memoryview(bytearray(nbytes))
    return memoryview(anonymous_memory(nbytes, populate=False, huge_pages=False))[:nbytes]


def _canonical_key(text: str) -> str | None:
    """The key's canonical form, or None when it is not a valid key."""
    try:
        return str(Key.parse(text))
    except InvalidKey:
        return None


def _send_now(sock: socket.socket, reply: bytes, view: memoryview) -> int:
    """Bytes of ``reply`` then ``view`` that one non-blocking send took (0 when none fit)."""
    try:
        return sock.sendmsg((reply, view))
    except (BlockingIOError, InterruptedError):
        return 0


def _is_tensor_payload(req: Request) -> bool:
    """Whether the header describes a tensor of exactly the payload's length."""
    dtype = DTYPE_OF_CODE[req.dtype]
    if not HAS_TORCH or dtype is None:
        return False
    count = 1
    for d in strip_shape(req.shape):
        count *= d
    return count * ITEMSIZE[dtype] == req.length


def _payload_object(req: Request, payload: memoryview) -> object:
    """A tensor view over ``payload`` when the header describes it, else a bytes copy."""
    if _is_tensor_payload(req):
        import torch

        dtype = DTYPE_OF_CODE[req.dtype]
        assert dtype is not None
        tdtype = torch_dtype(dtype)
        shape = strip_shape(req.shape)
        if req.length == 0:
            return torch.empty(shape, dtype=tdtype)
        # A view, no copy: the store copies it into its own memory before put returns (or,
        # received into a staged slab, keeps that memory).
        flat = torch.frombuffer(payload, dtype=torch.uint8)
        return flat.view(tdtype).reshape(shape)
    return bytes(payload)


def _reply_for(meta: ObjectMeta) -> Reply | None:
    """The GET reply header for a stored object, or None when it cannot travel."""
    if meta.nbytes > INT32_MAX:
        return None
    code = CODE_OF_DTYPE.get(meta.dtype) if meta.kind in ("tensor", "ndarray") else None
    dims = pad_shape(meta.shape) if code is not None else None
    if code is None or dims is None:
        code, dims = CODE_OF_DTYPE["uint8"], (meta.nbytes, 0, 0, 0)
    fmt = meta.fmt if 0 <= meta.fmt <= 8 else 0
    return Reply(Code.OK, meta.nbytes, fmt, code, dims)


@dataclass(frozen=True, slots=True)
class LmStats:
    """What an lm:// server holds now."""

    connections: int
    received_bytes: int  # payload bytes received and not stored yet (the payload budget's use)
    waiting: int  # connections stopped by the payload budget


def lm_stats(server: asyncio.Server) -> LmStats:
    """The state of a server ``serve_lm`` started (zeros once it is closed)."""
    shared = _SHARED.get(server)
    if shared is None:
        return LmStats(0, 0, 0)
    return LmStats(len(shared.open), shared.budget.used, shared.budget.parked)


@contextlib.asynccontextmanager
async def lm_serving(
    store: Store, host: str, port: int, **options: Any
) -> AsyncIterator[asyncio.Server]:
    """``serve_lm`` for the length of a ``async with`` block (``options`` are its own), then
    ``close_lm``: the form ``gateway.http.app.create_app``'s companions take."""
    server = await serve_lm(store, host, port, **options)
    try:
        yield server
    finally:
        await close_lm(server)


async def close_lm(server: asyncio.Server) -> None:
    """Stop accepting, then close every open connection (Python 3.11's ``Server.close``
    leaves them open); a request in progress is cut off."""
    server.close()
    shared = _SHARED.pop(server, None)
    if shared is not None and shared.sweeper is not None:
        shared.sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await shared.sweeper
    if shared is not None:
        for conn in list(shared.open):
            if conn.transport is not None:
                conn.transport.abort()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(server.wait_closed(), 5.0)
    await asyncio.sleep(0)  # let connection_lost run
