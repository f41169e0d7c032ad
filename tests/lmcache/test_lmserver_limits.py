"""What a hostile or broken lm:// client cannot do to kvgate's lm:// server.

The protocol has no authentication, so its numbers are untrusted: a declared length must not
cost memory before the bytes arrive, a connection must not be held by a request that never
arrives or a reply that is never read, and idle connections must not lock new clients out.
Every test runs a real server on a loopback port and real sockets, on both event loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from servers.lm_raw import IO_LIMIT, KEY, Client, Server, put, raw_header
from servers.proc import free_port

from gateway.lmcache.server import MIN_READ, RECLAIM_IDLE, close_lm, lm_stats, serve_lm
from gateway.lmcache.wire import Code, Command, Request
from gateway.store import Store

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops

GiB = 1 << 30
MiB = 1 << 20


def rss() -> int:
    """This process's resident memory in bytes (the server runs in it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@contextlib.asynccontextmanager
async def serving(**options: Any) -> AsyncIterator[Server]:
    cfg = {"tiers": [{"url": "memory://", "capacity": 64 << 20}], "prefault": False}
    async with Store(cfg) as store:
        port = free_port()
        srv = await serve_lm(store, "127.0.0.1", port, **options)
        try:
            yield Server(store, port, srv)
        finally:
            await close_lm(srv)


async def healthy(server: Server) -> float:
    """Seconds a new client takes to connect and get a HEALTH answer."""
    start = time.monotonic()
    client = await server.connect()
    try:
        reply, _ = await client.ask(Request(Command.HEALTH, ""))
        assert reply.code == Code.OK
    finally:
        await client.close()
    return time.monotonic() - start


async def round_trip(server: Server, key: str, payload: bytes) -> None:
    client = await server.connect()
    try:
        await client.send(put(key, payload, 4, 6, (len(payload),)))
        reply, body = await client.ask(Request(Command.GET, key))
        assert reply.code == Code.OK
        assert body == payload
    finally:
        await client.close()


async def test_declared_lengths_cost_no_memory() -> None:
    """Two PUT headers declaring 1 GiB each, then nothing: no memory taken, the server keeps
    answering and storing for others meanwhile, and the stalled connections are closed after
    request_timeout."""
    async with serving(max_payload=GiB, request_timeout=1.0) as server:
        await healthy(server)  # the first connection's own costs, before measuring
        before = rss()
        attackers = [await server.connect() for _ in range(2)]
        for attacker in attackers:
            await attacker.send(raw_header(Command.PUT, GiB - 1, fmt=4, dtype=6))
        await asyncio.sleep(0.3)
        grown = rss() - before
        assert grown < 64 * MiB, f"RSS grew {grown / MiB:.0f} MiB for declared lengths"
        assert await healthy(server) < IO_LIMIT
        async with asyncio.timeout(0.5):  # a declaration holds no budget: no wait for it
            await round_trip(server, KEY, b"while they stall")
        for attacker in attackers:
            assert await attacker.closed_by_server()
            await attacker.close()


async def test_a_header_that_stops_arriving_is_closed() -> None:
    async with serving(request_timeout=0.5) as server:
        client = await server.connect()
        await client.send(raw_header(Command.EXIST, 0)[:40])
        assert await client.closed_by_server()
        await client.close()


async def test_a_payload_that_stops_arriving_is_closed() -> None:
    async with serving(request_timeout=0.5, max_payload=8 * MiB) as server:
        client = await server.connect()
        await client.send(raw_header(Command.PUT, 4 * MiB, fmt=4, dtype=6), bytes(MiB))
        assert await client.closed_by_server()
        await client.close()
        assert not await server.store.contains(KEY)


