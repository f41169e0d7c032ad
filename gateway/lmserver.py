"""LMCache's ``lm://`` protocol served on top of a Store, so LMCache can use kvgate unchanged.

``serve_lm(store, host, port)`` starts an asyncio server speaking the protocol byte for byte
(``gateway.lmwire``). Objects land in the Store under the LMCache key string, so an HTTP GET
of the same key sees them:

- a PUT whose dtype code names a dtype and whose shape (trailing zeros stripped) holds exactly
  ``length`` bytes is stored as a tensor of that dtype and shape, with its memory format;
  anything else (no dtype, a shape that does not fit) as bytes. A GET answers with the stored
  format, dtype and shape; bytes, and tensors whose dtype or rank the wire cannot carry, go
  back as uint8 ``[length, 0, 0, 0]``. A kvgate tombstone PUT deletes the key.
- LIST is answered (200 with an empty list: kvgate does not enumerate its tiers over lm://);
  the stock server never answers it.
- A malformed or truncated header, an unknown command, a negative length or one over
  ``max_payload`` closes that one connection; a key that is not an LMCache key string is a
  miss (GET, EXIST) or dropped (PUT, after reading its payload). Connections over
  ``max_connections`` are closed at once. Store failures are misses, never crashes.

Why a ``BufferedProtocol`` rather than stream readers: payloads are received straight into one
reused buffer per connection (no per-chunk allocation and copy), and GET replies are written
from the cache's memory on a duplicate of the socket, so the transport never copies a chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import weakref
from collections.abc import Awaitable
from typing import TypeVar

from gateway.errors import GatewayError, InvalidKey
from gateway.keys import Key
from gateway.lmwire import (
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
from gateway.objects import HAS_TORCH, ITEMSIZE, ObjectMeta, to_object_data, torch_dtype
from gateway.store import Store
from gateway.transport import stream_transport

log = logging.getLogger("kvgate.lmserver")
T = TypeVar("T")
D = TypeVar("D")

KEEP_BUFFER = 64 << 20  # a connection keeps its receive buffer up to this size between PUTs
DIRECT_SEND = 256 << 10  # GET payloads from this size on are sent without the transport
DEFAULT_MAX_CONNECTIONS = 256


async def serve_lm(
    store: Store,
    host: str,
    port: int,
    *,
    max_payload: int | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> asyncio.Server:
    """Start serving lm:// on ``host:port``; ``close_lm(server)`` stops it."""
    await store.open()
    limit = min(max_payload or store.config.max_object_size, INT32_MAX)
    state = _Shared(store, limit, max_connections)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _LmProtocol(state), host, port)
    _SHARED[server] = state
    log.info("lm:// server on %s:%d", host, port)
    return server


class _Shared:
    """What every connection of one server shares."""

    def __init__(self, store: Store, max_payload: int, max_connections: int) -> None:
        self.store = store
        self.max_payload = max_payload
        self.max_connections = max_connections
        self.open: set[_LmProtocol] = set()

    @property
    def connections(self) -> int:
        return len(self.open)


_SHARED: weakref.WeakKeyDictionary[asyncio.Server, _Shared] = weakref.WeakKeyDictionary()


