"""The bound on bytes that all request bodies hold at once: past it, requests wait, then 503."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from test_service import _raw_request, _read_status, serve, store_config

from gateway.byte_budget import ByteBudget
from gateway.errors import Unavailable
from gateway.service import create_app

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
