"""The sqlite plugin's own behaviour: installed as a plugin, bounded, atomic, contained."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

try:
    from kvgate_sqlite import SqliteConnector
except ModuleNotFoundError:  # the plugin is installed by .ci/plugins; CI must not skip it
    if os.environ.get("CI"):
        raise
    pytest.skip("kvgate-sqlite is not installed (bash .ci/plugins)", allow_module_level=True)

from gateway.connector import limiting_reads
from gateway.errors import (
    CapacityError,
    ConfigError,
    CorruptObject,
    OverReadLimit,
    Timeout,
    Unavailable,
)
from gateway.store import Store
from gateway.testing import assert_same_bytes, make_bytes

KiB, MiB = 1 << 10, 1 << 20


def url_of(path: Path) -> str:
    return f"sqlite://{path}"


def names_under(folder: Path) -> set[str]:
    return {p.name for p in folder.rglob("*")}


def test_kvgate_lists_the_installed_plugin() -> None:
    kvgate = Path(sys.executable).parent / "kvgate"
    out = subprocess.run(
        [str(kvgate), "connectors", "--json"], check=True, capture_output=True, text=True
    ).stdout
    found = {c["name"]: c for c in json.loads(out)["connectors"]}
    assert found["sqlite"]["distribution"] == "kvgate-sqlite"
    assert found["sqlite"]["usable"] is True


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("sqlite://host/x.db", "not a host"),
        ("sqlite:///{tmp}/", "name the database file"),
        ("sqlite:///{tmp}/missing-folder/x.db", "does not exist"),
        ("sqlite:///{tmp}/../x.db", "without '..'"),
        ("sqlite:///{tmp}/x.db?capacity=1", "keyword arguments"),
        ("redis:///{tmp}/x.db", "not a sqlite:// URL"),
    ],
)
def test_bad_urls_are_config_errors(tmp_path: Path, url: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        SqliteConnector.from_url(url.format(tmp=str(tmp_path).lstrip("/")))


def test_bad_options_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="capacty"):
        SqliteConnector.from_url(url_of(tmp_path / "x.db"), capacty="1GiB")
    with pytest.raises(ConfigError, match="max_object_size"):
        SqliteConnector.from_url(url_of(tmp_path / "x.db"), max_object_size=2_000_000_000)


def test_a_file_that_is_not_a_database_is_refused_at_configuration(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_bytes(b"this is not sqlite" * 300)
    with pytest.raises(ConfigError, match="not a SQLite database"):
        SqliteConnector.from_url(url_of(path))
    assert path.read_bytes() == b"this is not sqlite" * 300


async def test_a_damaged_database_is_an_outage_not_a_corrupt_object(tmp_path: Path) -> None:
    """A file with SQLite's header but nothing valid after it: every call fails as the tier
    being unavailable (the breaker's business), never as one object's corruption, which would
    have the store delete keys from a file it cannot read."""
    path = tmp_path / "t.db"
    path.write_bytes(b"SQLite format 3\x00" + b"\xff" * 8192)
    conn = SqliteConnector.from_url(url_of(path))
    try:
        for call in (lambda: conn.get("k"), lambda: conn.put("k", b"v"), lambda: conn.delete("k")):
            with pytest.raises((Unavailable, ConfigError)) as caught:
                await call()
            assert not isinstance(caught.value, CorruptObject)
    finally:
        await conn.close()


async def test_a_foreign_database_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as other:
        other.execute("CREATE TABLE users (name TEXT)")
    other.close()
    before = path.read_bytes()
    conn = SqliteConnector.from_url(url_of(path))
    try:
        with pytest.raises(ConfigError, match="something else"):
            await conn.put("k", b"v")
    finally:
        await conn.close()
    assert path.read_bytes() == before


async def test_only_the_database_files_are_written(tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    tier.mkdir()
    conn = SqliteConnector.from_url(url_of(tier / "t.db"))
    try:
        for key in ("../../escape", "/abs", "a/b", "..", "nul\x00", "k" * 5000):
            await conn.put(key, b"x")
            assert await conn.get(key) == b"x"
    finally:
        await conn.close()
    assert names_under(tmp_path) <= {"tier", "t.db", "t.db-wal", "t.db-shm"}


async def test_capacity_bounds_the_stored_bytes(tmp_path: Path) -> None:
    conn = SqliteConnector.from_url(url_of(tmp_path / "t.db"), capacity=100 * KiB)
    try:
        await conn.put("a", make_bytes(60 * KiB, 1))
        with pytest.raises(CapacityError, match="do not fit"):
            await conn.put("b", make_bytes(60 * KiB, 2))
        assert await conn.get("b") is None
        assert conn.usage() == (60 * KiB, 100 * KiB)
        await conn.put("a", make_bytes(90 * KiB, 3))  # an overwrite counts the old size back
        assert conn.usage() == (90 * KiB, 100 * KiB)
        assert await conn.delete("a")
        assert conn.usage() == (0, 100 * KiB)
        await conn.put("b", make_bytes(60 * KiB, 2))
    finally:
        await conn.close()
    again = SqliteConnector.from_url(url_of(tmp_path / "t.db"), capacity=100 * KiB)
    try:  # the count lives in the file: a new instance (or process) agrees
        await again.ping()
        with pytest.raises(CapacityError):
            await again.put("c", make_bytes(60 * KiB, 4))
        assert again.usage() == (60 * KiB, 100 * KiB)
    finally:
        await again.close()


async def test_a_tiers_capacity_in_a_store_config_bounds_the_database(tmp_path: Path) -> None:
    """``capacity`` beside the tier's URL (as the README configures tiers), not only in its
    options: the store passes it on, and no eviction policy the plugin does not take."""
    tier = {"url": url_of(tmp_path / "t.db"), "capacity": "100KiB"}
    config = {"tiers": [tier], "write_policy": "through", "prefault": False, "staging": "8MiB"}
    async with Store(config) as store:
        await store.put("a", make_bytes(60 * KiB, 1))
        with pytest.raises(CapacityError):
            await store.put("b", make_bytes(60 * KiB, 2))
        got = await store.get("a")
        assert isinstance(got, bytes)
        assert_same_bytes(got, make_bytes(60 * KiB, 1))
    tier["eviction"] = "lfu"  # asked for: refused, since the plugin never evicts
    with pytest.raises(ConfigError, match="eviction"):
        async with Store({**config, "tiers": [tier]}):
            pass


async def test_objects_over_the_maximum_are_refused(tmp_path: Path) -> None:
    conn = SqliteConnector.from_url(url_of(tmp_path / "t.db"), max_object_size=MiB)
    try:
        assert conn.capabilities.max_object_size == MiB
        with pytest.raises(CapacityError, match="max_object_size"):
            await conn.put("big", [make_bytes(MiB), b"!"])
        assert not await conn.exists("big")
    finally:
        await conn.close()


async def test_a_stored_size_over_the_readers_limit_is_refused(tmp_path: Path) -> None:
    conn = SqliteConnector.from_url(url_of(tmp_path / "t.db"))
    try:
        await conn.put("k", make_bytes(2 * MiB))
        with limiting_reads(MiB), pytest.raises(OverReadLimit, match="over this reader"):
            await conn.get("k")
    finally:
        await conn.close()


async def test_a_held_write_lock_times_out_reads_go_on_loop_stays_free(tmp_path: Path) -> None:
    """Another process holding the write lock: the put waits busy_timeout then fails as a
    Timeout; reads still see the old value (WAL); the event loop ticks all the while."""
    path = tmp_path / "t.db"
    conn = SqliteConnector.from_url(url_of(path), busy_timeout=0.5)
    old = make_bytes(MiB, 1)
    await conn.put("k", old)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    try:
        start = time.monotonic()
        with pytest.raises(Timeout, match="locked"):
            await conn.put("k", make_bytes(MiB, 2))
        assert time.monotonic() - start >= 0.4
        assert ticks >= 10, "the event loop was blocked while SQLite waited"
        assert_same_bytes(await conn.get("k"), old, "the old value, during the lock")
    finally:
        ticker.cancel()
        other.execute("ROLLBACK")
        other.close()
        await conn.close()


WRITER = """
import asyncio, sys
from kvgate_sqlite import SqliteConnector

async def main() -> None:
    conn = SqliteConnector.from_url(sys.argv[1])
    await conn.put("k", b"old" * 1000)
    print("ready", flush=True)
    while True:  # large puts until killed: the kill lands inside one
        await conn.put("k", bytes(256 << 20))

asyncio.run(main())
"""


async def test_a_process_killed_mid_put_leaves_the_old_object(tmp_path: Path) -> None:
    """SIGKILL of a writer inside its transaction: the next opener sees the last committed
    object whole and a usage count that matches it (SQLite rolls the WAL back)."""
    url = url_of(tmp_path / "t.db")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WRITER, url, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), 60) == b"ready\n"
        await asyncio.sleep(0.3)
    finally:
        proc.kill()
        await proc.wait()
    conn = SqliteConnector.from_url(url)
    try:
        got = await conn.get("k")
        assert got is not None
        assert bytes(got) in (b"old" * 1000, bytes(256 << 20)), "a torn object"
        assert conn.usage()[0] == len(got)
        assert [(i.key, i.size) async for i in conn.list("")] == [("k", len(got))]
    finally:
        await conn.close()


async def test_raw_client_baseline_measures_and_cleans_up(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    url = url_of(path)
    put_gbs, get_gbs = await SqliteConnector.raw_client_baseline(
        url, {}, size=MiB, count=4, concurrency=2
    )
    assert put_gbs > 0
    assert get_gbs > 0
    with sqlite3.connect(path) as check:
        tables = check.execute("SELECT name FROM sqlite_schema WHERE type='table'").fetchall()
    check.close()
    assert tables == []


async def test_a_cancelled_put_never_stores_bytes_written_after_it_returned(
    tmp_path: Path,
) -> None:
    """A Store reuses a put's buffer once the put returns, cancelled or not: the writer thread
    must be done reading it by then, so the key holds the old value or the whole new one."""
    conn = SqliteConnector.from_url(url_of(tmp_path / "t.db"), max_object_size="512MiB")
    try:
        original = make_bytes(64 * MiB, seed=5)
        for delay in (0.001, 0.01, 0.05):
            buffer = bytearray(original)
            put = asyncio.create_task(conn.put("k", memoryview(buffer)))
            await asyncio.sleep(delay)
            put.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await put
            buffer[:] = bytes(len(buffer))  # what a reused buffer holds next
            await conn.put("after", b"x")  # one writer thread: the cancelled put is over now
            got = await conn.get("k")
            if got is not None:
                assert_same_bytes(got, original, f"cancelled after {delay} s")
            await conn.delete("k")
    finally:
        await conn.close()