async def test_a_trickling_payload_is_closed_and_frees_its_slot() -> None:
    """A PUT that sends a byte now and then, never stalling for request_timeout, falls behind
    its pace (min_rate after request_timeout) and is closed, so it cannot hold a slot."""
    async with serving(max_connections=2, request_timeout=0.5, max_payload=16 * MiB) as server:
        tricklers = [await server.connect() for _ in range(2)]
        for i, trickler in enumerate(tricklers):
            await trickler.send(raw_header(Command.PUT, 16 * MiB, fmt=4, dtype=6, key=f"k{i}"))

        async def trickle() -> None:
            while True:
                for trickler in tricklers:
                    with contextlib.suppress(ConnectionError):
                        trickler.writer.write(b"\0")
                await asyncio.sleep(0.2)

        dripping = asyncio.create_task(trickle())
        try:
            await asyncio.sleep(1.5)
            assert await healthy(server) < IO_LIMIT
        finally:
            dripping.cancel()
        for trickler in tricklers:
            assert await trickler.closed_by_server()
            await trickler.close()


async def test_a_trickling_put_over_max_payload_is_closed() -> None:
    """A PUT over max_payload is read and dropped rather than refused with a close, at the
    pace every payload must keep: declaring 2 GiB and sending a little now and then holds the
    connection only until the trickle falls behind (min_rate after request_timeout)."""
    async with serving(request_timeout=0.5, max_payload=MiB) as server:
        assert server.handle is not None
        trickler = await server.connect()
        await trickler.send(raw_header(Command.PUT, 2 * GiB - 1, fmt=4, dtype=6))

        async def trickle() -> None:
            while True:
                with contextlib.suppress(ConnectionError):
                    trickler.writer.write(bytes(1024))
                await asyncio.sleep(0.1)

        dripping = asyncio.create_task(trickle())
        try:
            await asyncio.sleep(0.3)
            assert lm_stats(server.handle).connections == 1  # within its pace: still read
            started = time.monotonic()
            assert await trickler.closed_by_server()
            assert time.monotonic() - started < 2.0
            assert await healthy(server) < IO_LIMIT
        finally:
            dripping.cancel()
        await trickler.close()


async def test_a_put_over_max_payload_costs_no_memory() -> None:
    """What an oversized PUT sends is counted and dropped, not kept: 256 MiB of it leave the
    server's memory as it was, and the connection answers the next request."""
    async with serving(max_payload=MiB) as server:
        await round_trip(server, KEY, b"stored first")
        client = await server.connect()
        before = rss()
        await client.send(raw_header(Command.PUT, 256 * MiB, fmt=4, dtype=6))
        chunk = bytes(MiB)
        for _ in range(256):
            await client.send(chunk)
        reply, _ = await client.ask(Request(Command.EXIST, KEY))
        assert reply.code == Code.FAIL  # the key's object was replaced by nothing
        grown = rss() - before
        assert grown < 32 * MiB, f"RSS grew {grown / MiB:.0f} MiB for a dropped payload"
        assert (await client.ask(Request(Command.HEALTH, "")))[0].code == Code.OK
        await client.close()


async def test_a_reply_that_is_never_read_closes_the_connection() -> None:
    """A client that asks for a large object and does not read it loses its connection;
    others are served meanwhile."""
    async with serving(request_timeout=0.5, min_rate=64 * MiB, max_payload=64 * MiB) as server:
        payload = bytes(32 * MiB)
        await round_trip(server, KEY, payload)
        greedy = await server.connect()
        for _ in range(4):  # more than the socket buffers hold
            await greedy.send(raw_header(Command.GET, 0))
        assert await healthy(server) < IO_LIMIT
        await asyncio.sleep(0.5 + 32 / 64 + 1.0)  # past the reply's deadline
        got = await greedy.drained_until_closed()
        assert got < 4 * 32 * MiB  # closed before it sent all it was asked for
        await greedy.close()


