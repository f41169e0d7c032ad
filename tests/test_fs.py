"""What only the file:// connector does: restart, on-disk layout, quarantine, capacity, lock,
cancellation and a really full disk. The common contract is in tests/conformance/test_fs.py."""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import struct
import sys
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.fs.connector import FileConnector
from gateway import Store
from gateway.errors import (
    CapacityError,
    ConfigError,
    CorruptObject,
    GatewayError,
    Unavailable,
)
from gateway.testing import assert_same_bytes, listed, make_bytes

KiB = 1 << 10
MiB = 1 << 20


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def record_files(root: Path) -> list[Path]:
    return files_under(root / "objects")


def on_disk(path: str) -> bool:
    return os.path.exists(path)


async def test_record_format_on_disk(tmp_path: Path) -> None:
    conn = FileConnector(tmp_path)
    await conn.put("model@1@0@abc@bfloat16", [b"hello ", b"world"])
    await conn.close()
    [path] = record_files(tmp_path)
    assert str(path) == conn.path_for("model@1@0@abc@bfloat16")
    raw = path.read_bytes()
    magic, version, reserved, key_len, data_len, check = struct.unpack_from("<4sB3sIQI", raw)
    key = raw[24 : 24 + key_len]
    assert (magic, version, reserved, key, data_len) == (
        b"KVGD",
        1,
        b"\0\0\0",
        b"model@1@0@abc@bfloat16",
        11,
    )
    assert check == xxhash.xxh32_intdigest(raw[:20] + key)
    assert raw[24 + key_len :] == b"hello world"
    rel = path.relative_to(tmp_path / "objects")
    assert rel.parts[:2] == (path.stem[:2], path.stem[2:4])
    assert path.suffix == ".kvo"


@pytest.mark.parametrize("fsync_dir", [False, True])
async def test_restart_rebuilds_the_index_from_headers(tmp_path: Path, fsync_dir: bool) -> None:
    objects = {f"k{i}": make_bytes(size, seed=i) for i, size in enumerate((0, 1, 4 * KiB, MiB))}
    first = FileConnector(tmp_path, fsync_dir=fsync_dir)
    for key, data in objects.items():
        await first.put(key, data)
    await first.put("k1", b"overwritten")
    objects["k1"] = b"overwritten"
    await first.close()

    second = FileConnector.from_url(tmp_path.as_uri())
    assert second.usage() == (0, None)  # nothing is read before the first operation
    assert await listed(second, "") == {k: len(v) for k, v in objects.items()}
    assert second.usage() == (sum(len(v) for v in objects.values()), None)
    for key, data in objects.items():
        assert_same_bytes(await second.get(key), data, key)
    await second.close()


async def test_stale_temp_files_are_removed_at_start(tmp_path: Path) -> None:
    await FileConnector(tmp_path).close()
    stale = tmp_path / "tmp" / "deadbeef.kvo.0123456789abcdef"
    stale.write_bytes(b"half a put")
    conn = FileConnector(tmp_path)
    await conn.open()
    assert list((tmp_path / "tmp").iterdir()) == []
    await conn.close()


def _mangle_magic(path: Path) -> None:
    with path.open("r+b") as f:
        f.write(b"XXXX")


def _mangle_key(path: Path) -> None:
    with path.open("r+b") as f:  # the key is covered by the header checksum
        f.seek(24)
        f.write(b"?")


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


def _append(path: Path) -> None:
    with path.open("ab") as f:
        f.write(b"trailing")


def _empty(path: Path) -> None:
    os.truncate(path, 0)


MANGLERS = [_mangle_magic, _mangle_key, _truncate, _append, _empty]


@pytest.mark.parametrize("mangle", MANGLERS)
async def test_broken_record_found_at_start_is_quarantined(tmp_path: Path, mangle: object) -> None:
    assert callable(mangle)
    conn = FileConnector(tmp_path)
    await conn.put("bad", b"x" * 100)
    await conn.put("good", b"y" * 10)
    await conn.close()
    mangle(Path(conn.path_for("bad")))

    conn = FileConnector(tmp_path)
    with pytest.raises(CorruptObject):  # the store counts it as corrupt, then a miss
        await conn.get("bad")
    assert await conn.get("bad") is None
    assert not await conn.exists("bad")
    assert conn.corrupt_files == 1
    assert conn.usage() == (10, None)
    assert len(list((tmp_path / "quarantine").iterdir())) == 1
    assert not on_disk(conn.path_for("bad"))
    assert await conn.get("good") == b"y" * 10
    await conn.close()