class _LmProtocol(asyncio.BufferedProtocol):
    """One client connection: read a header, then its payload, handle it, repeat."""

    def __init__(self, shared: _Shared) -> None:
        self.shared = shared
        self.transport: asyncio.Transport | None = None
        self.header = bytearray(REQUEST.size)
        self.buffer = bytearray()  # the payload buffer, reused across PUTs
        self.target = memoryview(self.header)  # what get_buffer fills now
        self.got = 0
        self.request: Request | None = None
        self.task: asyncio.Task[None] | None = None
        self.direct: socket.socket | None = None
        self.can_write: asyncio.Event = asyncio.Event()
        self.can_write.set()

    # -- transport callbacks --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = stream_transport(transport)
        # Pause as soon as anything is buffered, so that can_write means "buffer empty".
        transport.set_write_buffer_limits(high=0)
        if self.shared.connections >= self.shared.max_connections:
            log.warning("lm:// connection refused: %d open", self.shared.connections)
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

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        # Exactly the rest of the current header or payload: a read never crosses into the
        # next request, so pipelined requests wait in the socket until this one is handled.
        return self.target[self.got :]

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        if self.got < len(self.target):
            return
        if self.request is None:
            self._header_done()
        else:
            self._start(self.request, self.target)

    def eof_received(self) -> bool:
        return False  # close; a request cut short is dropped

    # -- the request cycle ----------------------------------------------------------------

    def _close(self, why: str) -> None:
        log.debug("lm:// closing a connection: %s", why)
        if self.transport is not None:
            self.transport.close()

    def _header_done(self) -> None:
        try:
            req = parse_request(self.header)
        except WireError as exc:
            self._close(str(exc))
            return
        if req.command != Command.PUT or req.length == 0:
            self._start(req, memoryview(b""))
            return
        if req.length > self.shared.max_payload:
            self._close(f"payload of {req.length} bytes over {self.shared.max_payload}")
            return
        if len(self.buffer) < req.length:
            self.buffer = bytearray(req.length)
        self.request = req
        self.target = memoryview(self.buffer)[: req.length]
        self.got = 0

    def _start(self, req: Request, payload: memoryview) -> None:
        assert self.transport is not None
        self.transport.pause_reading()  # one request at a time per connection
        self.task = asyncio.get_running_loop().create_task(self._run(req, payload))

    async def _run(self, req: Request, payload: memoryview) -> None:
        try:
            await self._handle(req, payload)
        except Exception:  # a bug here must cost one connection, never the server
            log.exception("lm:// request failed; closing its connection")
            self._close("internal error")
            return
        if len(self.buffer) > KEEP_BUFFER:
            self.buffer = bytearray()
        self.request = None
        self.target = memoryview(self.header)
        self.got = 0
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.resume_reading()

    async def _handle(self, req: Request, payload: memoryview) -> None:
        store = self.shared.store
        if req.command == Command.HEALTH:
            self._write(encode_reply(HEALTHY))
            return
        if req.command == Command.LIST:
            self._write(encode_reply(Reply(Code.OK, 0)))
            return
        try:
            key = str(Key.parse(req.key))
        except InvalidKey as exc:
            log.debug("lm:// %s with an invalid key: %s", req.command.name, exc)
            key = ""
        if req.command == Command.PUT:
            if key:
                await _put(store, key, req, payload)
        elif req.command == Command.EXIST:
            found = bool(key) and await _guard(store.contains(key), False)
            self._write(encode_reply(FOUND if found else MISS))
        else:  # GET
            await self._get(key)

    async def _get(self, key: str) -> None:
        found = await _guard(_get_with_format(self.shared.store, key), None) if key else None
        if found is None:
            self._write(encode_reply(MISS))
            return
        obj, fmt = found
        data = to_object_data(obj, fmt)
        reply = _reply_for(data.meta)
        if reply is None:
            log.warning("lm:// GET %s: %d bytes do not fit lm://", key, data.meta.nbytes)
            self._write(encode_reply(MISS))
            return
        view = data.host()
        self._write(encode_reply(reply))  # alone: LMCache's client reads it with one recv(36)
        await self.can_write.wait()  # the transport's buffer is empty: the payload comes next
        assert self.transport is not None
        if self.transport.is_closing():
            return
        if view.nbytes < DIRECT_SEND:
            self._write(view)
            return
        # obj (and its lease on the cache) lives until the payload is sent.
        await asyncio.get_running_loop().sock_sendall(self._direct_socket(), view)

    def _direct_socket(self) -> socket.socket:
        """A duplicate of the connection's socket, for payloads sent without a copy.

        Python 3.11's transport copies whatever the socket does not take at once into its own
        buffer (a 32 MiB chunk costs a fresh 30 MiB copy); ``loop.sock_sendall`` sends from
        the caller's memory. The duplicate is used only while the transport has nothing
        buffered and reading is paused, so bytes never interleave.
        """
        if self.direct is None:
            assert self.transport is not None
            fd = self.transport.get_extra_info("socket").fileno()
            self.direct = socket.socket(fileno=os.dup(fd))
            self.direct.setblocking(False)
        return self.direct

    def _write(self, data: bytes | memoryview) -> None:
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.write(data)


async def _guard(call: Awaitable[T], default: D) -> T | D:
    """A store failure is a miss for the client (and a log line for the operator)."""
    try:
        return await call
    except GatewayError as exc:
        log.warning("lm:// store call failed: %s", exc)
        return default


async def _get_with_format(store: Store, key: str) -> tuple[object, int] | None:
    """The object under ``key`` and the memory format it was stored with."""
    found = await store.get_with_meta(key)
    return None if found is None else (found[0], int(found[1].fmt))


async def _put(store: Store, key: str, req: Request, payload: memoryview) -> None:
    if req.is_tombstone:
        await _guard(store.delete(key), False)
        return
    await _guard(store.put(key, _payload_object(req, payload), fmt=req.fmt), None)


def _payload_object(req: Request, payload: memoryview) -> object:
    """A tensor view over ``payload`` when the header describes it, else a bytes copy."""
    dtype = DTYPE_OF_CODE[req.dtype]
    shape = strip_shape(req.shape)
    if HAS_TORCH and dtype is not None:
        count = 1
        for d in shape:
            count *= d
        if count * ITEMSIZE[dtype] == req.length:
            import torch

            tdtype = torch_dtype(dtype)
            if req.length == 0:
                return torch.empty(shape, dtype=tdtype)
            # A view, no copy: the store copies it into its own memory before put returns.
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


async def close_lm(server: asyncio.Server) -> None:
    """Stop accepting, then close every open connection (Python 3.11's ``Server.close``
    leaves them open); a request in progress is cut off."""
    server.close()
    shared = _SHARED.pop(server, None)
    if shared is not None:
        for conn in list(shared.open):
            if conn.transport is not None:
                conn.transport.abort()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(server.wait_closed(), 5.0)
    await asyncio.sleep(0)  # let connection_lost run
