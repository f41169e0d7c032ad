"""The HTTP service over a real socket: uvicorn on loopback, httpx as the client."""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import pytest_asyncio
import torch
from prometheus_client.parser import text_string_to_metric_families
from servers.asgi import serve
from servers.proc import free_port

from gateway.codec import encode_frame
from gateway.frame import decode_frame, encode_header
from gateway.http.app import create_app
from gateway.lmcache.server import lm_serving
from gateway.objects import to_object_data
from gateway.registry import load_codec

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops

FRAME = "application/vnd.kvgate.frame"
LIMIT = 8 << 20


def store_config(tmp_path: Path) -> dict[str, Any]:
    return {
        "tiers": [{"url": "memory://", "capacity": 64 << 20}, {"url": f"file://{tmp_path}/disk"}]
    }


@pytest_asyncio.fixture
async def base_url(tmp_path: Path) -> AsyncIterator[str]:
    app = create_app(store_config(tmp_path), max_body=LIMIT, body_pool=16 << 20)
    async for url in serve(app):
        yield url


@pytest_asyncio.fixture
async def client(base_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as c:
        yield c


async def test_object_round_trip_bytes(client: httpx.AsyncClient) -> None:
    key = "llama@1@0@-1a2b@bfloat16"
    assert (await client.put(f"/v1/objects/{key}", content=b"hello")).status_code == 204
    r = await client.get(f"/v1/objects/{key}")
    assert r.status_code == 200
    assert r.content == b"hello"
    assert r.headers["x-kvgate-kind"] == "bytes"
    assert r.headers["content-type"] == "application/octet-stream"
    head = await client.head(f"/v1/objects/{key}")
    assert head.status_code == 200
    assert head.headers["content-length"] == "5"
    assert head.headers["x-kvgate-kind"] == "bytes"
    assert (await client.delete(f"/v1/objects/{key}")).status_code == 204
    r = await client.get(f"/v1/objects/{key}")
    assert r.status_code == 404
    assert r.json()["error"] == "not_found"
    assert (await client.head(f"/v1/objects/{key}")).status_code == 404
    assert (await client.delete(f"/v1/objects/{key}")).status_code == 404


async def test_bf16_tensor_round_trip(client: httpx.AsyncClient) -> None:
    t = torch.randn(2, 3, 8, 16, dtype=torch.float32).to(torch.bfloat16)
    body = t.view(torch.uint8).numpy().tobytes()
    headers = {"x-kvgate-dtype": "bfloat16", "x-kvgate-shape": "2,3,8,16", "x-kvgate-format": "1"}
    assert (await client.put("/v1/objects/t", content=body, headers=headers)).status_code == 204
    r = await client.get("/v1/objects/t")
    assert r.content == body
    assert r.headers["x-kvgate-kind"] == "tensor"
    assert r.headers["x-kvgate-dtype"] == "bfloat16"
    assert r.headers["x-kvgate-shape"] == "2,3,8,16"
    assert r.headers["x-kvgate-format"] == "1"
    back = torch.frombuffer(bytearray(r.content), dtype=torch.bfloat16).reshape(2, 3, 8, 16)
    assert torch.equal(back, t)
    # The same object as a raw frame: verified, the payload is the tensor's bytes.
    r = await client.get("/v1/objects/t", headers={"accept": FRAME})
    assert r.headers["content-type"] == FRAME
    header, payload = decode_frame(r.content)
    assert (header.codec, header.kind, header.dtype, header.shape) == (
        "raw",
        "tensor",
        "bfloat16",
        [2, 3, 8, 16],
    )
    assert bytes(payload) == body


async def test_ndarray_kind_and_ttl(client: httpx.AsyncClient) -> None:
    arr = np.arange(12, dtype=np.int32)
    headers = {"x-kvgate-kind": "ndarray", "x-kvgate-dtype": "int32", "x-kvgate-ttl": "60"}
    r = await client.put("/v1/objects/a", content=arr.tobytes(), headers=headers)
    assert r.status_code == 204
    r = await client.get("/v1/objects/a")
    assert r.headers["x-kvgate-kind"] == "ndarray"
    assert r.headers["x-kvgate-shape"] == "12"
    assert np.array_equal(np.frombuffer(r.content, np.int32), arr)


async def test_frame_put_is_decoded_and_kept_exact(client: httpx.AsyncClient) -> None:
    t = torch.randn(4, 64, dtype=torch.float16)
    head, parts, _ = encode_frame(load_codec("zstd"), to_object_data(t, fmt=2))
    blob = head + b"".join(parts)
    r = await client.put("/v1/objects/f", content=blob, headers={"content-type": FRAME})
    assert r.status_code == 204
    r = await client.get("/v1/objects/f")
    assert r.content == t.numpy().tobytes()
    assert (r.headers["x-kvgate-dtype"], r.headers["x-kvgate-format"]) == ("float16", "2")
    # A frame with one flipped payload byte is the client's error, never stored.
    bad = bytearray(blob)
    bad[-1] ^= 0xFF
    r = await client.put("/v1/objects/g", content=bytes(bad), headers={"content-type": FRAME})
    assert r.status_code == 400
    assert "checksum" in r.json()["detail"]
    assert (await client.get("/v1/objects/g")).status_code == 404
    r = await client.put("/v1/objects/g", content=b"KVGF", headers={"content-type": FRAME})
    assert r.status_code == 400


async def test_kivi_frame_get_crosses_compressed(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_KERNELS", "reference")  # numba would compile for seconds
    kv = torch.randn(2, 2, 128, 256, dtype=torch.float16)  # KV_2LTD: [2, layers, tokens, hidden]
    headers = {"x-kvgate-dtype": "float16", "x-kvgate-shape": "2,2,128,256", "x-kvgate-format": "1"}
    r = await client.put("/v1/objects/kv", content=kv.numpy().tobytes(), headers=headers)
    assert r.status_code == 204
    asked = {"accept": FRAME, "x-kvgate-codec": "kivi", "x-kvgate-codec-options": '{"bits": 4}'}
    r = await client.get("/v1/objects/kv", headers=asked)
    assert r.status_code == 200
    assert r.headers["x-kvgate-codec"] == "kivi"
    assert len(r.content) < kv.numel() * 2 / 3  # 4-bit codes and scales vs 16-bit values
    header, payload = decode_frame(r.content)
    assert header.codec == "kivi"
    assert header.params["bits"] == 4
    raw = load_codec("kivi").decode(payload, header, None)
    back = torch.frombuffer(bytearray(raw), dtype=torch.float16).reshape(kv.shape)
    assert ((back.float() - kv.float()).norm() / kv.float().norm()).item() < 0.2
    # The frame goes back in as is under its own key: the gateway:// connector's round trip.
    frame = r.content
    r = await client.put("/v1/objects/kv", content=frame, headers={"content-type": FRAME})
    assert r.status_code == 204
    assert (await client.get("/v1/objects/kv")).content == bytes(raw)
    # It is bound to that key: under another one it is refused, and nothing is stored.
    r = await client.put("/v1/objects/kv2", content=frame, headers={"content-type": FRAME})
    assert r.status_code == 400
    assert "another key" in r.json()["detail"]
    assert (await client.get("/v1/objects/kv2")).status_code == 404


async def test_codec_errors_are_the_clients(client: httpx.AsyncClient) -> None:
    await client.put("/v1/objects/x", content=b"abc")
    for headers in (
        {"accept": FRAME, "x-kvgate-codec": "nope"},
        {"accept": FRAME, "x-kvgate-codec": "kivi", "x-kvgate-codec-options": "{"},
        {"accept": FRAME, "x-kvgate-codec": "kivi", "x-kvgate-codec-options": "[1]"},
        {"accept": FRAME, "x-kvgate-codec": "kivi", "x-kvgate-codec-options": '{"bits": 3}'},
        {"accept": FRAME, "x-kvgate-codec": "kivi", "x-kvgate-codec-options": '{"zap": 1}'},
    ):
        r = await client.get("/v1/objects/x", headers=headers)
        assert r.status_code == 400, (headers, r.text)
        assert r.json()["error"] == "bad_request"
    r = await client.get("/v1/objects/x", headers={"accept": FRAME, "x-kvgate-codec": "zstd"})
    assert r.status_code == 200
    assert r.headers["x-kvgate-codec"] == "zstd"


async def test_malformed_keys_and_headers_are_400(client: httpx.AsyncClient) -> None:
    cases: list[tuple[str, dict[str, str], bytes]] = [
        ("/v1/objects/" + "k" * 2000, {}, b"x"),
        ("/v1/objects/a%01b", {}, b"x"),
        ("/v1/objects/t", {"x-kvgate-dtype": "float32", "x-kvgate-shape": "5"}, b"abc"),
        ("/v1/objects/t", {"x-kvgate-dtype": "float32", "x-kvgate-shape": "a,b"}, b"abcd"),
        ("/v1/objects/t", {"x-kvgate-dtype": "float32", "x-kvgate-shape": "-4"}, b"abcd"),
        ("/v1/objects/t", {"x-kvgate-dtype": "float32"}, b"abc"),
        ("/v1/objects/t", {"x-kvgate-kind": "pickle"}, b"abc"),
        ("/v1/objects/t", {"x-kvgate-kind": "bytes", "x-kvgate-dtype": "float32"}, b"abcd"),
        ("/v1/objects/t", {"x-kvgate-ttl": "soon"}, b"abc"),
        ("/v1/objects/t", {"x-kvgate-ttl": "-1"}, b"abc"),
        ("/v1/objects/t", {"x-kvgate-format": "x"}, b"abc"),
        ("/v1/objects/t", {"x-kvgate-format": "999"}, b"abc"),
        ("/v1/objects/t", {"content-type": "text/plain"}, b"abc"),
    ]
    for path, headers, body in cases:
        r = await client.put(path, content=body, headers=headers)
        assert r.status_code == 400, (path, headers, r.text)
        assert set(r.json()) == {"error", "detail"}
    r = await client.put("/v1/objects/t", content=b"abcd", headers={"x-kvgate-dtype": "nope"})
    assert r.status_code == 415
    assert (await client.get("/v1/objects/a%01b")).status_code == 400
    r = await client.post("/v1/lookup", content=b"{not json")
    assert r.status_code == 400
    r = await client.post("/v1/lookup", json={"keys": "k"})
    assert r.status_code == 400
    r = await client.post("/v1/nope")
    assert (r.status_code, r.json()["error"]) == (404, "not_found")


def _frame(**fields: Any) -> bytes:
    base: dict[str, Any] = {"codec": "raw", "kind": "tensor", "dtype": "uint8", "shape": [2]}
    base |= {"raw_len": 2, "payload": b"ab"} | fields
    head, _ = encode_header(**base)
    return head + bytes(base["payload"])


async def test_object_headers_and_frames_out_of_the_limits_are_4xx(
    client: httpx.AsyncClient,
) -> None:
    """Every object is checked as a put from Python is: never a 500, never a 204 for an
    object that a lower tier would refuse."""
    ones70 = ",".join(["1"] * 70)
    cases: list[tuple[dict[str, str], bytes, int]] = [
        ({"x-kvgate-dtype": "float16", "x-kvgate-shape": "9223372036854775808,0"}, b"", 400),
        ({"x-kvgate-kind": "ndarray", "x-kvgate-shape": ones70}, b"x", 400),
        ({"x-kvgate-dtype": "uint8", "x-kvgate-shape": ones70}, b"x", 400),
        ({"x-kvgate-format": "9"}, b"x", 400),
        ({"x-kvgate-ttl": "nan"}, b"x", 400),
        ({"x-kvgate-ttl": "inf"}, b"x", 400),
        ({"content-type": FRAME}, _frame(shape=[2**63, 0], raw_len=0, payload=b""), 400),
        ({"content-type": FRAME}, _frame(shape=[1] * 70, raw_len=1, payload=b"a"), 400),
        ({"content-type": FRAME}, _frame(fmt=2**40), 400),
        ({"content-type": FRAME}, _frame(ttl=float("nan")), 400),
        ({"content-type": FRAME}, _frame(ttl=-5.0), 400),
    ]
    for headers, body, status in cases:
        r = await client.put("/v1/objects/bad", content=body, headers=headers)
        assert r.status_code == status, (headers, r.text)
        assert set(r.json()) == {"error", "detail"}
    assert (await client.get("/v1/objects/bad")).status_code == 404
    # An empty tensor is an object like any other.
    r = await client.put("/v1/objects/empty", content=b"", headers={"x-kvgate-dtype": "float16"})
    assert r.status_code == 204
    r = await client.get("/v1/objects/empty")
    assert (r.content, r.headers["x-kvgate-shape"], r.headers["x-kvgate-dtype"]) == (
        b"",
        "0",
        "float16",
    )
    # numpy has no bfloat16: the answer says what is missing (torch is installed here).
    headers = {"x-kvgate-kind": "ndarray", "x-kvgate-dtype": "bfloat16"}
    r = await client.put("/v1/objects/bf", content=b"ab", headers=headers)
    assert (r.status_code, r.json()["error"]) == (415, "missing_dependency")
    assert "ml_dtypes" in r.json()["detail"]
    assert "torch, which is not installed" not in r.json()["detail"]


def _raw_request(port: int, head: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(head)
    return sock


def _read_status(sock: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1])


async def test_oversized_body_refused_before_it_is_read(
    client: httpx.AsyncClient, base_url: str
) -> None:
    port = int(base_url.rsplit(":", 1)[1])
    # Declared too large: the answer comes although not one byte of the body was sent.
    head = (
        b"PUT /v1/objects/big HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n" % (1 << 40)
    )
    sock = await asyncio.to_thread(_raw_request, port, head)
    with sock:
        assert await asyncio.to_thread(_read_status, sock) == 413
    # Chunked (no length): refused once the count passes the limit, long before the end.
    head = (
        b"PUT /v1/objects/big HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Type: application/octet-stream\r\n\r\n"
    )
    sock = await asyncio.to_thread(_raw_request, port, head)
    with sock:
        chunk = b"%x\r\n" % (1 << 20) + b"x" * (1 << 20) + b"\r\n"
        for _ in range(LIMIT // (1 << 20) + 1):  # one MiB past the limit, of a "huge" body
            await asyncio.to_thread(sock.sendall, chunk)
        assert await asyncio.to_thread(_read_status, sock) == 413
    # httpx, with a length: 413 too, and the service still works afterwards.
    r = await client.put("/v1/objects/big", content=b"x" * (LIMIT + 1))
    assert r.status_code == 413
    assert r.json()["error"] == "capacity"
    r = await client.put("/v1/objects/fits", content=b"x" * LIMIT)
    assert r.status_code == 204
    assert len((await client.get("/v1/objects/fits")).content) == LIMIT


async def test_lookup_prefix_and_tiers(client: httpx.AsyncClient) -> None:
    for k in ("k0", "k1", "k3"):
        await client.put(f"/v1/objects/{k}", content=k.encode())
    await client.post("/v1/flush")
    r = await client.post("/v1/lookup", json={"keys": ["k0", "k1", "k2", "k3"]})
    assert r.status_code == 200
    assert r.json() == {
        "prefix": 2,
        "tiers": [{"tier": "memory", "hits": 2}, {"tier": "file", "hits": 0}],
    }


async def test_exists_answers_every_key_in_order(client: httpx.AsyncClient) -> None:
    for k in ("k0", "k1", "k3"):
        await client.put(f"/v1/objects/{k}", content=k.encode())
    await client.post("/v1/flush")
    keys = ["k0", "k2", "k3", "k1", "k2", "k0"]
    r = await client.post("/v1/exists", json={"keys": keys})
    assert r.status_code == 200
    assert r.json() == {"exists": [True, False, True, True, False, True]}
    assert (await client.post("/v1/exists", json={"keys": []})).json() == {"exists": []}
    r = await client.post("/v1/exists", json={"keys": ["bad\nkey"]})
    assert r.status_code == 400
    assert r.json()["error"] == "invalid_key"


def _entries(items: list[tuple[str, bytes]]) -> bytes:
    out = b""
    for key, frame in items:
        raw = key.encode()
        out += struct.pack("<H", len(raw)) + raw + struct.pack("<Q", len(frame)) + frame
    return out


def _split(blob: bytes) -> list[tuple[str, bytes | None]]:
    out: list[tuple[str, bytes | None]] = []
    at = 0
    while at < len(blob):
        (klen,) = struct.unpack_from("<H", blob, at)
        key = blob[at + 2 : at + 2 + klen].decode()
        (flen,) = struct.unpack_from("<Q", blob, at + 2 + klen)
        at += 2 + klen + 8
        if flen == 2**64 - 1:
            out.append((key, None))
            continue
        out.append((key, blob[at : at + flen]))
        at += flen
    return out


async def test_batch_put_and_get(client: httpx.AsyncClient) -> None:
    objs = {f"b{i}": torch.full((64,), float(i), dtype=torch.bfloat16) for i in range(3)}
    frames = []
    for key, t in objs.items():
        head, parts, _ = encode_frame(load_codec("raw"), to_object_data(t))
        frames.append((key, head + b"".join(parts)))
    r = await client.post(
        "/v1/batch/put",
        content=_entries(frames),
        headers={"content-type": "application/vnd.kvgate.frames"},
    )
    assert r.status_code == 204
    r = await client.post("/v1/batch/get", json={"keys": ["b0", "missing", "b2"]})
    assert r.status_code == 200
    got = _split(r.content)
    assert [k for k, _ in got] == ["b0", "missing", "b2"]
    assert got[1][1] is None
    for key, blob in (got[0], got[2]):
        assert blob is not None
        header, payload = decode_frame(blob)
        assert header.dtype == "bfloat16"
        assert bytes(payload) == objs[key].view(torch.uint8).numpy().tobytes()
    # Truncated entries and corrupt frames are refused with the entry named.
    r = await client.post("/v1/batch/put", content=_entries(frames)[:-5])
    assert r.status_code == 400
    r = await client.post("/v1/batch/put", content=_entries([("z", b"KVGF" + bytes(60))]))
    assert r.status_code == 400
    assert "entry 0" in r.json()["detail"]


async def test_flush_tiers_health_metrics(client: httpx.AsyncClient) -> None:
    await client.put("/v1/objects/a", content=b"1" * 1000)
    assert (await client.post("/v1/flush")).status_code == 204
    await client.get("/v1/objects/a")
    await client.get("/v1/objects/none")
    tiers = (await client.get("/v1/tiers")).json()["tiers"]
    assert [t["name"] for t in tiers] == ["memory", "file"]
    memory, disk = tiers
    assert memory["capacity_bytes"] == 64 << 20
    assert memory["used_bytes"] >= 1000
    assert disk["state"] == "up"
    assert disk["breaker"] == "closed"
    assert disk["bytes_written"] > 1000
    assert disk["queue_depth"] == 0
    assert disk["queue_size"] == 64
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    assert (await client.get("/readyz")).json() == {"status": "ready"}
    r = await client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    hits = {s.labels["tier"]: s.value for s in families["kvgate_tier_hits"].samples}
    assert hits["memory"] >= 1
    written = families["kvgate_tier_written_bytes"].samples
    assert any(s.labels == {"tier": "file"} and s.value > 1000 for s in written)
    latency = families["kvgate_tier_latency_seconds"].samples
    assert any(s.labels.get("tier") == "file" and s.labels.get("op") == "put" for s in latency)
    assert "kvgate_tier_queue_depth" in families
    breaker = families["kvgate_tier_breaker_state"].samples
    assert {"tier": "file", "state": "closed"} in [s.labels for s in breaker if s.value == 1]
    for family in families.values():  # one label set everywhere: tier first
        for sample in family.samples:
            assert "tier" in sample.labels


async def test_openapi_documents_the_contract(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    paths = doc["paths"]
    for path in (
        "/v1/objects/{key}",
        "/v1/lookup",
        "/v1/batch/get",
        "/v1/batch/put",
        "/v1/flush",
        "/v1/tiers",
        "/healthz",
        "/readyz",
        "/metrics",
    ):
        assert path in paths, path
    put = paths["/v1/objects/{key}"]["put"]
    assert set(put["requestBody"]["content"]) == {"application/octet-stream", FRAME}
    assert "key_len u16" in json.dumps(paths["/v1/batch/get"])


async def test_readyz_waits_for_the_store(tmp_path: Path) -> None:
    # Before the lifespan ran (no server), the state says not ready; once served it is.
    app = create_app({"tiers": [{"url": f"file://{tmp_path}/only"}]}, body_pool=0)
    assert not app.state.kvgate.ready
    async for url in serve(app):
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.get("/readyz")
            assert r.json() == {"status": "ready"}
            r = await c.put("/v1/objects/k", content=b"v")  # no L1, no body pool: still works
            assert r.status_code == 204
            assert (await c.get("/v1/objects/k")).content == b"v"
    assert not app.state.kvgate.ready


@pytest.mark.parametrize("size", [0, 1, 5 << 20])
async def test_sizes(client: httpx.AsyncClient, size: int) -> None:
    body = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert (await client.put("/v1/objects/s", content=body)).status_code == 204
    assert (await client.get("/v1/objects/s")).content == body


async def test_lm_server_lives_and_dies_with_the_app() -> None:
    lm_port = free_port()
    lm = functools.partial(lm_serving, host="127.0.0.1", port=lm_port)
    app = create_app({"tiers": [{"url": "memory://", "capacity": 8 << 20}]}, companions=[lm])
    async for url in serve(app):
        _, writer = await asyncio.open_connection("127.0.0.1", lm_port)
        writer.close()
        await writer.wait_closed()
        async with httpx.AsyncClient(base_url=url) as c:
            assert (await c.get("/readyz")).status_code == 200
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", lm_port)
