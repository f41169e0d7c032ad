"""kvgate's lm:// server, driven by a raw-socket client and by LMCache's own lm:// client.

Every test runs a real server (``serve_lm`` over a memory-only Store) on a loopback port and
talks to it over real sockets: every command, headers that are malformed, truncated or
oversized, a client that vanishes mid-payload, concurrent and pipelined clients.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from servers.lm_raw import KEY, Server, put, raw_header
from servers.lmcache import ENV as LMCACHE_ENV
from servers.lmcache import lmcache_venv, run_lmcache_client
from servers.proc import free_port

from gateway.lmcache.server import STAGE_FROM, close_lm, serve_lm
from gateway.lmcache.wire import (
    KVGATE_MARK,
    REPLY,
    REQUEST,
    TOMBSTONE_SHAPE,
    Code,
    Command,
    Format,
    Reply,
    Request,
    encode_request,
)
from gateway.store import Store

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops

torch = pytest.importorskip("torch")

MAX_PAYLOAD = 8 << 20


@pytest_asyncio.fixture
async def server() -> AsyncIterator[Server]:
    cfg = {"tiers": [{"url": "memory://", "capacity": 64 << 20}], "prefault": False}
    async with Store(cfg) as store:
        port = free_port()
        srv = await serve_lm(store, "127.0.0.1", port, max_payload=MAX_PAYLOAD, max_connections=8)
        try:
            yield Server(store, port)
        finally:
            await close_lm(srv)


async def test_health_and_list(server: Server) -> None:
    client = await server.connect()
    reply, _ = await client.ask(Request(Command.HEALTH, ""))
    assert reply.code == Code.OK
    assert reply.shape[3] == KVGATE_MARK
    reply, payload = await client.ask(Request(Command.LIST, ""))  # the stock server hangs here
    assert (reply.code, payload) == (Code.OK, b"")
    await client.close()


async def test_put_get_exist_keep_format_dtype_shape(server: Server) -> None:
    src = torch.arange(2 * 3 * 4 * 8, dtype=torch.float32).reshape(2, 3, 4, 8).to(torch.bfloat16)
    payload = src.view(torch.uint8).numpy().tobytes()
    client = await server.connect()
    assert (await client.ask(Request(Command.EXIST, KEY)))[0].code == Code.FAIL
    miss, body = await client.ask(Request(Command.GET, KEY))
    assert (miss.code, miss.length, body) == (Code.FAIL, 0, b"")
    await client.send(put(KEY, payload, Format.KV_2LTD, 3, (2, 3, 4, 8)))  # no reply
    assert (await client.ask(Request(Command.EXIST, KEY)))[0].code == Code.OK
    reply, body = await client.ask(Request(Command.GET, KEY))
    assert reply == Reply(Code.OK, len(payload), Format.KV_2LTD, 3, (2, 3, 4, 8))
    assert body == payload
    # The Store (and so kvgate's HTTP API) sees the same object, as a tensor.
    stored = await server.store.get(KEY)
    assert isinstance(stored, torch.Tensor)
    assert stored.dtype == torch.bfloat16
    assert torch.equal(stored, src)
    await client.close()


@pytest.mark.parametrize(
    ("dtype", "shape", "length", "want_dtype", "want_shape"),
    [
        (6, (10, 0, 0, 0), 10, 6, (10, 0, 0, 0)),  # BINARY-style uint8 [len, 0, 0, 0]
        (2, (3, 0, 0, 0), 7, 6, (7, 0, 0, 0)),  # the shape does not fit: stored as bytes
        (0, (0, 0, 0, 0), 5, 6, (5, 0, 0, 0)),  # no dtype: bytes
        (2, (0, 0, 0, 0), 0, 2, (0, 0, 0, 0)),  # empty
        (1, (2, 2, 0, 0), 8, 2, (2, 2, 0, 0)),  # "half" comes back as float16's code, like LMCache
    ],
)
async def test_stored_forms(
    server: Server,
    dtype: int,
    shape: tuple[int, ...],
    length: int,
    want_dtype: int,
    want_shape: tuple[int, ...],
) -> None:
    payload = bytes(range(length))
    client = await server.connect()
    await client.send(put(KEY, payload, Format.BINARY, dtype, shape))
    reply, body = await client.ask(Request(Command.GET, KEY))
    assert (reply.code, reply.fmt, reply.dtype, reply.shape) == (
        Code.OK,
        Format.BINARY,
        want_dtype,
        want_shape,
    )
    assert body == payload
    await client.close()


async def test_objects_put_through_the_store_are_served(server: Server) -> None:
    await server.store.put(KEY, b"plain bytes")
    await server.store.put("m@1@0@1@int32", np.arange(6, dtype=np.int32).reshape(2, 3))
    await server.store.put("m@1@0@2@half", torch.ones(1, 2, 3, 4, 5, dtype=torch.float16))
    client = await server.connect()
    reply, body = await client.ask(Request(Command.GET, KEY))
    assert (reply.dtype, reply.shape, body) == (6, (11, 0, 0, 0), b"plain bytes")
    reply, body = await client.ask(Request(Command.GET, "m@1@0@1@int32"))  # no wire code: uint8
    assert (reply.dtype, reply.shape, body) == (
        6,
        (24, 0, 0, 0),
        np.arange(6, dtype=np.int32).tobytes(),
    )
    reply, _ = await client.ask(Request(Command.GET, "m@1@0@2@half"))  # 5 dims: uint8 too
    assert (reply.dtype, reply.shape) == (6, (240, 0, 0, 0))
    await client.close()


async def test_objects_only_a_lower_tier_holds_are_served(tmp_path: Path) -> None:
    """Served from the disk tier's bytes (no memory tier): a tensor larger than a socket
    buffer, so it goes out by the large-payload path, and bytes."""
    big = torch.arange(2 * 4 * 64 * 512, dtype=torch.float16).reshape(2, 4, 64, 512)
    disk = {"url": f"file://{tmp_path}/disk"}
    cfg = {"tiers": [disk], "prefault": False}
    async with Store(cfg) as store:
        await store.put("m@1@0@3@half", big, fmt=Format.KV_2LTD, durable=True)
        await store.put(KEY, b"from the disk", durable=True)
        port = free_port()
        srv = await serve_lm(store, "127.0.0.1", port, max_payload=MAX_PAYLOAD)
        try:
            client = await Server(store, port).connect()
            reply, body = await client.ask(Request(Command.GET, "m@1@0@3@half"))
            assert reply == Reply(Code.OK, big.numel() * 2, Format.KV_2LTD, 2, (2, 4, 64, 512))
            assert body == big.view(torch.uint8).numpy().tobytes()
            reply, body = await client.ask(Request(Command.GET, KEY))
            assert (reply.dtype, reply.shape, body) == (6, (13, 0, 0, 0), b"from the disk")
            await client.close()
        finally:
            await close_lm(srv)


async def test_tombstone_deletes(server: Server) -> None:
    client = await server.connect()
    await client.send(put(KEY, b"abc", Format.BINARY, 6, (3,)))
    assert (await client.ask(Request(Command.EXIST, KEY)))[0].code == Code.OK
    await client.send(encode_request(Request(Command.PUT, KEY, 0, 0, 0, TOMBSTONE_SHAPE)))
    assert (await client.ask(Request(Command.EXIST, KEY)))[0].code == Code.FAIL
    assert await server.store.get(KEY) is None
    await client.close()


async def test_invalid_key_is_a_miss_and_keeps_the_connection(server: Server) -> None:
    client = await server.connect()
    await client.send(put("not a key", b"12345", Format.BINARY, 6, (5,)))  # read, then dropped
    assert (await client.ask(Request(Command.GET, "not a key")))[0].code == Code.FAIL
    assert (await client.ask(Request(Command.EXIST, "m@1@0@0X1F@half")))[0].code == Code.FAIL
    assert (await client.ask(Request(Command.HEALTH, "")))[0].code == Code.OK
    await client.close()


async def test_a_put_over_max_payload_is_dropped_and_the_connection_goes_on(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """PUT has no reply to refuse it with: one over ``max_payload`` has its payload read and
    dropped, and the connection goes on with the next request. The key holds nothing after
    it (an older object under it is deleted: the PUT replaced it), so a client's EXIST tells
    it the PUT was not stored. The operator gets one log line, not one per PUT."""
    caplog.set_level(logging.WARNING, logger="kvgate.lmserver")
    other = "llama@1@0@def456@bfloat16"
    big = bytes(range(256)) * ((MAX_PAYLOAD + 1024) // 256)
    client = await server.connect()
    await client.send(put(other, b"kept", Format.BINARY, 6, (4,)))
    await client.send(put(KEY, b"older", Format.BINARY, 6, (5,)))
    for key in (KEY, "not a key", KEY):  # an invalid key's is dropped the same way
        await client.send(put(key, big, Format.BINARY, 6, (len(big),)))
    reply, body = await client.ask(Request(Command.GET, other))  # read in its place
    assert (reply.code, body) == (Code.OK, b"kept")
    assert (await client.ask(Request(Command.EXIST, other)))[0].code == Code.OK
    assert (await client.ask(Request(Command.EXIST, KEY)))[0].code == Code.FAIL
    await client.send(put(KEY, b"newer", Format.BINARY, 6, (5,)))
    reply, body = await client.ask(Request(Command.GET, KEY))
    assert (reply.code, body) == (Code.OK, b"newer")
    await client.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "kvgate.lmserver"]
    assert len(lines) == 1, lines
    assert "max_payload" in lines[0]


@pytest.mark.parametrize(
    "header",
    [
        raw_header(9, 0),  # unknown command
        raw_header(0, 0),
        raw_header(Command.PUT, -1),  # negative length
        raw_header(Command.GET, 0, fmt=99),  # unknown memory format
        raw_header(Command.GET, 0, dtype=42),  # unknown dtype code
        REQUEST.pack(2, 0, 1, 3, 7, 0, 0, 0, 0, KEY.encode().ljust(150)),  # unknown location
        REQUEST.pack(1, 4, 1, 3, 0, -2, 0, 0, 0, KEY.encode().ljust(150)),  # negative dim
        REQUEST.pack(2, 0, 1, 3, 0, 0, 0, 0, 0, b"\xff" * 150),  # key not UTF-8
    ],
)
async def test_malformed_header_closes_only_that_connection(server: Server, header: bytes) -> None:
    bystander = await server.connect()
    client = await server.connect()
    await client.send(header)
    assert await client.closed_by_server()
    await client.close()
    assert (await bystander.ask(Request(Command.HEALTH, "")))[0].code == Code.OK
    fresh = await server.connect()
    assert (await fresh.ask(Request(Command.HEALTH, "")))[0].code == Code.OK
    await fresh.close()
    await bystander.close()


@pytest.mark.parametrize("cut", [0, 1, 100, REQUEST.size + 10])
async def test_truncated_request_or_payload_then_disconnect(server: Server, cut: int) -> None:
    message = put(KEY, b"x" * 1000, Format.BINARY, 6, (1000,))
    client = await server.connect()
    await client.send(message[:cut])
    await client.close()  # gone mid-header or mid-payload
    fresh = await server.connect()
    assert (await fresh.ask(Request(Command.HEALTH, "")))[0].code == Code.OK
    assert (await fresh.ask(Request(Command.EXIST, KEY)))[0].code == Code.FAIL  # nothing stored
    await fresh.close()


async def test_a_large_payload_cut_short_gives_the_store_its_memory_back(server: Server) -> None:
    """A large tensor payload is received into the store's memory (``STAGE_FROM``); a client
    that goes away mid-payload leaves nothing stored and none of that memory held."""
    pool = server.store.pool
    assert pool is not None
    before = pool.used
    size = 2 * STAGE_FROM
    message = put(KEY, b"\x01" * size, Format.KV_2LTD, 3, (size // 2,))
    client = await server.connect()
    await client.send(message[: REQUEST.size + size // 3])
    for _ in range(100):  # the server reads what was sent before it sees the close
        if pool.used > before:
            break
        await asyncio.sleep(0.01)
    assert pool.used > before  # the payload's slab, reserved from the store's pool
    await client.close()
    for _ in range(200):
        if pool.used == before:
            break
        await asyncio.sleep(0.01)
    assert pool.used == before
    fresh = await server.connect()
    assert (await fresh.ask(Request(Command.EXIST, KEY)))[0].code == Code.FAIL
    await fresh.send(message)  # whole, on a connection of its own: stored
    reply, body = await fresh.ask(Request(Command.GET, KEY))
    assert (reply.code, body) == (Code.OK, b"\x01" * size)
    await fresh.close()


async def test_stalled_declarations_cost_the_cache_at_most_an_eighth(server: Server) -> None:
    """Payloads are received into the store's pool from their declaration on, but all of them
    together hold at most an eighth of it (``StagingAllowance``): headers that declare large
    tensors and then stall make the memory tier evict at most that much."""
    store = server.store
    pool = store.pool
    assert pool is not None
    chunk = 1 << 20
    cached = [f"llama@1@0@{i:x}@bfloat16" for i in range(62)]  # 62 of the 64 MiB memory tier
    for key in cached:
        await store.put(key, np.full(chunk, 7, np.uint8))
    before = pool.used
    size = 4 << 20
    clients = []
    for i in range(4):  # 16 MiB declared, 8 MiB (an eighth of 64) may be staged
        client = await server.connect()
        key = f"llama@1@0@{0xFF00 + i:x}@bfloat16"
        await client.send(
            encode_request(Request(Command.PUT, key, size, 1, 3, (size // 2, 0, 0, 0)))
        )
        clients.append(client)
    await asyncio.sleep(0.2)
    assert pool.used - before <= pool.capacity // 8
    assert sum([await store.contains(k) for k in cached]) >= 62 - 8
    for client in clients:
        await client.close()


async def test_half_closed_client_never_hangs(server: Server) -> None:
    """A client that sends half a header and waits gets its connection closed at EOF."""
    client = await server.connect()
    await client.send(raw_header(Command.GET, 0)[:50])
    client.writer.write_eof()
    assert await client.closed_by_server()
    await client.close()


async def test_pipelined_requests(server: Server) -> None:
    client = await server.connect()
    keys = [f"m@1@0@{i:x}@uint8" for i in range(1, 4)]
    message = b"".join(put(k, k.encode() * 100, Format.BINARY, 6, (len(k) * 100,)) for k in keys)
    message += b"".join(encode_request(Request(Command.GET, k)) for k in keys)
    await client.send(message)
    for k in keys:
        reply, body = await client.reply()
        assert reply.code == Code.OK
        assert body == k.encode() * 100
    await client.close()


async def test_concurrent_clients(server: Server) -> None:
    async def one(i: int) -> None:
        client = await server.connect()
        key = f"m@1@0@{i + 1:x}@uint8"
        payload = bytes([i]) * ((256 << 10) + i)
        for _ in range(3):
            await client.send(put(key, payload, Format.BINARY, 6, (len(payload),)))
            reply, body = await client.ask(Request(Command.GET, key))
            assert reply.code == Code.OK
            assert body == payload
        await client.close()

    await asyncio.gather(*(one(i) for i in range(8)))


async def test_connections_over_the_limit_are_closed(server: Server) -> None:
    held = [await server.connect() for _ in range(8)]
    for client in held:  # each is served: it holds a slot
        assert (await client.ask(Request(Command.HEALTH, "")))[0].code == Code.OK
    extra = await server.connect()
    assert await extra.closed_by_server()
    await extra.close()
    await held.pop().close()
    await asyncio.sleep(0.05)
    again = await server.connect()
    assert (await again.ask(Request(Command.HEALTH, "")))[0].code == Code.OK
    for client in [*held, again]:
        await client.close()


async def test_large_get_is_sent_whole(server: Server) -> None:
    payload = np.random.default_rng(1).integers(0, 256, 6 << 20, dtype=np.uint8).tobytes()
    client = await server.connect()
    await client.send(put(KEY, payload, Format.KV_2LTD, 6, (2, 3 << 18, 4)))
    reply, body = await client.ask(Request(Command.GET, KEY))
    assert reply.shape == (2, 3 << 18, 4, 0)
    assert body == payload
    await client.close()


async def test_pipelined_large_gets_come_whole_and_in_order(server: Server) -> None:
    """GETs the memory tier answers go out from the protocol callback; a reply the socket
    does not take at once is finished by a task, and the next GET waits for it."""
    rng = np.random.default_rng(7)
    payloads = [rng.integers(0, 256, 6 << 20, dtype=np.uint8).tobytes() for _ in range(2)]
    keys = [f"m@1@0@{i + 1:x}@uint8" for i in range(2)]
    client = await server.connect()
    for key, payload in zip(keys, payloads, strict=True):
        await client.send(put(key, payload, Format.KV_2LTD, 6, (2, 3 << 18, 4)))
        assert (await client.ask(Request(Command.EXIST, key)))[0].code == Code.OK
    order = [0, 1, 1, 0, 0]
    await client.send(b"".join(encode_request(Request(Command.GET, keys[i])) for i in order))
    await asyncio.sleep(0.2)  # the client reads late: the first reply fills the socket
    for i in order:
        reply, body = await client.reply()
        assert reply.code == Code.OK
        assert body == payloads[i]
    await client.close()


def _get_like_lmcaches_client(port: int, key: str) -> tuple[int, bytes, bytes]:
    """A GET the way LMCache's client does it: a blocking socket, the reply header taken with
    one ``recv(36)`` (it does not loop), then the payload with ``recv_into``."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(encode_request(Request(Command.GET, key)))
        head = sock.recv(REPLY.size)
        length = REPLY.unpack(head)[1] if len(head) == REPLY.size else 0
        body = bytearray(length)
        view, got = memoryview(body), 0
        while got < length:
            n = sock.recv_into(view[got:], length - got)
            assert n, "connection closed mid-payload"
            got += n
        return len(head), head, bytes(body)


