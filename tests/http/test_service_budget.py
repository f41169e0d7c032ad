"""The bound on bytes that all request bodies hold at once: past it, requests wait, then 503."""

from __future__ import annotations

import asyncio
import json
import select
import socket
from pathlib import Path

import httpx
import pytest
from starlette.types import Message, Receive, Scope, Send
from test_service import _raw_request, _read_status, serve, store_config

from gateway.errors import Unavailable
from gateway.http.app import create_app
from gateway.http.byte_budget import ByteBudget
from gateway.http.pace import BodyPace, BodyTimeout

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops

MIB = 1 << 20


async def test_a_release_wakes_a_waiter_and_a_timeout_is_unavailable() -> None:
    budget = ByteBudget(10, wait=0.2)
    held = await budget.acquire(8)
    with pytest.raises(Unavailable, match="busy"):
        await budget.acquire(5)  # 8 + 5 > 10 until the wait runs out
    waiting = asyncio.create_task(budget.acquire(5))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    budget.release(held)
    assert await waiting == 5
    assert budget.used == 5
    assert await ByteBudget(4).acquire(100) == 4  # one body may always take the whole budget


async def test_uploads_over_the_budget_wait_then_get_503(tmp_path: Path) -> None:
    app = create_app(
        store_config(tmp_path), max_body=MIB, body_pool=0, body_budget=MIB, budget_wait=0.3
    )
    async for url in serve(app):
        port = int(url.rsplit(":", 1)[1])
        head = (
            b"PUT /v1/objects/slow HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n" % MIB
        )
        # A slow upload holds the whole budget while its body trickles in.
        slow = await asyncio.to_thread(_raw_request, port, head + b"x" * (MIB // 2))
        with slow:
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                await asyncio.sleep(0.1)
                r = await client.put("/v1/objects/fast", content=b"y" * 1024)
                assert (r.status_code, r.json()["error"]) == (503, "unavailable")
                await asyncio.to_thread(slow.sendall, b"x" * (MIB // 2))
                assert await asyncio.to_thread(_read_status, slow) == 204
                # The budget is back: the same request now goes through.
                r = await client.put("/v1/objects/fast", content=b"y" * 1024)
                assert r.status_code == 204
                assert (await client.get("/v1/objects/slow")).content == b"x" * MIB


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket timeout: 10 s)."""
    sock.settimeout(10)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _answer(data: bytes) -> tuple[int, dict[str, str], dict[str, str]]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split(" ", 2)[1]), headers, json.loads(body)


async def test_stalled_bodies_time_out_and_give_the_budget_back(tmp_path: Path) -> None:
    app = create_app(
        store_config(tmp_path),
        max_body=MIB,
        body_pool=0,
        body_budget=MIB,
        budget_wait=20,
        body_timeout=0.5,
    )
    async for url in serve(app):
        port = int(url.rsplit(":", 1)[1])
        head = (
            b"PUT /v1/objects/stalled HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n" % MIB
        )
        # Two uploads declare the largest body and send none of it: the first holds the whole
        # budget, the second waits for it. Neither may keep it past the body timeout.
        stalled = [await asyncio.to_thread(_raw_request, port, head) for _ in range(2)]
        await asyncio.sleep(0.1)
        async with httpx.AsyncClient(base_url=url, timeout=15) as client:
            r = await client.put("/v1/objects/small", content=b"hello")
            assert r.status_code == 204
            assert (await client.get("/v1/objects/small")).content == b"hello"
            for sock in stalled:
                with sock:
                    status, headers, error = _answer(
                        await asyncio.to_thread(_read_until_closed, sock)
                    )
                assert (status, error["error"]) == (408, "body_timeout"), error
                assert "stalled" in error["detail"]
                assert headers["connection"] == "close"
            assert (await client.get("/v1/objects/stalled")).status_code == 404


async def test_a_trickling_body_is_cut_off_by_the_minimum_rate(tmp_path: Path) -> None:
    app = create_app(
        store_config(tmp_path), max_body=MIB, body_pool=0, body_timeout=0.5, body_min_rate=1000
    )
    async for url in serve(app):
        port = int(url.rsplit(":", 1)[1])
        head = (
            b"PUT /v1/objects/slow HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/octet-stream\r\nContent-Length: 100000\r\n\r\n"
        )
        sock = await asyncio.to_thread(_raw_request, port, head)
        with sock:
            # 10 bytes every 0.1 s: never idle for 0.5 s, but 100 bytes/s, not 1000.
            for _ in range(100):  # 10 s at most: without a rate limit, no answer comes
                if select.select([sock], [], [], 0)[0]:  # the server answered
                    break
                await asyncio.to_thread(sock.sendall, b"x" * 10)
                await asyncio.sleep(0.1)
            status, _, error = _answer(await asyncio.to_thread(_read_until_closed, sock))
        assert (status, error["error"]) == (408, "body_timeout"), error
        assert "too slow" in error["detail"]
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            assert (await client.get("/v1/objects/slow")).status_code == 404
            # A body that arrives at once is not affected.
            assert (await client.put("/v1/objects/slow", content=b"y" * MIB)).status_code == 204


async def test_body_pace_moves_its_deadline_with_each_piece_and_leaves_other_cancels() -> None:
    """The middleware alone, on an ASGI app that reads a body piece by piece."""
    pieces: asyncio.Queue[Message] = asyncio.Queue()
    read: list[bytes] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            read.append(message["body"])
            if not message["more_body"]:
                return

    async def never_send(message: Message) -> None:
        raise AssertionError("nothing is sent")

    paced = BodyPace(app, idle=0.3, min_rate=0)
    scope: Scope = {"type": "http"}
    call = asyncio.create_task(paced(scope, pieces.get, never_send))
    for _ in range(8):  # 0.8 s of pieces 0.1 s apart: longer than the idle limit in total
        pieces.put_nowait({"type": "http.request", "body": b"x", "more_body": True})
        await asyncio.sleep(0.1)
    assert not call.done()
    with pytest.raises(BodyTimeout, match="stalled"):
        await call  # then nothing for 0.3 s
    assert read == [b"x"] * 8
    # A cancel that is not the timer's stays a cancel (a server shutting down, say).
    call = asyncio.create_task(BodyPace(app, idle=5, min_rate=0)(scope, pieces.get, never_send))
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_a_plain_body_is_read_into_the_stores_memory_and_given_back_if_cut_short(
    tmp_path: Path,
) -> None:
    """An octet-stream PUT's body goes into the store's pool (the put keeps it, no copy); a
    client that goes away mid-body leaves nothing stored and none of that memory held."""
    app = create_app(store_config(tmp_path), max_body=4 * MIB, body_pool=0)
    store = app.state.kvgate.store
    async for url in serve(app):
        port = int(url.rsplit(":", 1)[1])
        pool = store.pool
        before = pool.used
        head = (
            b"PUT /v1/objects/cut HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n" % (2 * MIB)
        )
        sock = await asyncio.to_thread(_raw_request, port, head + b"x" * MIB)
        try:
            for _ in range(200):
                if pool.used > before:
                    break
                await asyncio.sleep(0.01)
            assert pool.used >= before + 2 * MIB  # the body's slab, from the store's pool
        finally:
            sock.close()
        for _ in range(300):
            if pool.used == before:
                break
            await asyncio.sleep(0.01)
        assert pool.used == before
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            assert (await client.get("/v1/objects/cut")).status_code == 404
            body = bytes(range(256)) * (8 * 1024)
            assert (await client.put("/v1/objects/whole", content=body)).status_code == 204
            assert (await client.get("/v1/objects/whole")).content == body
        assert pool.used >= before + len(body)  # stored in the memory tier, once
