"""A request's head must arrive within ``--header-timeout`` (slowloris): a client that trickles
one, or sends nothing, is disconnected; slow-but-in-time heads and keep-alive connections that
idle between requests (under uvicorn's keep-alive timeout) are served.

Over real sockets: ``kvgate serve`` as shipped (a subprocess: uvloop and httptools), and the
app under uvicorn in this process with each protocol class, on asyncio's loop and on uvloop.
The scenarios run concurrently, each on its own connection.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import pytest
from servers.asgi import serve
from servers.proc import free_port
from test_service_auth import _wait_ready

from gateway.http.app import create_app
from gateway.http.head_limits import head_limits_protocol

BOUND = 1.0  # the header timeout the servers run with (s)
KEEP_ALIVE = 5  # uvicorn's default keep-alive timeout (s), which `kvgate serve` keeps
CLOSED_WITHIN = 5 * BOUND  # generous: the bound plus scheduling on a loaded machine
HEAD = b"GET /healthz HTTP/1.1\r\nHost: t\r\n"


async def _closed_after(
    reader: asyncio.StreamReader, trickle: asyncio.StreamWriter | None
) -> tuple[float, bytes]:
    """Seconds until the server closes the connection, and what it sent before; a header byte
    every 0.2 s meanwhile when ``trickle`` is given. Fails past ``CLOSED_WITHIN``."""
    loop = asyncio.get_running_loop()
    start, answer = loop.time(), b""
    while (elapsed := loop.time() - start) < CLOSED_WITHIN:
        try:
            data = await asyncio.wait_for(reader.read(4096), 0.2)
        except TimeoutError:
            if trickle is not None:
                trickle.write(b"a")
            continue
        except ConnectionError:
            return elapsed, answer
        if not data:
            return elapsed, answer
        answer += data
    pytest.fail(f"the connection is still open after {elapsed:.1f} s (bound {BOUND} s)")


async def _response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One response's status line and body (the app's answers have a content-length)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(
        int(line.partition(b":")[2])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    body = await asyncio.wait_for(reader.readexactly(length), 10)
    return head.partition(b"\r\n")[0], body


async def _trickled_head_is_cut_off(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(HEAD + b"X-Slow: ")
        _, answer = await _closed_after(reader, trickle=writer)
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b'"header_timeout"' in answer, answer
    finally:
        writer.close()


async def _silent_connection_is_closed(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        _, answer = await _closed_after(reader, trickle=None)
        assert answer == b"", answer  # nothing was asked: nothing is answered
    finally:
        writer.close()


async def _keep_alive_requests_each_get_their_own_bound(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(HEAD + b"\r\n")
        assert (await _response(reader))[0] == b"HTTP/1.1 200 OK"
        await asyncio.sleep(1.5 * BOUND)  # idle longer than the bound, under the keep-alive
        writer.write(HEAD + b"\r\n")
        assert (await _response(reader))[0] == b"HTTP/1.1 200 OK"
        writer.write(HEAD + b"X-Slow: ")  # the next head, trickled: cut off too
        _, answer = await _closed_after(reader, trickle=writer)
        assert answer.startswith(b"HTTP/1.1 408 "), answer
    finally:
        writer.close()


async def _slow_head_within_the_bound_is_served(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for piece in (b"GET /heal", b"thz HTTP/1.1\r\nHo", b"st: t\r\nX-Slow: a", b"\r\n\r\n"):
            writer.write(piece)
            await asyncio.sleep(0.1 * BOUND)  # 0.4 of the bound in all
        status, body = await _response(reader)
        assert status == b"HTTP/1.1 200 OK", (status, body)
    finally:
        writer.close()


async def _scenarios(port: int) -> None:
    await asyncio.gather(
        _trickled_head_is_cut_off(port),
        _silent_connection_is_closed(port),
        _keep_alive_requests_each_get_their_own_bound(port),
        _slow_head_within_the_bound_is_served(port),
    )


async def _served_here(protocol: type[asyncio.Protocol]) -> AsyncIterator[int]:
    """The app under uvicorn in this process with the HTTP ``protocol`` class; yields its port."""
    app = create_app({"tiers": [{"url": "memory://", "capacity": 8 << 20}]}, body_pool=0)
    server = serve(app, http=protocol, timeout_keep_alive=KEEP_ALIVE)
    url = await anext(server)
    try:
        yield int(url.rsplit(":", 1)[1])
    finally:
        await server.aclose()


@pytest.mark.both_loops
@pytest.mark.parametrize("http", ["httptools", "h11"])
async def test_heads_are_bounded_under_each_protocol_and_loop(
    http: Literal["httptools", "h11"],
) -> None:
    server = _served_here(head_limits_protocol(BOUND, http))
    port = await anext(server)
    try:
        await _scenarios(port)
    finally:
        await server.aclose()


@contextmanager
def serving(tmp: Path, *options: str) -> Iterator[subprocess.Popen[bytes]]:
    """``kvgate serve`` on a memory tier with ``options`` (``--port`` among them), in a
    subprocess, ready."""
    config = tmp / "kvgate.yaml"
    config.write_text("tiers:\n  - url: 'memory://'\n    capacity: 8MiB\n")
    log = tmp / "serve.log"
    command = [sys.executable, "-m", "gateway.cli", "serve", "-f", str(config), *options]
    env = {k: v for k, v in os.environ.items() if k != "KVGATE_TOKEN"}
    with log.open("wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        port = options[options.index("--port") + 1]
        _wait_ready(f"http://127.0.0.1:{port}", proc, log)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def kvgate_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """``kvgate serve --header-timeout BOUND`` in a subprocess; yields its port."""
    port = free_port()
    options = ["--port", str(port), "--log-level", "warning", "--header-timeout", str(BOUND)]
    with serving(tmp_path_factory.mktemp("serve"), *options):
        yield port


async def test_kvgate_serve_bounds_heads(kvgate_serve: int) -> None:
    await _scenarios(kvgate_serve)


def test_the_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="> 0"):
        head_limits_protocol(0)
