"""Requests that must not cost the server what they ask for: codec options naming server
files, batch answers over the limit, keys that are not UTF-8, clients that leave mid-body."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from kvtc_data import ROPE, calibration_chunks
from servers.asgi import running
from test_service import FRAME, _raw_request, store_config

from gateway.frame import decode_frame
from gateway.http.app import create_app
from serde.kvtc import registry
from serde.kvtc.fit import fit

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops

KIB, MIB = 1 << 10, 1 << 20


@pytest_asyncio.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(store_config(tmp_path), max_body=MIB, body_pool=4 * MIB)
    async with running(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def calibration(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, bytes]:
    loaded = fit(calibration_chunks(4), group=2, rel_error=0.03, rope=ROPE)
    path = tmp_path_factory.mktemp("cal") / "model.kvtc"
    path.write_bytes(loaded.data)
    return path, loaded.sha256, loaded.data


def _kvtc(calibration: Any) -> dict[str, str]:
    options = '{"calibration": %s}' % (f'"{calibration}"' if isinstance(calibration, str) else 1)
    return {"accept": FRAME, "x-kvgate-codec": "kvtc", "x-kvgate-codec-options": options}


async def test_a_client_names_a_kvtc_calibration_by_hash_never_by_path(
    client: httpx.AsyncClient, calibration: tuple[Path, str, bytes], tmp_path: Path
) -> None:
    """A path, even to a valid calibration, is refused without being looked at (one answer,
    whatever it names); a hash works once the tiers hold the calibration under its key."""
    path, sha, data = calibration
    registry.forget_all()  # as a fresh server: the calibration is only in the tiers, or not
    try:
        assert (await client.put("/v1/objects/o", content=b"x" * 64)).status_code == 204
        details = set()
        for named in (str(path), "/etc/passwd", "/nonexistent", str(tmp_path), sha.upper(), 1):
            r = await client.get("/v1/objects/o", headers=_kvtc(named))
            assert r.status_code == 400, (named, r.status_code)
            assert r.json()["error"] == "bad_request"
            details.add(r.json()["detail"])
        assert len(details) == 1, details  # nothing tells what exists on the server's disk
        assert "never by a path" in details.pop()
        assert registry.lookup(sha) is None  # the file was never read
        r = await client.get("/v1/objects/o", headers=_kvtc(sha))
        assert r.status_code == 400
        assert "no calibration" in r.json()["detail"]

        # Bytes under another calibration's key are not that calibration.
        other = "0" * 64
        await client.put(f"/v1/objects/{registry.key_of(other)}", content=data)
        r = await client.get("/v1/objects/o", headers=_kvtc(other))
        assert r.status_code == 400
        assert "not usable" in r.json()["detail"]

        # Stored under its own key (a tier coding with it wrote it, or a client put it).
        put = await client.put(f"/v1/objects/{registry.key_of(sha)}", content=data)
        assert put.status_code == 204
        r = await client.get("/v1/objects/o", headers=_kvtc(sha))
        assert r.status_code == 200, r.text
        assert r.headers["x-kvgate-codec"] == "kvtc"
        assert decode_frame(r.content)[0].raw_len == 64
        assert registry.lookup(sha) is not None
    finally:
        registry.forget_all()


async def test_a_batch_get_over_the_limit_stops_reading_when_it_passes_it(
    tmp_path: Path,
) -> None:
    """Eight 384 KiB objects on disk, a 1 MiB answer limit: the 413 comes after the third
    object is read, not after all eight are in memory."""
    config = {"tiers": [{"url": f"file://{tmp_path}/disk"}]}  # every get reads the disk
    app = create_app(config, max_body=MIB, body_pool=4 * MIB)
    keys = [f"big/{i}" for i in range(8)]
    async with running(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        for i, key in enumerate(keys):
            r = await client.put(f"/v1/objects/{key}", content=bytes([i]) * (384 * KIB))
            assert r.status_code == 204
        assert (await client.post("/v1/flush")).status_code == 204
        disk = app.state.kvgate.store.tiers[0].stats
        before = disk.bytes_read
        r = await client.post("/v1/batch/get", json={"keys": keys})
        assert (r.status_code, r.json()["error"]) == (413, "capacity")
        assert disk.bytes_read - before < 4 * 384 * KIB
        r = await client.post("/v1/batch/get", json={"keys": keys[:2]})
        assert r.status_code == 200  # two fit: the answer's format is unchanged
        assert len(r.content) > 2 * 384 * KIB


async def test_keys_that_are_not_utf8_are_refused_not_merged(client: httpx.AsyncClient) -> None:
    """``k%FF`` and ``k%FE`` both decode to ``k`` + U+FFFD with replacement: each is refused,
    on every object route, with the invalid-key answer; U+FFFD itself is a key like others."""
    for method in ("PUT", "GET", "HEAD", "DELETE"):
        for path in ("/v1/objects/k%FF", "/v1/objects/k%FE", "/v1/objects/a/%C0%80"):
            r = await client.request(method, path, content=b"v" if method == "PUT" else None)
            assert r.status_code == 400, (method, path, r.status_code)
            if method != "HEAD":
                assert r.json()["error"] == "invalid_key"
                assert "not UTF-8" in r.json()["detail"]
    assert (await client.put("/v1/objects/k%EF%BF%BD", content=b"v")).status_code == 204
    assert (await client.get("/v1/objects/k\ufffd")).content == b"v"


async def test_every_control_character_in_a_key_path_is_an_invalid_key(
    client: httpx.AsyncClient,
) -> None:
    """A newline too: starlette's path parameter does not match one (``.``), so such a key
    got the router's 404 "Not Found" on every object route, and a key ending in one was
    stored as the key without it (``$`` matches before a last newline)."""
    for method in ("PUT", "GET", "HEAD", "DELETE"):
        for code in ("%0A", "%0D", "%00", "%09", "%1F", "%7F", "a%0Ab", "%0A%0A"):
            path = f"/v1/objects/k{code}"
            r = await client.request(method, path, content=b"v" if method == "PUT" else None)
            assert r.status_code == 400, (method, path, r.status_code)
            if method != "HEAD":
                assert r.json()["error"] == "invalid_key", (method, path, r.text)
    assert (await client.get("/v1/objects/k")).status_code == 404  # nothing stored as "k"


async def test_a_client_leaving_mid_upload_is_no_server_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No error, no traceback (ours or uvicorn's); nothing stored and no memory kept."""
    app = create_app(store_config(tmp_path), max_body=4 * MIB, body_pool=4 * MIB)
    state = app.state.kvgate
    uvicorn_log = logging.getLogger("uvicorn.error")  # uvicorn's loggers do not propagate
    uvicorn_log.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG)
    try:
        async with running(app) as url:
            port = int(url.rsplit(":", 1)[1])
            for media in ("application/octet-stream", FRAME):  # store's memory, body pool
                head = (
                    b"PUT /v1/objects/gone HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\n"
                    b"Content-Length: %d\r\n\r\n" % (media.encode(), 2 * MIB)
                )
                sock = await asyncio.to_thread(_raw_request, port, head + b"x" * (256 * KIB))
                for _ in range(200):  # until the server reads the body
                    if state.body_budget.used:
                        break
                    await asyncio.sleep(0.01)
                sock.close()
                for _ in range(300):
                    if not state.body_budget.used:
                        break
                    await asyncio.sleep(0.01)
                assert state.body_budget.used == 0
                assert state.body_pool.used == 0
                assert state.store.pool.used == 0
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                assert (await client.get("/v1/objects/gone")).status_code == 404
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [f"{r.name}: {r.getMessage()}" for r in loud]