@pytest.mark.parametrize("mangle", MANGLERS)
@pytest.mark.parametrize("read", ["get", "get_into"])
async def test_broken_record_found_by_a_read_is_a_miss(
    tmp_path: Path, mangle: object, read: str
) -> None:
    assert callable(mangle)
    conn = FileConnector(tmp_path)
    await conn.put("bad", b"x" * 100)
    mangle(Path(conn.path_for("bad")))
    reading = conn.get("bad") if read == "get" else conn.get_into("bad", _new_buffer)
    with pytest.raises(CorruptObject):  # the store counts it as corrupt, then a miss
        await reading
    assert await conn.get("bad") is None
    assert not await conn.exists("bad")
    assert conn.corrupt_files == 1
    assert conn.usage() == (0, None)
    assert len(list((tmp_path / "quarantine").iterdir())) == 1
    await conn.put("bad", b"fresh")  # the key is usable again
    assert await conn.get("bad") == b"fresh"
    await conn.close()


@pytest.mark.parametrize("mangle", MANGLERS)
async def test_the_store_counts_a_broken_file_as_corrupt(tmp_path: Path, mangle: object) -> None:
    assert callable(mangle)
    probe = FileConnector(tmp_path)  # where the tier will keep the key
    path = Path(probe.path_for("bad"))
    await probe.close()
    config = {"tiers": [{"url": f"file://{tmp_path}"}], "staging": 1 << 20}
    async with Store(config) as store:
        await store.put("bad", b"x" * 1000)
        await store.flush()
        mangle(path)
        assert await store.get("bad") is None
        assert store.stats()["file"].corrupt == 1


def _new_buffer(nbytes: int) -> memoryview:
    return memoryview(bytearray(nbytes))


async def test_another_keys_record_is_a_miss_not_its_data(tmp_path: Path) -> None:
    conn = FileConnector(tmp_path)
    await conn.put("a", b"value of a")
    await conn.put("b", b"value of b")
    # What a hash collision looks like from a reader's side: a's path holds b's record.
    os.replace(conn.path_for("b"), conn.path_for("a"))
    with pytest.raises(CorruptObject):
        await conn.get("a")
    assert not await conn.exists("a")
    await conn.close()


async def test_file_removed_behind_its_back_is_a_miss(tmp_path: Path) -> None:
    conn = FileConnector(tmp_path)
    await conn.put("k", b"12345")
    os.unlink(conn.path_for("k"))
    assert await conn.exists("k")  # the index is trusted until a read finds out
    assert await conn.get("k") is None
    assert not await conn.exists("k")
    assert conn.usage() == (0, None)
    assert conn.corrupt_files == 0
    await conn.close()


async def test_key_paths_never_leave_the_root(tmp_path: Path) -> None:
    conn = FileConnector(tmp_path / "root")
    objects = tmp_path / "root" / "objects"

    @settings(max_examples=300, deadline=None)
    @given(st.text(st.characters(exclude_categories=())))  # surrogates and NUL included
    def check(key: str) -> None:
        path = Path(os.path.realpath(conn.path_for(key)))
        assert path.is_relative_to(objects)
        a, b, name = path.relative_to(objects).parts
        digest = name.removesuffix(".kvo")
        assert len(digest) == 40
        assert set(digest) <= set("0123456789abcdef")
        assert (a, b) == (digest[:2], digest[2:4])

    check()
    await conn.close()


async def test_odd_keys_write_nothing_outside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "inner" / "root"
    conn = FileConnector(root)
    keys = ["../../escape", "../../../etc/passwd", "/tmp/abs", "..", "a/../../b", "\x00"]
    for key in keys:
        await conn.put(key, key.encode())
    for key in keys:
        assert await conn.get(key) == key.encode()
    await conn.close()
    assert all(p.is_relative_to(root) for p in files_under(tmp_path))
    names = sorted(p.name for p in root.iterdir())
    assert names == [".lock", "index", "objects", "quarantine", "tmp"]  # index: at close
    assert len(record_files(root)) == len(keys)


