"""file:// reads of large objects: two threads taking interleaved steps, a file replaced
behind the index, a file cut short while it is read, and a cancelled read; each through the
page cache and with ``direct_io`` (objects put from page-aligned memory, so that their records
are padded and read with O_DIRECT, in place into buffers the allocator places)."""

from __future__ import annotations

import asyncio
import itertools
import mmap
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from connectors.fs import record as rec
from connectors.fs.connector import FileConnector
from connectors.fs.read import PARALLEL_READ_BYTES
from connectors.fs.record import DIRECT_READ_STEP
from gateway.errors import CorruptObject

MiB = 1 << 20
BIG = PARALLEL_READ_BYTES + 3 * MiB + 123  # two reading threads, a short last step


def payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture(params=[False, True], ids=["buffered", "direct_io"])
def direct(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


async def put(conn: FileConnector, key: str, data: bytes, direct: bool) -> None:
    """Put ``data``; with ``direct``, from page-aligned memory (a padded record)."""
    if not direct:
        await conn.put(key, data)
        return
    memory = mmap.mmap(-1, len(data))
    memory[:] = data
    await conn.put(key, memoryview(memory))


def data_offset(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return rec.read_record(fd).data_offset
    finally:
        os.close(fd)


class Recorder:
    """An allocator with the fill and placement hooks: records what the connector reports."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []
        self.sizes: list[int] = []
        self.phases: list[int] = []

    def __call__(self, n: int) -> memoryview:
        self.sizes.append(n)
        self.ranges.clear()
        return memoryview(bytearray(n))

    def placed(self, n: int, phase: int) -> memoryview:
        self.sizes.append(n)
        self.phases.append(phase)
        self.ranges.clear()
        return memoryview(mmap.mmap(-1, n + rec.DIO_ALIGN))[phase : phase + n]

    def filled(self, start: int, stop: int) -> None:
        self.ranges.append((start, stop))  # list.append is atomic: called from two threads


async def test_large_read_reports_every_byte_once(tmp_path: Path, direct: bool) -> None:
    conn = FileConnector(tmp_path, direct_io=direct)
    data = payload(BIG, 1)
    await put(conn, "k", data, direct)
    alloc = Recorder()
    got = await conn.get_into("k", alloc)
    assert got is not None
    assert bytes(got) == data
    assert len(alloc.phases) == direct  # a direct read asks for a placed buffer
    covered = sorted(alloc.ranges)
    assert covered[0][0] == 0
    assert covered[-1][1] == BIG
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))
    await conn.close()


async def test_a_file_replaced_with_another_size_is_read_at_its_size(
    tmp_path: Path, direct: bool
) -> None:
    """What a put racing a get looks like: the index says one size, the file has another."""
    conn = FileConnector(tmp_path, direct_io=direct)
    small = payload(1000, 2)
    await conn.put("k", small)
    saved = tmp_path / "saved"
    shutil.copy(conn.path_for("k"), saved)
    await put(conn, "k", payload(BIG, 3), direct)
    os.replace(saved, conn.path_for("k"))
    alloc = Recorder()
    got = await conn.get_into("k", alloc)
    assert got is not None
    assert bytes(got) == small
    assert alloc.sizes == [BIG, 1000]
    await conn.close()


class CutsTheFile(Recorder):
    """Shrinks the file once the first step is in: the later steps, in either thread, find it
    short (what a disk that loses the file's tail mid-read looks like)."""

    def __init__(self, path: str, size: int) -> None:
        super().__init__()
        self.path, self.size = path, size

    def filled(self, start: int, stop: int) -> None:
        if not self.ranges:
            os.truncate(self.path, self.size)
        super().filled(start, stop)


@pytest.mark.parametrize("keep", ["1MiB+1", "half", "all but 1"])
async def test_a_record_cut_short_mid_read_is_a_miss(
    tmp_path: Path, keep: str, direct: bool
) -> None:
    # Enough steps that some are taken after the first one is in (direct steps are larger).
    size = 3 * DIRECT_READ_STEP + 123 if direct else BIG
    kept = {"1MiB+1": MiB + 1, "half": size // 2, "all but 1": size - 1}[keep]
    conn = FileConnector(tmp_path, direct_io=direct)
    await put(conn, "k", payload(size, 4), direct)
    path = conn.path_for("k")
    cutter = CutsTheFile(path, data_offset(path) + kept)
    with pytest.raises(CorruptObject):  # the store counts it as corrupt, then a miss
        await conn.get_into("k", cutter)
    assert bool(cutter.phases) == direct  # in place
    assert not await conn.exists("k")
    assert conn.corrupt_files == 1  # the short file went to quarantine
    await conn.put("k", b"fresh")
    assert await conn.get("k") == b"fresh"
    await conn.close()


async def test_a_cancelled_large_read_leaves_the_connector_usable(
    tmp_path: Path, direct: bool
) -> None:
    conn = FileConnector(tmp_path, direct_io=direct)
    data = payload(BIG, 5)
    await put(conn, "k", data, direct)
    for delay in (0, 0.0005, 0.002):
        task = asyncio.ensure_future(conn.get_into("k", Recorder()))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            got = await task
        except asyncio.CancelledError:
            pass
        else:  # it finished before the cancel landed: then it is whole
            assert got is not None
            assert bytes(got) == data
    got = await conn.get("k")
    assert got is not None
    assert bytes(got) == data
    await conn.close()