async def test_small_replies_never_read_cost_the_connection_and_give_the_cache_back() -> None:
    """Replies under the direct-send size go through the transport: when the client stops
    reading, what the transport keeps holds a lease on the cache, so the connection is cut
    at the reply's deadline and the lease given back, even with no further request."""
    async with serving(request_timeout=0.5, min_rate=64 * MiB) as server:
        assert server.store.pool is not None
        payload = bytes(200 << 10)
        await round_trip(server, KEY, payload)
        greedy = await server.connect()
        sock = greedy.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await greedy.send(b"".join(raw_header(Command.GET, 0) for _ in range(64)))  # 12.5 MiB
        await asyncio.sleep(0.5 + 1.0)  # past the deadline of the reply it stopped reading
        await server.store.delete(KEY)
        assert server.store.pool.used == 0  # no lease left on the deleted object's memory
        got = await greedy.drained_until_closed()
        assert got < 64 * len(payload)
        await greedy.close()
        assert await healthy(server) < IO_LIMIT


async def test_a_get_counts_once_in_the_memory_tiers_stats() -> None:
    async with serving() as server:
        await round_trip(server, KEY, b"x" * 1000)  # a hit
        client = await server.connect()
        other = "llama@1@0@def456@bfloat16"
        reply, _ = await client.ask(Request(Command.GET, other))  # a miss
        assert reply.code == Code.FAIL
        await client.close()
        stats = server.store.stats()["memory"]
        assert (stats.hits, stats.misses) == (1, 1)


async def test_an_idle_flood_does_not_lock_new_clients_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """More idle connections than the server takes: a new client is served (a full server
    closes the connection idle the longest), and the flood is a few log lines."""
    caplog.set_level(logging.WARNING, logger="kvgate.lmserver")
    async with serving(max_connections=8) as server:
        flood = [await server.connect() for _ in range(40)]
        await asyncio.sleep(RECLAIM_IDLE + 0.2)
        start = time.monotonic()
        await round_trip(server, KEY, b"a newcomer's chunk")
        served_in = time.monotonic() - start
        assert served_in < IO_LIMIT
        more = [await server.connect() for _ in range(200)]
        await asyncio.sleep(RECLAIM_IDLE + 0.2)
        await round_trip(server, KEY + "@k%v", b"still served")
        for client in flood + more:
            await client.close()
    lines = [r for r in caplog.records if r.name == "kvgate.lmserver"]
    assert 1 <= len(lines) <= 4, [r.getMessage() for r in lines]


async def test_an_engines_long_lived_connection_outlasts_a_flood() -> None:
    """LMCache's client never reconnects: a connection that has served requests and was opened
    first is the last a full server closes, whatever the newer ones did."""
    async with serving(max_connections=8) as server:
        engine = await server.connect()
        assert (await engine.ask(Request(Command.HEALTH, "")))[0].code == Code.OK
        await asyncio.sleep(RECLAIM_IDLE)  # idle the longest of all, from here on
        crowd = [await server.connect() for _ in range(7)]
        for client in crowd:  # each served once too
            assert (await client.ask(Request(Command.HEALTH, "")))[0].code == Code.OK
        await asyncio.sleep(RECLAIM_IDLE + 0.2)
        for _ in range(20):  # each new one closes an idle newer one
            crowd.append(await server.connect())
            await asyncio.sleep(0.01)
        reply, _ = await engine.ask(Request(Command.HEALTH, ""))
        assert reply.code == Code.OK
        for client in [engine, *crowd]:
            await client.close()


async def test_a_full_server_refuses_with_a_log_line_when_nobody_is_idle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvgate.lmserver")
    async with serving(max_connections=2) as server:
        busy = [await server.connect() for _ in range(2)]
        for client in busy:  # each in the middle of a payload: not idle
            await client.send(raw_header(Command.PUT, 1024, fmt=4, dtype=6), b"x")
        await asyncio.sleep(RECLAIM_IDLE + 0.2)
        newcomer = await server.connect()
        assert await newcomer.closed_by_server()
        await newcomer.close()
        for client in busy:
            await client.close()
    assert any("refused" in r.getMessage() for r in caplog.records)


