"""The HTTP service over a real socket: uvicorn on loopback, httpx as the client."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest_asyncio
import uvicorn

from gateway.service import create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest_asyncio.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    cfg = {
        "tiers": [{"url": "memory://", "capacity": 64 << 20}, {"url": f"file://{tmp_path}/disk"}]
    }
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(cfg, max_body=8 << 20),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="on",
        )
    )
    task = asyncio.create_task(server.serve())
    for _ in range(500):  # uvicorn has no "started" event to await: poll, bounded (5 s)
        if server.started:
            break
        await asyncio.sleep(0.01)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
        yield c
    server.should_exit = True
    await task


async def test_object_round_trip_bytes(client: httpx.AsyncClient) -> None:
    key = "llama@1@0@-1a2b@bfloat16"
    assert (await client.put(f"/v1/objects/{key}", content=b"hello")).status_code == 204
    r = await client.get(f"/v1/objects/{key}")
    assert r.status_code == 200
    assert r.content == b"hello"
    assert r.headers["x-kvgate-kind"] == "bytes"
    assert (await client.head(f"/v1/objects/{key}")).status_code == 200
    assert (await client.delete(f"/v1/objects/{key}")).status_code == 204
    assert (await client.get(f"/v1/objects/{key}")).status_code == 404
    assert (await client.delete(f"/v1/objects/{key}")).status_code == 404


async def test_tensor_headers_round_trip(client: httpx.AsyncClient) -> None:
    body = bytes(range(24)) * 2
    headers = {"x-kvgate-dtype": "bfloat16", "x-kvgate-shape": "2,3,4"}
    assert (await client.put("/v1/objects/t", content=body, headers=headers)).status_code == 204
    r = await client.get("/v1/objects/t")
    assert r.content == body
    assert r.headers["x-kvgate-dtype"] == "bfloat16"
    assert r.headers["x-kvgate-shape"] == "2,3,4"


async def test_bad_requests_get_clear_errors(client: httpx.AsyncClient) -> None:
    r = await client.put(
        "/v1/objects/t",
        content=b"abc",
        headers={"x-kvgate-dtype": "float32", "x-kvgate-shape": "5"},
    )
    assert r.status_code == 400
    assert "does not match" in r.json()["detail"]
    r = await client.put("/v1/objects/t", content=b"abcd", headers={"x-kvgate-dtype": "nope"})
    assert r.status_code == 415
    r = await client.put("/v1/objects/big", content=b"x" * (9 << 20))
    assert r.status_code == 413
    r = await client.put("/v1/objects/" + "k" * 2000, content=b"x")
    assert r.status_code == 400


async def test_flush_tiers_health(client: httpx.AsyncClient) -> None:
    await client.put("/v1/objects/a", content=b"1")
    assert (await client.post("/v1/flush")).status_code == 204
    tiers = (await client.get("/v1/tiers")).json()
    assert set(tiers) == {"memory", "file"}
    assert tiers["file"]["bytes_written"] > 0
    assert (await client.get("/healthz")).json() == {"status": "ok"}
