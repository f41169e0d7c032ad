"""Redis failing under a Store with load on it: a killed server, and Sentinel failovers.

Each test starts servers of its own (they are killed or failed over). The Store's only tier is
the Redis one, so ``flush()`` returning means the tier acknowledged (or failed) every write.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from servers.redis import SERVICE, RedisNode, SentinelGroup, wait_for

from connectors.redis import RedisConnector
from gateway.connector import Connector
from gateway.layers import CircuitBreakerLayer, Layer, find_layer
from gateway.store import Store
from gateway.testing import assert_same_bytes, make_bytes
from gateway.types import BufferParts

KiB, MiB = 1 << 10, 1 << 20
TIER_TIMEOUT = 1.0
SLACK = 1.0  # scheduling on a busy 2-core machine


def _size(i: int) -> int:
    return 600 * KiB if i % 3 == 0 else 20 * KiB  # parted and inline objects


class AckLog(Layer):
    """Remembers which puts the connector acknowledged (returned from without an error)."""

    def __init__(self, inner: Connector) -> None:
        super().__init__(inner)
        self.acked: set[str] = set()

    async def put(self, key: str, data: BufferParts) -> None:
        await super().put(key, data)
        self.acked.add(key)


async def _bounded_load(store: Store, stop: asyncio.Event, worst: list[float]) -> int:
    """Puts of fresh keys and gets of older ones (written by now, so read from Redis) until
    ``stop``; records the slowest call; returns the number of rounds."""
    n = 0
    while not stop.is_set():
        key = f"load/{id(worst)}/{n}"
        calls = [store.put(key, make_bytes(_size(n), seed=n))]
        if n >= 8:
            calls.append(store.get(f"load/{id(worst)}/{n - 8}"))
        for call in calls:
            start = time.monotonic()
            await call  # a failing tier is a miss or a counted error, never an exception
            worst[0] = max(worst[0], time.monotonic() - start)
        n += 1
        await asyncio.sleep(0.005)
    return n


async def test_store_rides_out_a_killed_redis(redis_factory: Callable[..., RedisNode]) -> None:
    node = redis_factory()
    cfg: dict[str, Any] = {
        "tiers": [
            {
                "url": node.url,
                "timeout": TIER_TIMEOUT,
                "breaker": {"failures": 3, "reset_after": 1.0},
                "options": {"part_size": 256 * KiB, "socket_connect_timeout": 0.5},
            }
        ],
        "staging": 128 * MiB,
    }
    async with Store(cfg) as store:
        tier = store.tiers[0]
        breaker = find_layer(tier.connector, CircuitBreakerLayer)
        assert breaker is not None
        stop = asyncio.Event()
        worst = [0.0]
        states: set[str] = set()

        async def watch() -> None:
            while not stop.is_set():
                states.add(breaker.state)
                await asyncio.sleep(0.01)

        load = [asyncio.create_task(_bounded_load(store, stop, worst)) for _ in range(4)]
        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0.5)
        assert tier.stats.hits > 0, "the load never reached Redis"
        node.kill()
        await asyncio.sleep(2.0)
        assert "open" in states, f"the breaker never opened (saw {states})"
        errors_while_down = sum(tier.stats.errors.values())
        assert errors_while_down > 0

        node.start()  # same port, empty
        restarted = time.monotonic()
        hits = tier.stats.hits
        while True:
            await store.put("probe", b"back again")
            await store.flush()
            if await store.get("probe") == b"back again" and tier.stats.hits > hits:
                break
            assert time.monotonic() - restarted < 5.0, "the tier was not used again"
            await asyncio.sleep(0.1)
        stop.set()
        done = await asyncio.gather(*load)
        await watcher
        assert sum(done) > 0
        assert worst[0] < TIER_TIMEOUT + SLACK, f"a call took {worst[0]:.2f} s"


def _trigger_failover(group: SentinelGroup, how: str) -> None:
    if how == "sigkill-master":
        group.master.kill()
        return

    def accepted() -> bool:
        out = group.sentinel.cli("sentinel", "failover", SERVICE, check=False)
        return out == "OK"

    wait_for(accepted, "the sentinel to accept a failover", timeout=10.0)


@pytest.mark.parametrize("how", ["sentinel-failover", "sigkill-master"])
async def test_sentinel_failover_loses_no_acknowledged_write(
    sentinel_factory: Callable[[], SentinelGroup], how: str, tmp_path: Path
) -> None:
    group = sentinel_factory()
    old_master = group.master_port()
    options = {
        "min_replicas_ack": 1,
        "replicas_ack_timeout": 0.5,
        "part_size": 128 * KiB,
        "socket_connect_timeout": 0.5,
        "socket_timeout": 2.0,
    }
    acks = AckLog(RedisConnector.from_url(group.url, **options))
    cfg: dict[str, Any] = {
        "tiers": [
            {
                "url": group.url,
                "timeout": 3.0,
                "breaker": {"failures": 5, "reset_after": 0.3},
                "workers": 4,
            }
        ],
        "staging": 128 * MiB,
    }
    stop = asyncio.Event()
    written: dict[str, tuple[int, int]] = {}

    async def writer(w: int) -> None:
        n = 0
        while not stop.is_set():
            key = f"w{w}/{n}"
            seed, size = w * 1_000_000 + n, _size(n)
            written[key] = (seed, size)
            await store.put(key, make_bytes(size, seed=seed))
            n += 1
            await asyncio.sleep(0.002)

    store = Store(cfg, connectors={0: acks})
    async with store:
        tasks = [asyncio.create_task(writer(w)) for w in range(4)]
        try:
            await asyncio.to_thread(
                wait_for, lambda: len(acks.acked) > 20, "acknowledged writes", 10.0
            )
            await asyncio.to_thread(_trigger_failover, group, how)
            await asyncio.to_thread(
                wait_for, lambda: group.master_port() != old_master, "a new master", 15.0
            )
            # The new master gets a replica again, so that WAIT can be satisfied.
            if how == "sigkill-master":
                # A new one: the killed master's port may have been taken meanwhile.
                await asyncio.to_thread(group.add_replica, tmp_path / "new-replica")
            else:
                # The old master, as the sentinel would do on its next 10 s round of INFO.
                group.master.cli("replicaof", "127.0.0.1", str(group.master_port()))
            acked_at_failover = len(acks.acked)

            def recovered() -> bool:
                return len(acks.acked) > acked_at_failover + 10

            await asyncio.to_thread(wait_for, recovered, "acknowledged writes again", 20.0)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        await store.flush()
        stats = next(iter(store.stats().values()))

    # Every acknowledged write is on the new master, whole (read by a fresh Store). The
    # sentinel may call the new master down for a moment on a busy machine: reads retry
    # through that, and a read that still fails is reported as such, not as a loss.
    check_cfg = {
        "tiers": [
            {
                "url": group.url,
                "timeout": 20.0,
                "retry": {"attempts": 20, "backoff_base": 0.1, "backoff_max": 0.5},
                "breaker": {"failures": 0},
            }
        ],
        "staging": 64 * MiB,
    }
    assert acks.acked
    async with Store(check_cfg) as check:
        missing = []
        for key in sorted(acks.acked):
            seed, size = written[key]
            got = await check.get(key)
            if got is None:
                missing.append(key)
            else:
                assert_same_bytes(got, make_bytes(size, seed=seed), key)
        read_errors = next(iter(check.stats().values())).errors
    assert not read_errors, f"could not read back: {read_errors}"
    assert not missing, (
        f"{len(missing)} of {len(acks.acked)} acknowledged writes lost: {missing[:5]}"
    )
    # Writes that were not acknowledged are counted as the tier's errors.
    assert len(written) == len(acks.acked) or sum(stats.errors.values()) > 0
