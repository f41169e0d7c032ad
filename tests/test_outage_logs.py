"""A lower tier's outage is a few log lines: the breaker's transitions, with the number of
calls and writes it refused, instead of one line per failed write.

One outage is deterministic (the chaos layer takes a real memory connector away), the other is
a real Redis server stalled with SIGSTOP for 5 s under a steady stream of puts.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

import pytest
from servers.redis import RedisNode

from connectors.memory import MemoryConnector
from gateway import Store
from gateway.layers import ChaosLayer, CircuitBreakerLayer, find_layer
from gateway.log_limit import RepeatLimiter

KiB = 1 << 10
REFUSED = re.compile(r"refused (\d+) calls \((\d+) writes\) while open")


def kvgate_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("kvgate") and r.levelno >= logging.INFO
    ]


async def put_for(store: Store, seconds: float, start: int = 0) -> int:
    """Write-back puts of fresh keys every few ms for ``seconds``; returns the next index."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    i = start
    while loop.time() < end:
        await store.put(f"k{i}", b"v" * KiB)
        i += 1
        await asyncio.sleep(0.003)
    return i


async def until_closed(store: Store, breaker: CircuitBreakerLayer, start: int) -> int:
    """Keep writing (the probe is a write) until the breaker has closed again."""
    i = start
    async with asyncio.timeout(10):
        while breaker.state != "closed":
            i = await put_for(store, 0.05, i)
    await store.flush()
    return i


def assert_a_few_lines(lines: list[str], refused: int, most: int) -> None:
    """``most`` lines: the first failure of each kind, the breaker's open, half-open and closed,
    and the summary of failures not logged, given at close."""
    assert len(lines) <= most, "\n".join(lines)
    opened = [m for m in lines if "circuit breaker open" in m]
    closed = [m for m in lines if "circuit breaker closed" in m]
    assert len(opened) == 1, "\n".join(lines)
    assert len(closed) == 1, "\n".join(lines)
    found = REFUSED.search(closed[0])
    assert found is not None, closed[0]
    assert int(found[1]) == int(found[2]) == refused  # every refused call was a write


async def test_an_outage_is_a_few_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    chaos = ChaosLayer(MemoryConnector())
    lower = {"url": "memory://", "retry": {"attempts": 1}}
    lower["breaker"] = {"failures": 5, "reset_after": 0.3}
    cfg: dict[str, Any] = {"tiers": [{"url": "memory://", "capacity": 16 << 20}, lower]}
    caplog.set_level(logging.INFO, logger="kvgate")
    async with Store(cfg, connectors={1: chaos}) as store:
        breaker = find_layer(store.tiers[0].connector, CircuitBreakerLayer)
        assert breaker is not None
        chaos.down = True
        n = await put_for(store, 1.5)  # five probes fail meanwhile, and hundreds of writes
        chaos.down = False
        n = await until_closed(store, breaker, n)
        refused = store.stats()["memory1"].errors["circuit_open"]
    assert n > 100
    assert refused > 100
    assert_a_few_lines(kvgate_lines(caplog), refused, most=5)


async def test_a_stalled_redis_is_a_few_log_lines(
    redis_factory: Callable[..., RedisNode], caplog: pytest.LogCaptureFixture
) -> None:
    node = redis_factory()
    cfg: dict[str, Any] = {
        "tiers": [
            {"url": "memory://", "capacity": 64 << 20},
            {
                "url": node.url,
                "timeout": 0.5,
                "retry": {"attempts": 1},
                "breaker": {"failures": 5, "reset_after": 1.0},
                "options": {"socket_connect_timeout": 0.5},
            },
        ]
    }
    async with Store(cfg) as store:
        breaker = find_layer(store.tiers[0].connector, CircuitBreakerLayer)
        assert breaker is not None
        await store.put("warm", b"x")
        await store.flush()
        caplog.set_level(logging.INFO, logger="kvgate")
        assert node.proc is not None
        with node.proc.paused():
            n = await put_for(store, 5.0)
        n = await until_closed(store, breaker, n)
        refused = store.stats()["redis"].errors["circuit_open"]
    lines = kvgate_lines(caplog)
    print(f"{n} puts, {refused} writes refused, {len(lines)} log lines:", *lines, sep="\n")
    assert refused > 100
    # A real server may fail in more than one way (timeouts, then a reset connection).
    assert_a_few_lines(lines, refused, most=8)


def test_repeats_of_a_kind_are_counted_into_the_next_line() -> None:
    now = [0.0]
    limiter = RepeatLimiter(interval=30.0, clock=lambda: now[0])
    assert limiter.admit("timeout") == 0  # the first is logged
    assert [limiter.admit("timeout") for _ in range(3)] == [None, None, None]
    assert limiter.admit("capacity") == 0  # another kind has its own count
    now[0] = 31.0
    assert limiter.admit("timeout") == 3  # logged again, with the three not logged
    assert limiter.admit("timeout") is None
    assert limiter.unlogged() == {"timeout": 1}
    assert limiter.unlogged() == {}
