"""kvgate's lm:// server under arbitrary headers and payloads (hypothesis).

Whatever a client declares (command, length, format, dtype code, shape, key) and however much
of the payload it then sends, the server never fails internally, keeps serving other clients,
and a PUT whose header describes its payload is stored exactly as described. The server runs
on its own event loop (asyncio's or uvloop) in a thread, so the examples drive it with plain
blocking sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers.proc import free_port

from gateway.lmcache.server import close_lm, serve_lm
from gateway.lmcache.wire import (
    DTYPE_OF_CODE,
    INT32_MAX,
    KEY_BYTES,
    REPLY,
    REQUEST,
    Code,
    Command,
    parse_reply,
)
from gateway.objects import ITEMSIZE
from gateway.store import Store

uvloop = pytest.importorskip("uvloop")

MAX_PAYLOAD = 1 << 20
SOCKET_WAIT = 1.0  # seconds a blocking read waits for an answer that may never come
INT32_MIN = -(1 << 31)
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


class _Failures(logging.Handler):
    """Collects the server's ERROR records: an internal failure is logged with exception."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class ThreadedServer:
    port: int
    loop: asyncio.AbstractEventLoop
    store: Store
    failures: _Failures

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=SOCKET_WAIT)
        sock.settimeout(SOCKET_WAIT)
        return sock

    def stored(self, key: str) -> tuple[object, int] | None:
        """The object under ``key`` and its memory format, read on the server's loop."""

        async def read() -> tuple[object, int] | None:
            found = await self.store.get_with_meta(key)
            return None if found is None else (found[0], int(found[1].fmt))

        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(10)


@pytest.fixture(scope="module", params=sorted(LOOPS))
def lm_server(request: pytest.FixtureRequest) -> Iterator[ThreadedServer]:
    loop = LOOPS[request.param]()
    port = free_port()
    ready = threading.Event()
    failures = _Failures()
    logging.getLogger("kvgate.lmserver").addHandler(failures)
    cfg = {"tiers": [{"url": "memory://", "capacity": 64 << 20}], "prefault": False}
    store = Store(cfg)
    stop = asyncio.Event()

    async def main() -> None:
        async with store:
            server = await serve_lm(
                store, "127.0.0.1", port, max_payload=MAX_PAYLOAD, request_timeout=0.5
            )
            ready.set()
            try:
                await stop.wait()
            finally:
                await close_lm(server)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the lm:// server did not start"
    try:
        yield ThreadedServer(port, loop, store, failures)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()
        logging.getLogger("kvgate.lmserver").removeHandler(failures)


INT32 = st.integers(INT32_MIN, INT32_MAX)
EDGES = st.sampled_from([-1, 0, 1, 2, 7, 8, 1 << 16, MAX_PAYLOAD, MAX_PAYLOAD + 1, INT32_MAX])
DIMS = st.one_of(st.integers(0, 64), st.sampled_from([-1, 1 << 20, INT32_MAX]), INT32)
VALID_KEY = st.builds(
    lambda model, h, tags: f"{model}@1@0@{h:x}@bfloat16" + "".join(f"@k{t}%v" for t in tags),
    st.text("abcxyz-_.0123456789", min_size=1, max_size=20),
    st.integers(0, 1 << 64),
    st.lists(st.integers(0, 9), max_size=3, unique=True),
)
KEY = st.one_of(
    VALID_KEY.map(lambda k: k.encode().ljust(KEY_BYTES)),
    st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES),
)


@st.composite
def headers(draw: st.DrawFn) -> tuple[bytes, int]:
    """An arbitrary 186-byte header and how many payload bytes to send after it."""
    command = draw(st.one_of(st.sampled_from(list(Command)), INT32))
    length = draw(st.one_of(EDGES, INT32))
    fmt = draw(st.one_of(st.integers(0, 8), INT32))
    dtype = draw(st.one_of(st.integers(0, 8), INT32))
    location = draw(st.one_of(st.integers(0, 2), INT32))
    dims = [draw(DIMS) for _ in range(4)]
    key = draw(KEY)
    header = REQUEST.pack(command, length, fmt, dtype, location, *dims, key)
    sent = draw(st.integers(0, max(0, min(length, 1 << 16))))
    return header, sent


def _read_reply(sock: socket.socket) -> tuple[int, bytes] | None:
    """A reply and its payload, or None when the server answers nothing or closes."""
    head = b""
    with contextlib.suppress(TimeoutError, ConnectionError):
        while len(head) < REPLY.size:
            chunk = sock.recv(REPLY.size - len(head))
            if not chunk:
                return None
            head += chunk
    if len(head) < REPLY.size:
        return None
    reply = parse_reply(head)
    body = b""
    while len(body) < reply.length:
        chunk = sock.recv(reply.length - len(body))
        if not chunk:
            break
        body += chunk
    return reply.code, body


def _healthy(server: ThreadedServer) -> None:
    with server.connect() as sock:
        sock.sendall(REQUEST.pack(Command.HEALTH, 0, 0, 0, 0, 0, 0, 0, 0, b" " * KEY_BYTES))
        answer = _read_reply(sock)
    assert answer is not None, "the server stopped answering new clients"
    assert answer[0] == Code.OK


FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(header=headers(), close_early=st.booleans())
def test_any_header_and_payload_leave_the_server_serving(
    lm_server: ThreadedServer, header: tuple[bytes, int], close_early: bool
) -> None:
    raw, sent = header
    with lm_server.connect() as sock, contextlib.suppress(ConnectionError):
        sock.sendall(raw + bytes(sent))
        if not close_early:
            _read_reply(sock)
    _healthy(lm_server)
    assert not lm_server.failures.records, lm_server.failures.records[0].getMessage()


@st.composite
def described_puts(draw: st.DrawFn) -> tuple[str, int, int, tuple[int, ...], bytes]:
    """A PUT whose dtype code and shape describe its payload exactly."""
    code = draw(st.sampled_from([c for c, name in DTYPE_OF_CODE.items() if name is not None]))
    itemsize = ITEMSIZE[DTYPE_OF_CODE[code]]  # type: ignore[index]
    shape = tuple(draw(st.lists(st.integers(1, 16), min_size=1, max_size=4)))
    payload = draw(st.binary(min_size=math.prod(shape) * itemsize, max_size=MAX_PAYLOAD))
    payload = payload[: math.prod(shape) * itemsize]
    fmt = draw(st.integers(0, 8))
    return draw(VALID_KEY), fmt, code, shape, payload


@FUZZ
@given(put=described_puts())
def test_a_described_put_is_stored_as_described(
    lm_server: ThreadedServer, put: tuple[str, int, int, tuple[int, ...], bytes]
) -> None:
    key, fmt, code, shape, payload = put
    dims = (*shape, 0, 0, 0, 0)[:4]
    head = REQUEST.pack(Command.PUT, len(payload), fmt, code, 0, *dims, key.encode().ljust(150))
    get = REQUEST.pack(Command.GET, 0, 0, 0, 0, 0, 0, 0, 0, key.encode().ljust(150))
    with lm_server.connect() as sock:
        sock.sendall(head + payload + get)
        answer = _read_reply(sock)
    assert answer is not None
    assert answer == (Code.OK, payload)
    stored = lm_server.stored(key)
    assert stored is not None
    assert stored[1] == fmt
