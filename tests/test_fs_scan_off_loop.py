"""The disk tier builds its index at start in a worker thread, the sort by age and the eviction
policy included: the event loop does a constant amount of work however many objects the
directory holds. (It used to sort the records and fill the index and policy on the loop: at a
million objects, 4 + 3.5 s of CPU with every other task of the process waiting.) The scan
belongs to the connector: an operation that times out while it runs does not stop it, and
close does."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

from connectors.fs import record as rec
from connectors.fs.connector import FileConnector
from connectors.fs.dirs import Name
from gateway.store import Store

COUNT = 20_000


def _write_records(root: Path, count: int) -> list[str]:
    """``count`` whole records where a put leaves them, objects/ab/cd/<hash>.kvo (without a
    connector, which would take far longer), with mtimes in reverse key order."""
    keys = [f"scan/{i:06d}" for i in range(count)]
    for i, key in enumerate(keys):
        a, b, name = rec.object_name(key)
        folder = root / "objects" / a / b
        folder.mkdir(parents=True, exist_ok=True)
        data = i.to_bytes(8, "little")
        (folder / name).write_bytes(rec.pack_head(key, len(data)) + data)
        os.utime(folder / name, ns=(count - i, count - i))
    return keys


async def test_index_is_built_off_the_event_loop(tmp_path: Path) -> None:
    keys = _write_records(tmp_path, COUNT)
    conn = FileConnector(tmp_path, capacity=8 * (COUNT - 1))  # room for all but one
    try:
        started = time.thread_time()  # this thread runs the loop; the scan's thread is apart
        await conn.open()
        loop_cpu = time.thread_time() - started
        # Oldest (by mtime) first: the last key written has the oldest time and was evicted to
        # fit the capacity; every other key is indexed.
        assert not await conn.exists(keys[-1])
        assert all(await conn.exists_many(keys[:-1]))
        assert conn.usage() == (8 * (COUNT - 1), 8 * (COUNT - 1))
        assert bytes(await conn.get(keys[0]) or b"") == (0).to_bytes(8, "little")
    finally:
        await conn.close()
    # On the loop: awaiting the scan and one eviction, 0.001 s here. Sorting and indexing the
    # 20k records there took 0.036 s of CPU.
    assert loop_cpu < 0.012, f"the loop spent {loop_cpu:.3f} s of CPU opening {COUNT} objects"


class SlowDisk(FileConnector):
    """A real disk tier on a disk that takes 2 ms to read each record's header at start."""

    def _check_file(self, leaf: int, name: Name) -> rec.Record | Any:
        time.sleep(0.002)
        return super()._check_file(leaf, name)


async def test_a_scan_longer_than_the_tiers_timeout_still_opens_it(tmp_path: Path) -> None:
    # The scan (~0.3 s) outlasts every operation's timeout (0.05 s). Each operation used to
    # cancel it on timeout and the next started it again, so the tier never opened.
    keys = _write_records(tmp_path, 150)
    tier = {"url": f"file://{tmp_path}", "timeout": 0.05, "breaker": {"reset_after": 0.2}}
    config = {"tiers": [tier]}
    async with Store(config, connectors={0: SlowDisk(tmp_path)}) as store:
        deadline = time.monotonic() + 30
        found = False
        while not found and time.monotonic() < deadline:
            found = await store.contains(keys[0])  # a timeout is a miss, while the tier scans
            await asyncio.sleep(0.02)
        assert found, "the tier never finished opening"
        assert await store.contains(keys[-1])


async def test_close_stops_a_scan_in_progress(tmp_path: Path) -> None:
    keys = _write_records(tmp_path, 2000)  # 4 s of scanning
    conn = SlowDisk(tmp_path)
    started = time.monotonic()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(conn.exists(keys[0]), 0.1)  # starts the scan, leaves it running
    # The timeout neither stopped the scan nor waited for it (it used to wait the whole 4 s).
    assert time.monotonic() - started < 2.0
    started = time.monotonic()
    await conn.close()
    assert time.monotonic() - started < 3.0, "close waited for the whole scan"
    # The lock is released and nothing was lost: a new connector indexes every record.
    again = FileConnector(tmp_path)
    try:
        assert all(await again.exists_many(keys))
    finally:
        await again.close()


async def test_the_scan_starts_when_the_store_opens(tmp_path: Path) -> None:
    # Not at the first call: that call (and those after it, for as long as the scan takes)
    # would be misses. A 1M-object tier takes 5 s to read its saved index, minutes to scan.
    keys = _write_records(tmp_path, 150)  # ~0.3 s of scanning on this slow disk
    tier = {"url": f"file://{tmp_path}", "timeout": 0.05}
    async with Store({"tiers": [tier]}, connectors={0: SlowDisk(tmp_path)}) as store:
        await asyncio.sleep(3)  # no call yet
        assert await store.contains(keys[0])  # the first call finds the index ready
