"""A request's head is bounded in size (``--max-header-bytes``): a client that streams headers,
one endless header, an endless URL or endless trailers is refused (431 while it sends a head)
and disconnected once past the bound, having handed the server little more than the bound;
a head just under the bound is served.

Over real sockets: the app under uvicorn in this process with each protocol class, on asyncio's
loop and on uvloop, where what the server read is counted; and ``kvgate serve`` as shipped (a
subprocess: uvloop and httptools), whose resident memory must not grow.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal

import pytest
from servers.proc import free_port
from test_service_head_timeout import _served_here, serving

from gateway.http.head_limits import head_limits_protocol

LIMIT = 12 << 10  # the bound the servers here run with: not h11's default (16 KiB)
READ = 256 << 10  # the most one socket read hands a protocol (asyncio's and uvloop's)
TIMEOUT = 10.0  # the header timeout: far from the scenarios' time
BLAST = 2 << 20  # what a hostile client sends, in 8 KiB pieces (to this process's servers)
PIECE = 8 << 10
ANSWER = (
    b"""{"error": "header_too_large", "detail": "the request's URL and headers pass %d bytes"}"""
    % LIMIT
)
START = b"GET /healthz HTTP/1.1\r\nHost: t\r\n"  # the URL and Host count 17 bytes


def _many_headers(total: int = BLAST) -> Iterator[bytes]:
    yield START
    for i in range(total // PIECE):
        name = b"x-h%d" % i
        yield name + b": " + b"a" * (PIECE - len(name) - 4) + b"\r\n"
    yield b"\r\n"


def _endless_header(total: int = BLAST) -> Iterator[bytes]:
    yield START + b"X-Endless: "
    yield from (b"a" * PIECE for _ in range(total // PIECE))
    yield b"\r\n\r\n"


def _endless_url(total: int = BLAST) -> Iterator[bytes]:
    yield b"GET /"
    yield from (b"a" * PIECE for _ in range(total // PIECE))
    yield b" HTTP/1.1\r\nHost: t\r\n\r\n"


def _endless_trailers(total: int = BLAST) -> Iterator[bytes]:
    yield b"POST /healthz HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n"
    for i in range(total // PIECE):
        name = b"x-t%d" % i
        yield name + b": " + b"a" * (PIECE - len(name) - 4) + b"\r\n"
    yield b"\r\n"


def _answered(answer: bytes) -> bool:
    """Whether ``answer`` holds a whole response (the app's have a content-length)."""
    head, found, body = answer.partition(b"\r\n\r\n")
    lengths = [line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    return bool(found and lengths) and len(body) >= int(lengths[0].partition(b":")[2])


async def _send(port: int, pieces: Iterable[bytes], pause: float = 0.0) -> bytes:
    """Sends ``pieces`` as fast as the server takes them (``pause`` s between them) until it
    closes the connection; what it answered (read after a reset too: the kernel keeps it).
    Fails if neither a whole answer nor the close comes within 10 s."""
    loop = asyncio.get_running_loop()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setblocking(False)
        try:
            for piece in pieces:
                await loop.sock_sendall(sock, piece)
                if pause:
                    await asyncio.sleep(pause)
        except ConnectionError:
            pass  # refused: what it answered is still to be read
        answer = b""
        while not _answered(answer):
            try:
                data = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 10)
            except ConnectionError:
                break
            if not data:
                break
            answer += data
        return answer


def _counting(protocol: type[asyncio.Protocol], fed: list[int]) -> type[asyncio.Protocol]:
    """``protocol``, adding to ``fed[0]`` what each connection reads."""

    class Counting(protocol):  # type: ignore[misc, valid-type]
        def data_received(self, data: bytes) -> None:
            fed[0] += len(data)
            super().data_received(data)

    return Counting


def _head(counted: int) -> list[bytes]:
    """A GET /healthz whose URL and header lines count ``counted`` bytes (as sent, 17 more
    with the method, the version and the last line end), in pieces: most of it one header,
    cut so that some pieces lie inside it, and its last line end apart."""
    big = b"x-big: " + b"a" * (counted - 17 - 9) + b"\r\n"  # "x-big: " and "\r\n": 9 bytes
    head = START + big + b"\r\n"
    cuts = [0, 100, *range(len(START) + 2000, len(head) - 2, 3000), len(head) - 2, len(head)]
    return [head[a:b] for a, b in itertools.pairwise(cuts)]


HTTP = ["httptools", "h11"]
OVERSIZED = {
    "many headers": _many_headers,
    "an endless header": _endless_header,
    "an endless URL": _endless_url,
}


@asynccontextmanager
async def _server(http: Literal["httptools", "h11"]) -> AsyncIterator[tuple[int, list[int]]]:
    """The app in this process, its heads bound to ``LIMIT``: its port, and what it has read."""
    fed = [0]
    server = _served_here(_counting(head_limits_protocol(TIMEOUT, http, max_bytes=LIMIT), fed))
    port = await anext(server)
    try:
        yield port, fed
    finally:
        await server.aclose()


@pytest.mark.both_loops
@pytest.mark.parametrize("http", HTTP)
@pytest.mark.parametrize("shape", OVERSIZED)
async def test_an_oversized_head_is_refused(http: Literal["httptools", "h11"], shape: str) -> None:
    async with _server(http) as (port, fed):
        answer = await _send(port, OVERSIZED[shape]())
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"\r\nconnection: close\r\n" in answer, answer
    assert answer.endswith(ANSWER), answer
    assert fed[0] <= LIMIT + 2 * READ, f"the server read {fed[0]} bytes of {BLAST}"


@pytest.mark.both_loops
@pytest.mark.parametrize("http", HTTP)
async def test_endless_trailers_are_cut_off(http: Literal["httptools", "h11"]) -> None:
    async with _server(http) as (port, fed):
        answer = await _send(port, _endless_trailers())
    assert b" 431 " not in answer, answer  # after the head: the connection is just closed
    assert fed[0] <= LIMIT + 2 * READ, f"the server read {fed[0]} bytes of {BLAST}"


@pytest.mark.both_loops
@pytest.mark.parametrize("http", HTTP)
@pytest.mark.parametrize(
    ("counted", "status"), [(LIMIT - 17, b"200"), (LIMIT + 1, b"431")], ids=["under", "over"]
)
async def test_a_head_at_the_bound(
    http: Literal["httptools", "h11"], counted: int, status: bytes
) -> None:
    """Sent in pieces, some inside one header: the bound is exact, whatever the reads."""
    async with _server(http) as (port, _):
        answer = await _send(port, _head(counted), pause=0.02)
    assert answer.startswith(b"HTTP/1.1 %s " % status), answer[:200]


def _rss(pid: int) -> int:
    """The process's resident memory (bytes)."""
    status = Path(f"/proc/{pid}/status").read_text()
    kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(kib) << 10


@pytest.fixture(scope="module")
def kvgate_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    """``kvgate serve --max-header-bytes LIMIT`` in a subprocess: its port and pid."""
    port = free_port()
    options = ["--port", str(port), "--log-level", "warning", "--max-header-bytes", str(LIMIT)]
    with serving(tmp_path_factory.mktemp("serve"), *options) as proc:
        yield port, proc.pid


@pytest.mark.parametrize("shape", ["many headers", "an endless header"])
async def test_kvgate_serve_does_not_grow(kvgate_serve: tuple[int, int], shape: str) -> None:
    port, pid = kvgate_serve
    before = _rss(pid)
    answer = await _send(port, OVERSIZED[shape](32 << 20))
    grown = _rss(pid) - before
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert grown < 4 << 20, f"the server grew {grown / 2**20:.1f} MiB"


async def test_kvgate_serve_serves_a_head_under_the_bound(kvgate_serve: tuple[int, int]) -> None:
    answer = await _send(kvgate_serve[0], _head(LIMIT - 17), pause=0.02)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


def test_the_size_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="> 0"):
        head_limits_protocol(max_bytes=0)
