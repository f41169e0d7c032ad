"""The worker's Store on its own loop thread (``gateway.vllm.bridge``) and the lookups the
scheduler sends it over a unix socket (``gateway.vllm.lookup``), with real Stores."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from servers.gated import Gated

from gateway.errors import ConfigError
from gateway.store import Store
from gateway.vllm.bridge import StoreThread
from gateway.vllm.lookup import SocketLookup, claim_socket, serve_lookups, socket_path

MiB = 1 << 20


def key_of(chunk_hash: int) -> str:
    return f"m@1@0@{chunk_hash:x}@float"


def test_saves_are_bounded_and_drained_at_close() -> None:
    lower = Gated(open=False)
    cfg: dict[str, Any] = {"tiers": [{"url": "memory://x", "timeout": 10.0}], "staging": 8 * MiB}
    bridge = StoreThread(lambda: Store(cfg, connectors={0: lower}), max_pending=2, timeout=10.0)
    bridge.start()
    try:
        assert bridge.put_later("a", b"1" * 1000)
        assert bridge.put_later("b", b"2" * 1000)
        # A write-back put returns once staged, whatever its tier does: pending drops to 0.
        deadline = time.monotonic() + 5
        while bridge.pending_saves and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bridge.pending_saves == 0
        assert bridge.get_many(["a", "b", "c"]) == [b"1" * 1000, b"2" * 1000, None]
    finally:
        bridge._loop.call_soon_threadsafe(lower.gate.set)
        bridge.close()
    assert sorted(lower.backing.objects) == ["a", "b"]  # close drained the queued writes


def test_saves_past_the_bound_are_skipped_not_waited_for() -> None:
    release = threading.Event()

    class Slow(Store):
        async def put(self, key: Any, obj: object, **kw: Any) -> None:
            await asyncio.to_thread(release.wait, 30)  # the test's thread lets it go
            await super().put(key, obj, **kw)

    cfg = {"tiers": [{"url": "memory://", "capacity": 8 * MiB}], "prefault": False}
    bridge = StoreThread(lambda: Slow(cfg), max_pending=2, timeout=10.0)
    bridge.start()
    try:
        start = time.monotonic()
        results = [bridge.put_later(k, b"x") for k in ("a", "b", "c", "d")]
        assert time.monotonic() - start < 5.0  # never waits for the store (30 s)
        assert results == [True, True, False, False]
        assert bridge.skipped_saves == 2
        release.set()
    finally:
        bridge.close()


def test_a_load_that_takes_too_long_is_a_miss() -> None:
    release = threading.Event()

    class Stalled(Store):
        async def get_many(self, keys: Any) -> list[object | None]:
            await asyncio.to_thread(release.wait, 30)  # the test's thread lets it go
            return await super().get_many(keys)

    cfg = {"tiers": [{"url": "memory://", "capacity": 8 * MiB}], "prefault": False}
    bridge = StoreThread(lambda: Stalled(cfg), max_pending=2, timeout=0.3)
    bridge.start()
    try:
        assert bridge.get_many(["a", "b"]) == [None, None]
    finally:
        release.set()
        bridge.close()


def serving_bridge(
    make_store: Callable[[], Store], tmp_path: Path, lookup_timeout: float
) -> tuple[StoreThread, str]:
    """A started store thread that answers lookups on its socket (as rank 0's worker)."""
    path = socket_path(f"test-{tmp_path.name}")
    bridge = StoreThread(
        make_store,
        max_pending=8,
        timeout=10.0,
        on_loop=lambda store: serve_lookups(store, path, key_of, lookup_timeout),
    )
    bridge.start()
    return bridge, path


@pytest.fixture
def disk_store(tmp_path: Path) -> Any:
    cfg = {"tiers": [{"url": f"file://{tmp_path / 'disk'}"}], "staging": 8 * MiB}
    bridge, path = serving_bridge(lambda: Store(cfg), tmp_path, 10.0)
    yield bridge, path
    bridge.close()


def test_the_scheduler_asks_the_worker_over_its_socket(disk_store: Any) -> None:
    bridge, path = disk_store
    for h in (1, 2, 3):
        bridge.call(lambda store, h=h: store.put(key_of(h), bytes([h]) * 4096, durable=True))
    lookup = SocketLookup(path, timeout=5.0)
    try:
        assert lookup([1, 2, 3, 4]) == 3
        assert lookup([1, 5, 3]) == 1  # a prefix: stops at the first miss
        assert lookup([]) == 0
        assert lookup([2]) == 1  # the same connection, again
    finally:
        lookup.close()


def test_a_corrupted_chunk_ends_the_prefix_at_lookup(disk_store: Any) -> None:
    """Lookups read what they count: a chunk whose bytes were damaged is not promised to vLLM
    (whose default policy fails a request whose load fails)."""
    bridge, path = disk_store
    for h in (1, 2, 3):
        bridge.call(lambda store, h=h: store.put(key_of(h), bytes([h]) * 4096, durable=True))
    victim = bridge.call(lambda store: _file_of(store, key_of(2)))
    data = bytearray(Path(victim).read_bytes())
    data[-100] ^= 0xFF
    Path(victim).write_bytes(bytes(data))
    lookup = SocketLookup(path, timeout=5.0)
    try:
        assert lookup([1, 2, 3]) == 1
    finally:
        lookup.close()


async def _file_of(store: Store, key: str) -> str:
    connector: Any = store.tiers[0].connector
    while hasattr(connector, "inner"):
        connector = connector.inner
    return str(connector.path_for(key))


def test_no_worker_is_a_miss_not_an_error(tmp_path: Path) -> None:
    lookup = SocketLookup(str(tmp_path / "nobody.sock"), timeout=1.0)
    assert lookup([1, 2]) == 0
    lookup.close()


def test_a_stalled_store_costs_the_scheduler_one_deadline_then_a_quiet_spell(
    tmp_path: Path,
) -> None:
    """The scheduler waits for a lookup with vLLM's whole engine: a store that does not answer
    costs one ``lookup_timeout``, then lookups are misses at once until the backoff has
    passed; the worker drops a lookup past its own deadline (answers 0) too."""
    stalled = threading.Event()
    asked: list[int] = []

    class Stalling(Store):
        async def lookup(self, keys: Any, *args: Any, **kwargs: Any) -> int:
            asked.append(len(keys))
            if stalled.is_set():
                await asyncio.sleep(30)
            return int(await super().lookup(keys, *args, **kwargs))

    cfg = {"tiers": [{"url": "memory://", "capacity": 8 * MiB}], "prefault": False}
    bridge, path = serving_bridge(lambda: Stalling(cfg), tmp_path, 0.5)
    scheduler = SocketLookup(path, timeout=1.0, backoff=1.5)
    worker_bound = SocketLookup(path, timeout=5.0)
    try:
        bridge.call(lambda store: store.put(key_of(1), b"x" * 4096, durable=True))
        assert scheduler([1]) == 1
        stalled.set()
        start = time.monotonic()
        assert worker_bound([1]) == 0  # the worker's deadline (0.5 s), not the store's
        assert time.monotonic() - start < 3.0
        start = time.monotonic()
        assert scheduler([1]) == 0  # one deadline (1 s) ...
        reached = len(asked)
        assert scheduler([1]) == 0  # ... then misses without asking
        assert scheduler([1]) == 0
        assert time.monotonic() - start < 3.0
        assert len(asked) == reached
        stalled.clear()
        time.sleep(1.6)
        assert scheduler([1]) == 1  # asked again after the backoff
    finally:
        scheduler.close()
        worker_bound.close()
        bridge.close()


def test_a_second_engine_with_the_same_engine_id_is_refused(disk_store: Any) -> None:
    """Its lookups would be answered by the first engine's store."""
    _, path = disk_store
    deadline = time.monotonic() + 10.0
    while not os.path.exists(path) and time.monotonic() < deadline:  # serving starts async
        time.sleep(0.01)
    with pytest.raises(ConfigError, match="already serves lookups"):
        claim_socket(path, "engine-a")
    # The probe's connection, accepted by the worker's loop, ends there before the fixture
    # stops that loop (one accepted as the loop stops was left unclosed: a ResourceWarning).
    time.sleep(0.2)


def test_a_socket_left_by_a_dead_worker_is_removed(tmp_path: Path) -> None:
    path = str(tmp_path / "dead.sock")
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(path)  # bound, never listening: as after a worker killed
    left.close()
    claim_socket(path, "engine-a")
    assert not os.path.exists(path)


def test_an_answer_that_is_not_an_object_is_a_miss(tmp_path: Path) -> None:
    path = str(tmp_path / "odd.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()

    def answer_oddly() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"[1]\n")

    thread = threading.Thread(target=answer_oddly)
    thread.start()
    lookup = SocketLookup(path, timeout=5.0)
    try:
        assert lookup([1]) == 0
    finally:
        lookup.close()
        thread.join(5)
        server.close()