async def test_payloads_in_receipt_share_one_budget() -> None:
    """Bytes received and not stored are bounded together: a PUT whose bytes would pass the
    budget waits (reading stopped) until a stalled one is closed, and then goes on."""
    async with serving(request_timeout=1.0, max_payload=4 * MiB, payload_budget=4 * MiB) as server:
        staller = await server.connect()
        await staller.send(raw_header(Command.PUT, 4 * MiB, fmt=4, dtype=6), bytes(3 * MiB))
        await asyncio.sleep(0.2)
        payload = bytes(range(256)) * (3 * MiB // 256)
        writer = await server.connect()
        await writer.send(put(KEY, payload, 4, 6, (len(payload),)))
        reply, _ = await writer.ask(Request(Command.EXIST, KEY))
        assert reply.code == Code.OK
        assert await staller.closed_by_server()
        await staller.close()
        reply, body = await writer.ask(Request(Command.GET, KEY))
        assert body == payload
        await writer.close()


async def test_payloads_that_together_pass_the_budget_all_finish() -> None:
    """Several PUTs whose bytes together pass the budget: each waits its turn, none starves
    (when every one holding bytes is waiting, one goes on anyway)."""
    async with serving(max_payload=4 * MiB, payload_budget=4 * MiB) as server:
        payloads = {f"{KEY}@k{i}%v": bytes([i]) * (3 * MiB) for i in range(4)}
        writers = [await server.connect() for _ in payloads]

        async def send(writer: Client, key: str, payload: bytes) -> None:
            request = put(key, payload, 4, 6, (len(payload),))
            for start in range(0, len(request), 256 << 10):  # interleaved with the others
                await writer.send(request[start : start + (256 << 10)])
                await asyncio.sleep(0)

        async with asyncio.timeout(IO_LIMIT * 2):
            await asyncio.gather(
                *(send(w, k, p) for w, (k, p) in zip(writers, payloads.items(), strict=True))
            )
            for writer, (key, payload) in zip(writers, payloads.items(), strict=True):
                reply, body = await writer.ask(Request(Command.GET, key))
                assert reply.code == Code.OK
                assert body == payload
        for writer in writers:
            await writer.close()


async def test_payloads_that_never_finish_stay_within_the_budget() -> None:
    """Clients that send all of their payloads but the last byte: what the server holds stays
    within the budget plus one payload (the one let past it), however many they are."""
    budget, clients = 4 * MiB, 6
    async with serving(max_payload=4 * MiB, payload_budget=budget, request_timeout=3.0) as server:
        assert server.handle is not None
        writers = [await server.connect() for _ in range(clients)]

        async def send_all_but_one_byte(writer: Client, i: int) -> None:
            request = raw_header(Command.PUT, 4 * MiB, fmt=4, dtype=6, key=f"{KEY}@k{i}%v")
            request += bytes(4 * MiB - 1)
            for start in range(0, len(request), 256 << 10):
                writer.writer.write(request[start : start + (256 << 10)])
                await asyncio.sleep(0)

        senders = [asyncio.create_task(send_all_but_one_byte(w, i)) for i, w in enumerate(writers)]
        peak, waiting = 0, 0
        for _ in range(40):
            await asyncio.sleep(0.025)
            stats = lm_stats(server.handle)
            peak, waiting = max(peak, stats.received_bytes), max(waiting, stats.waiting)
        for sender in senders:
            sender.cancel()
        for writer in writers:
            await writer.close()
    assert waiting >= clients - 2  # most of them were held back
    assert peak <= budget + 4 * MiB + clients * MIN_READ, f"held {peak / MiB:.1f} MiB"


async def test_idle_connections_are_kept_without_an_idle_timeout() -> None:
    """LMCache's client opens one connection and never reconnects: an idle one is kept."""
    async with serving(request_timeout=0.3) as server:
        client = await server.connect()
        await asyncio.sleep(1.0)
        reply, _ = await client.ask(Request(Command.HEALTH, ""))
        assert reply.code == Code.OK
        await client.close()


async def test_an_idle_timeout_closes_idle_connections() -> None:
    async with serving(idle_timeout=0.3) as server:
        client = await server.connect()
        assert await client.closed_by_server()
        await client.close()