@pytest.mark.parametrize(("eviction", "survivors"), [("lru", "acd"), ("fifo", "bcd")])
async def test_capacity_evicts_in_policy_order(
    tmp_path: Path, eviction: str, survivors: str
) -> None:
    conn = FileConnector.from_url(tmp_path.as_uri(), capacity=3 * KiB, eviction=eviction)
    for key in "abc":
        await conn.put(key, make_bytes(KiB, seed=ord(key)))
    assert await conn.get("a") is not None  # a hit: LRU keeps a, FIFO does not care
    await conn.put("d", make_bytes(KiB, seed=ord("d")))
    assert [k for k in "abcd" if await conn.exists(k)] == list(survivors)
    assert conn.usage() == (3 * KiB, 3 * KiB)
    assert len(record_files(tmp_path)) == 3
    for key in survivors:
        assert_same_bytes(await conn.get(key), make_bytes(KiB, seed=ord(key)), key)
    await conn.close()


async def test_overwrites_and_deletes_keep_usage_exact(tmp_path: Path) -> None:
    conn = FileConnector(tmp_path, capacity=10 * KiB)
    await conn.put("a", b"x" * 4 * KiB)
    await conn.put("b", b"x" * 4 * KiB)
    await conn.put("a", b"x" * 6 * KiB)  # grows into the free room: nothing to evict
    assert conn.usage() == (10 * KiB, 10 * KiB)
    assert await conn.exists("b")
    await conn.put("a", b"x")
    assert await conn.delete("b")
    assert conn.usage() == (1, 10 * KiB)
    await conn.close()


async def test_concurrent_puts_under_capacity_keep_the_books_straight(tmp_path: Path) -> None:
    conn = FileConnector(tmp_path, capacity=10 * KiB, fsync=False, fsync_dir=False)
    sizes = [KiB * (1 + i % 3) for i in range(60)]

    async def churn(i: int) -> None:
        await conn.put(f"k{i % 20}", make_bytes(sizes[i], seed=i))
        await conn.get(f"k{(i * 7) % 20}")
        if i % 5 == 0:
            await conn.delete(f"k{(i * 3) % 20}")

    results = []
    for wave in range(6):  # 10 operations in flight over 20 keys
        batch = (churn(i) for i in range(wave * 10, wave * 10 + 10))
        results += await asyncio.gather(*batch, return_exceptions=True)
    # A put that finds every stored object in use by other operations cannot make room: that
    # is a CapacityError (it does not fit now), never a hang and never a wrong count. With 10
    # in flight over 20 keys it is rare; with 60 at once it is common.
    failures = [r for r in results if r is not None]
    assert all(isinstance(r, CapacityError) for r in failures), failures
    assert len(failures) < len(results) // 4
    async with asyncio.timeout(30):
        results = await asyncio.gather(*(churn(i) for i in range(60)), return_exceptions=True)
    failures = [r for r in results if r is not None]
    assert all(isinstance(r, CapacityError) for r in failures), failures
    stored = await listed(conn, "")
    used, capacity = conn.usage()
    assert capacity == 10 * KiB
    assert used == sum(stored.values())
    assert used <= 10 * KiB
    assert len(record_files(tmp_path)) == len(stored)
    for key, size in stored.items():
        got = await conn.get(key)
        assert got is not None
        assert len(got) == size
    await conn.close()


async def test_oversized_object_is_refused_before_writing(tmp_path: Path) -> None:
    conn = FileConnector(tmp_path, capacity=MiB)
    await conn.put("small", b"s")
    with pytest.raises(CapacityError, match="larger than the capacity"):
        await conn.put("big", [b"x" * MiB, b"y"])
    assert not await conn.exists("big")
    assert conn.usage() == (1, MiB)
    assert len(record_files(tmp_path)) == 1
    assert list((tmp_path / "tmp").iterdir()) == []
    await conn.close()


async def test_smaller_capacity_at_restart_evicts_the_oldest(tmp_path: Path) -> None:
    conn = FileConnector(tmp_path)
    for i, key in enumerate("abc"):
        await conn.put(key, b"x" * 10)
        os.utime(conn.path_for(key), ns=(10**18 + i, 10**18 + i))
    await conn.close()
    conn = FileConnector(tmp_path, capacity=20)
    assert [k for k in "abc" if await conn.exists(k)] == ["b", "c"]
    assert conn.usage() == (20, 20)
    assert not on_disk(conn.path_for("a"))
    await conn.close()


