"""The disk tier saves its index at a clean close and the next start reads it instead of every
record's header: a restart keeps every key and the LRU order; a start after a crash, or with a
damaged snapshot, scans the directory as before."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from connectors.fs.connector import FileConnector
from gateway.errors import GatewayError

SIZE = 100  # bytes of each object


async def _put_all(conn: FileConnector, keys: list[str]) -> None:
    for key in keys:
        await conn.put(key, bytes([len(key)]) * SIZE)


async def test_a_restart_keeps_every_key_and_the_lru_order(tmp_path: Path) -> None:
    conn = FileConnector(tmp_path, capacity=3 * SIZE)
    await _put_all(conn, ["a", "b", "c"])
    assert await conn.get("a") is not None  # a is now the most recently used; b the least
    await conn.close()
    assert (tmp_path / "index").is_file()

    again = FileConnector(tmp_path, capacity=3 * SIZE)
    try:
        assert all(await again.exists_many(["a", "b", "c"]))
        assert not (tmp_path / "index").exists()  # removed at start: a crash now must scan
        assert again.usage() == (3 * SIZE, 3 * SIZE)
        await _put_all(again, ["d"])  # full: one object goes, the least recently used
        # A scan orders by write time and would have evicted a, the oldest write.
        assert await again.exists_many(["a", "b", "c", "d"]) == [True, False, True, True]
        assert bytes(await again.get("c") or b"") == bytes([1]) * SIZE
    finally:
        await again.close()


def test_a_start_after_a_crash_scans(tmp_path: Path) -> None:
    # A process that opens the directory after a clean close (so it had a snapshot), puts one
    # more object and dies without closing: the next start must see that object too.
    script = textwrap.dedent(
        f"""
        import asyncio, os
        from connectors.fs.connector import FileConnector

        async def main():
            conn = FileConnector({str(tmp_path)!r})
            await conn.put("first", b"1")
            await conn.close()
            conn = FileConnector({str(tmp_path)!r})
            await conn.put("after-restart", b"2")
            os._exit(0)

        asyncio.run(main())
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert not (tmp_path / "index").exists()

    async def reopen() -> list[bool]:
        conn = FileConnector(tmp_path)
        try:
            return await conn.exists_many(["first", "after-restart"])
        finally:
            await conn.close()

    assert asyncio.run(reopen()) == [True, True]


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
async def test_a_damaged_snapshot_is_refused_and_the_directory_scanned(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    keys = [f"k{i}" for i in range(50)]
    conn = FileConnector(tmp_path)
    await _put_all(conn, keys)
    await conn.close()
    index = tmp_path / "index"
    data = bytearray(index.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncate":
        del data[-30:]
    else:
        data.clear()
    index.write_bytes(bytes(data))

    again = FileConnector(tmp_path)
    try:
        with caplog.at_level(logging.WARNING):
            assert all(await again.exists_many(keys))
        assert "index snapshot not used" in caplog.text
        assert bytes(await again.get("k7") or b"") == bytes([2]) * SIZE
    finally:
        await again.close()


async def test_an_object_removed_by_hand_after_close_is_a_miss(tmp_path: Path) -> None:
    conn = FileConnector(tmp_path)
    await _put_all(conn, ["kept", "gone"])
    await conn.close()
    os.unlink(conn.path_for("gone"))

    again = FileConnector(tmp_path)
    try:
        assert await again.get("gone") is None
        assert not await again.exists("gone")  # forgotten once the read missed it
        assert await again.get("kept") is not None
    finally:
        await again.close()


async def test_closing_a_connector_never_opened_keeps_the_saved_index(tmp_path: Path) -> None:
    conn = FileConnector(tmp_path)
    await _put_all(conn, ["a"])
    await conn.close()
    saved = (tmp_path / "index").read_bytes()
    await FileConnector(tmp_path).close()  # never started: it neither read nor saved one
    assert (tmp_path / "index").read_bytes() == saved


async def test_overlapping_and_cancelled_closes_save_once_and_unlock(tmp_path: Path) -> None:
    keys = [f"k{i}" for i in range(200)]
    conn = FileConnector(tmp_path)
    await _put_all(conn, keys)
    first = asyncio.ensure_future(conn.close())
    await asyncio.sleep(0)
    first.cancel()  # a close that times out: the closing goes on
    await asyncio.gather(conn.close(), conn.close())
    with pytest.raises(asyncio.CancelledError):
        await first
    again = FileConnector(tmp_path)  # unlocked, and the index saved whole
    try:
        assert all(await again.exists_many(keys))
        assert not (tmp_path / "index").exists()  # it was read: a snapshot, not a scan
    finally:
        await again.close()


async def test_closing_while_the_index_is_read_saves_it_again(tmp_path: Path) -> None:
    keys = [f"k{i}" for i in range(2000)]
    conn = FileConnector(tmp_path)
    await _put_all(conn, keys)
    await conn.close()
    again = FileConnector(tmp_path)
    started = asyncio.ensure_future(again.open())  # reads (and removes) the saved index
    await asyncio.sleep(0)
    await again.close()  # stops the start; the whole index it read is saved again
    with contextlib.suppress(asyncio.CancelledError, GatewayError):
        await started
    assert (tmp_path / "index").is_file()
    third = FileConnector(tmp_path)
    try:
        assert all(await third.exists_many(keys))
    finally:
        await third.close()