@pytest.mark.parametrize("size", [100 << 10, 6 << 20])  # through the transport; sent directly
async def test_reply_header_comes_whole_to_a_single_recv(server: Server, size: int) -> None:
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    client = await server.connect()
    await client.send(put(KEY, payload, Format.KV_2LTD, 6, (2, size // 8, 4)))
    assert (await client.ask(Request(Command.EXIST, KEY)))[0].code == Code.OK
    for _ in range(3):
        got, head, body = await asyncio.to_thread(_get_like_lmcaches_client, server.port, KEY)
        assert got == REPLY.size
        assert REPLY.unpack(head)[:2] == (Code.OK, size)
        assert body == payload
    await client.close()


async def test_client_gone_during_a_large_reply_costs_only_its_connection(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    payload = bytes(6 << 20)
    client = await server.connect()
    await client.send(put(KEY, payload, Format.BINARY, 6, (len(payload),)))
    assert (await client.ask(Request(Command.EXIST, KEY)))[0].code == Code.OK
    for _ in range(3):
        await client.send(encode_request(Request(Command.GET, KEY)))
        await client.reader.readexactly(REPLY.size + 1000)  # the reply has begun
        sock = client.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.writer.transport.abort()  # a reset, the rest unread
        await asyncio.sleep(0.05)
        client = await server.connect()
    reply, body = await client.ask(Request(Command.GET, KEY))
    assert (reply.code, len(body)) == (Code.OK, len(payload))
    await client.close()
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


def test_header_sizes_are_lmcaches() -> None:
    assert REQUEST.size == 186
    assert REPLY.size == 36
    packed = encode_request(Request(Command.GET, "k@1@0@1@half"))
    assert struct.unpack("<9i", packed[:36]) == (2, 0, 0, 0, 0, 0, 0, 0, 0)
    assert packed[36:] == b"k@1@0@1@half".ljust(150)


# -- LMCache's own lm:// client (lmcache 0.5.6, from its own venv) --------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
async def test_lmcache_client_puts_and_gets_a_kv_chunk(server: Server, dtype: str) -> None:
    result = await run_lmcache_client(
        ["check", "--port", str(server.port), "--size-mib", "2", "--dtype", dtype]
    )
    assert result["exists"] is True
    assert result["missing_exists"] is False
    assert result["missing_get"] is True
    assert result["equal"] is True
    assert result["fmt"] == Format.KV_2LTD
    assert result["dtype"] == f"torch.{dtype}"
    stored = await server.store.get(result["key"])  # and kvgate sees the chunk as a tensor
    assert isinstance(stored, torch.Tensor)
    assert list(stored.shape) == result["shape"]


async def test_lmcache_clients_connection_survives_a_put_over_max_payload() -> None:
    """LMCache's client opens one connection and never reconnects: a chunk over kvgate's
    max_payload is dropped (EXIST says so) and that connection goes on answering."""
    script = Path(__file__).with_name("lmcache_oversized.py")
    python = lmcache_venv() / "bin" / "python"
    cfg = {"tiers": [{"url": "memory://", "capacity": 32 << 20}], "prefault": False}
    async with Store(cfg) as store:
        other = "kvgate-bench@1@0@5eed0002@bfloat16"  # the script's other key
        await store.put(other, torch.ones(4, dtype=torch.bfloat16), fmt=Format.KV_2LTD)
        port = free_port()
        srv = await serve_lm(store, "127.0.0.1", port, max_payload=1 << 20)
        try:
            proc = await asyncio.create_subprocess_exec(
                str(python),
                str(script),
                "--port",
                str(port),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={**os.environ, **LMCACHE_ENV},
            )
            out, err = await asyncio.wait_for(proc.communicate(), 120.0)
        finally:
            await close_lm(srv)
    assert proc.returncode == 0, err.decode(errors="replace")[-4000:]
    result = json.loads(out.decode().strip().splitlines()[-1])
    assert result["put_bytes"] > 1 << 20
    assert result["other_key"] == other
    assert result["exists_put"] is False  # dropped, not stored
    assert result["exists_other"] is True  # answered on the same connection