async def test_directory_lock(tmp_path: Path) -> None:
    first = FileConnector(tmp_path)
    with pytest.raises(ConfigError, match="is in use"):
        FileConnector(tmp_path)
    # Another process is kept out too.
    probe = (
        "import fcntl, os, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "except BlockingIOError:\n    sys.exit(3)\n"
    )
    lock = str(tmp_path / ".lock")
    other = await asyncio.create_subprocess_exec(sys.executable, "-c", probe, lock)
    assert await other.wait() == 3
    await first.close()
    second = FileConnector(tmp_path)
    await second.close()
    with pytest.raises(GatewayError, match="closed"):
        await second.get("k")
    forgotten = FileConnector(tmp_path)
    del forgotten  # never closed: collecting it releases the lock
    gc.collect()
    await FileConnector(tmp_path).close()


def test_url_and_options(tmp_path: Path) -> None:
    spaced = tmp_path / "with space"
    conn = FileConnector.from_url(spaced.as_uri(), capacity="1024", fsync=False, fsync_dir=False)
    assert conn.root == str(spaced)
    assert (conn.capacity, conn.fsync, conn.fsync_dir) == (1024, False, False)
    assert conn.capabilities.persistent
    assert conn.capabilities.zero_copy
    asyncio.run(conn.close())
    bad: list[tuple[str, dict[str, object], str]] = [
        (tmp_path.as_uri(), {"fsyncc": True}, "'fsyncc'"),
        (tmp_path.as_uri(), {"capacity": 0}, "'capacity'"),
        (tmp_path.as_uri(), {"eviction": "nope"}, "unknown eviction policy"),
        ("file://relative/path", {}, "absolute path"),
        ("file:relative", {}, "absolute path"),
        (tmp_path.as_uri() + "?capacity=1", {}, "keyword arguments"),
        ("memory://x", {}, "not a file:// URL"),
    ]
    for url, options, message in bad:
        with pytest.raises(ConfigError, match=message):
            FileConnector.from_url(url, **options)


async def test_cancelled_put_leaves_no_temp_file_and_a_true_index(tmp_path: Path) -> None:
    conn = FileConnector(tmp_path)
    data = make_bytes(64 * MiB)
    for i, delay in enumerate((0.0, 0.001, 0.005, 0.02)):
        key = f"k{i}"
        task = asyncio.create_task(conn.put(key, data))
        await asyncio.sleep(delay)
        if task.cancel():  # False: the put finished first on a fast disk, which is fine too
            with pytest.raises(asyncio.CancelledError):
                await task
        assert list((tmp_path / "tmp").iterdir()) == []
        stored = await conn.exists(key)
        assert stored == on_disk(conn.path_for(key))
        if stored:  # cancelled too late to stop: then the object is whole
            assert_same_bytes(await conn.get(key), data, key)
    sizes = await listed(conn, "")
    assert conn.usage() == (sum(sizes.values()), None)
    await conn.close()


async def test_full_disk_is_a_capacity_error_and_leaves_nothing_behind(small_disk: Path) -> None:
    conn = FileConnector(small_disk / "store")
    try:
        kept = {k: make_bytes(512 * KiB, seed=i) for i, k in enumerate(("a", "b"))}
        for key, data in kept.items():
            await conn.put(key, data)
        with pytest.raises(CapacityError, match="disk full"):
            await conn.put("too-big", [make_bytes(2 * MiB), make_bytes(2 * MiB, seed=1)])
        assert list((small_disk / "store" / "tmp").iterdir()) == []
        assert not await conn.exists("too-big")
        assert not on_disk(conn.path_for("too-big"))
        for key, data in kept.items():
            assert_same_bytes(await conn.get(key), data, key)
        assert conn.usage() == (MiB, None)
        await conn.put("small", b"still works")
        assert await conn.get("small") == b"still works"
    finally:
        await conn.close()


@pytest.mark.parametrize("removed", ["", "objects", "tmp"])
async def test_a_directory_removed_in_use_is_named_in_the_error(
    tmp_path: Path, removed: str
) -> None:
    """``rm -rf`` of the data directory (or of ``objects/`` or ``tmp/``) under a running tier:
    its puts and its ping say which directory went away, not a bare fan-out folder name, also
    once a directory is made again at the path (the tier's open one is still the old one)."""
    root = tmp_path / "data"
    conn = FileConnector(root)
    try:
        await conn.put("before", [b"x"])
        assert await conn.ping()
        gone = root / removed if removed else root
        await asyncio.to_thread(shutil.rmtree, gone)
        gone.mkdir(parents=True)
        with pytest.raises(Unavailable, match=f"{gone} was removed while in use"):
            await conn.put("after", [b"y" * 4096])
        with pytest.raises(Unavailable, match=f"{gone} was removed while in use"):
            await conn.ping()
    finally:
        await conn.close()
