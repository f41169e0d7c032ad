"""file:// with ``direct_io``: which puts bypass the page cache, the padded record (version
2) they write, its rules, reading it back either way, and a filesystem that refuses O_DIRECT.

Page-cache residency is read with util-linux's ``fincore`` (Debian's util-linux, always
installed there; without it those checks are vacuous).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import itertools
import logging
import mmap
import os
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from connectors.fs import record as rec
from connectors.fs.connector import FileConnector
from connectors.fs.read import DIRECT_IO_BYTES
from gateway import Store
from gateway.config import load_config
from gateway.errors import CapacityError, CorruptObject
from gateway.testing import assert_same_bytes, make_bytes

MiB = 1 << 20
FEW_PAGES = 64 << 10  # the header's pages and the kernel's readahead around them
LEAD = b"frame head stand-in" * 5  # a data part before the payload, as a frame head is


def aligned(data: bytes) -> memoryview:
    """``data`` copied into page-aligned memory, as a slab of the store's pool holds it."""
    memory = mmap.mmap(-1, max(1, len(data)))
    memory[: len(data)] = data
    view = memoryview(memory)[: len(data)]
    assert rec.is_aligned(view) or not data
    return view


def resident_bytes(path: str) -> int:
    """Bytes of ``path`` in the page cache (0 where util-linux's fincore is missing: the
    checks that use this then pass without testing anything, which the docstring says)."""
    if shutil.which("fincore") is None:
        return 0
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", path],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip())


def file_size(path: str) -> int:
    return os.stat(path).st_size


def on_disk(path: str) -> bool:
    return os.path.exists(path)


def flip_byte(path: str, from_end: int) -> None:
    with open(path, "r+b") as f:
        f.seek(-from_end, os.SEEK_END)
        byte = f.read(1)
        f.seek(-from_end, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))


def record_fields(path: str) -> tuple[int, int, int]:
    """(version, pad, data offset) of the record at ``path``."""
    with open(path, "rb") as f:
        head = f.read(rec.HEADER_LEN)
    _magic, version, _flags, pad, key_len, _data_len = struct.unpack_from("<4sBBHIQ", head)
    return version, pad, rec.HEADER_LEN + key_len + pad


@pytest.mark.parametrize("size", [DIRECT_IO_BYTES, DIRECT_IO_BYTES + 1, 9 * MiB + 123])
async def test_an_aligned_payload_is_written_past_the_page_cache(tmp_path: Path, size: int) -> None:
    body = make_bytes(size, seed=size)
    conn = FileConnector(tmp_path, direct_io=True)
    await conn.put("k", [LEAD, aligned(body)])
    path = conn.path_for("k")
    # Nothing of the payload went through the page cache (a buffered put leaves it all there):
    # at most the pages around the header, which the get below reads buffered.
    assert resident_bytes(path) <= FEW_PAGES
    assert_same_bytes(await conn.get("k"), LEAD + body)
    assert resident_bytes(path) <= FEW_PAGES  # read back with O_DIRECT too
    version, pad, data_offset = record_fields(path)
    assert (data_offset + len(LEAD)) % rec.DIO_ALIGN == 0  # the payload starts on a block
    assert (version, pad > 0) == (rec.VERSION_PADDED, True)
    assert file_size(path) == data_offset + len(LEAD) + size  # no block padding left
    await conn.close()
    # A buffered connector reads the padded record, and a restart finds it.
    again = FileConnector(tmp_path)
    assert await again.exists("k")
    assert again.usage() == (len(LEAD) + size, None)
    assert_same_bytes(await again.get("k"), LEAD + body)
    await again.close()


@pytest.mark.parametrize(
    "parts",
    [
        pytest.param(lambda: [make_bytes(4 * MiB)], id="unaligned payload"),
        pytest.param(lambda: [LEAD, aligned(make_bytes(DIRECT_IO_BYTES - 1))], id="small"),
        pytest.param(lambda: [aligned(make_bytes(4 * MiB)), LEAD], id="aligned part not last"),
    ],
)
async def test_other_puts_go_through_the_page_cache(tmp_path: Path, parts: Any) -> None:
    data = parts()
    conn = FileConnector(tmp_path, direct_io=True)
    await conn.put("k", data)
    version, pad, _ = record_fields(conn.path_for("k"))
    assert (version, pad) == (rec.VERSION, 0)
    assert_same_bytes(await conn.get("k"), b"".join(bytes(p) for p in data))
    await conn.close()


async def test_objects_come_back_aligned_whichever_record_holds_them(tmp_path: Path) -> None:
    """Unpadded records (written without direct_io) are read through the page cache, padded
    ones in place at their data's phase: either way the payload a get returns starts on at
    least the frame's 64-byte alignment (on a page, for padded records)."""
    obj = np.arange(3 * MiB // 8 + 5, dtype=np.float64)
    cfg: dict[str, Any] = {"tiers": [{"url": tmp_path.as_uri()}]}
    async with Store(cfg) as store:
        await store.put("unpadded", obj)
    cfg["tiers"][0]["options"] = {"direct_io": True}
    async with Store(cfg) as store:
        await store.put("padded", obj)
        await store.flush()
        for key, alignment in (("unpadded", 64), ("padded", rec.DIO_ALIGN)):
            got = await store.get(key)
            assert isinstance(got, np.ndarray)
            assert np.array_equal(got, obj)
            assert got.ctypes.data % alignment == 0, key


def _fixed(version: int, flags: int, pad: int, key: bytes, data_len: int) -> bytes:
    """A record head with any field values and a correct checksum."""
    fixed = struct.pack("<4sBBHIQ", rec.MAGIC, version, flags, pad, len(key), data_len)
    check = rec._check(fixed, key)
    return fixed + struct.pack("<I", check) + key


@pytest.mark.parametrize(
    ("version", "flags", "pad", "why"),
    [
        (rec.VERSION, 0, 8, "padding"),
        (rec.VERSION_PADDED, 0, 0, "padding"),
        (rec.VERSION, 1, 0, "flags"),
        (3, 0, 0, "version 3"),
    ],
)
def test_record_heads_that_break_the_padding_rules_are_bad(
    tmp_path: Path, version: int, flags: int, pad: int, why: str
) -> None:
    path = tmp_path / "r.kvo"
    path.write_bytes(_fixed(version, flags, pad, b"k", 3) + bytes(pad) + b"abc")
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(rec.BadRecord, match=why):
            rec.read_record(fd)
    finally:
        os.close(fd)


def test_a_padded_record_is_read_from_past_its_padding(tmp_path: Path) -> None:
    path = tmp_path / "r.kvo"
    path.write_bytes(_fixed(rec.VERSION_PADDED, 0, 7, b"k", 3) + bytes(7) + b"abc")
    fd = os.open(path, os.O_RDONLY)
    try:
        record = rec.read_record(fd)
    finally:
        os.close(fd)
    assert (record.key, record.data_offset, record.data_len) == ("k", rec.HEADER_LEN + 8, 3)


async def test_store_round_trips_and_checks_direct_records(tmp_path: Path) -> None:
    """Through a Store the payload is a page-aligned staging slab: every large put goes
    direct; a flipped payload byte in such a record is a counted corrupt miss."""
    cfg = {"tiers": [{"url": tmp_path.as_uri(), "options": {"direct_io": True}}]}
    objs = {
        "bf16": torch.randn(3, 1024, 513).to(torch.bfloat16),
        "f32": torch.randn(2 * MiB // 4 + 3),
        "u8": np.arange(5 * MiB, dtype=np.uint8),
    }
    async with Store(cfg) as store:
        for key, obj in objs.items():
            await store.put(key, obj)
        await store.flush()
        paths = {k: object_path(tmp_path, k) for k in objs}
        for key, obj in objs.items():
            assert record_fields(paths[key])[0] == rec.VERSION_PADDED
            got = await store.get(key)
            if isinstance(obj, torch.Tensor):
                assert isinstance(got, torch.Tensor)
                assert torch.equal(got, obj)
            else:
                assert isinstance(got, np.ndarray)
                assert np.array_equal(got, obj)
        flip_byte(paths["u8"], 1000)
        assert await store.get("u8") is None
        assert sum(s.corrupt for s in store.stats().values()) == 1


async def test_the_embedded_default_keeps_large_objects_out_of_the_page_cache(
    tmp_path: Path,
) -> None:
    """No config at all (memory + disk): what the memory tier holds is not cached a second time
    by the page cache, and a restart reads it back from the disk."""
    cfg = load_config({"prefault": False}, env={"KVGATE_DATA_DIR": str(tmp_path)})
    obj = torch.randn(4 * MiB // 4)
    async with Store(cfg) as store:
        await store.put("chunk", obj)
        await store.flush()
    path = object_path(tmp_path, "chunk")
    assert record_fields(path)[0] == rec.VERSION_PADDED
    assert resident_bytes(path) <= FEW_PAGES  # buffered, all 4 MiB would be resident
    async with Store(cfg) as store:  # a fresh memory tier: the disk tier answers
        got = await store.get("chunk")
        assert isinstance(got, torch.Tensor)
        assert torch.equal(got, obj)


def object_path(root: Path, key: str) -> str:
    return str(root.joinpath("objects", *rec.object_name(key)))


async def test_a_filesystem_that_refuses_o_direct_turns_it_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What tmpfs before Linux 6.6 and some network filesystems do: EINVAL at open."""
    real_open = os.open

    def refusing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:  # as Linux does: the file is created, then O_DIRECT refused
            os.close(real_open(path, flags & ~os.O_DIRECT, *args, **kwargs))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    conn = FileConnector(tmp_path, direct_io=True)
    monkeypatch.setattr(os, "open", refusing_open)
    body = make_bytes(2 * MiB)
    with caplog.at_level(logging.WARNING, logger="connectors.fs.connector"):
        await conn.put("k", [LEAD, aligned(body)])
    assert "refused O_DIRECT" in caplog.text
    assert conn.direct_io is False
    assert list((tmp_path / "tmp").iterdir()) == []
    assert_same_bytes(await conn.get("k"), LEAD + body)
    monkeypatch.undo()
    await conn.close()


async def test_a_cancelled_direct_put_leaves_no_temp_file(tmp_path: Path) -> None:
    conn = FileConnector(tmp_path, direct_io=True)
    body = aligned(make_bytes(64 * MiB))
    for i, delay in enumerate((0.0, 0.001, 0.005, 0.02)):
        key = f"k{i}"
        task = asyncio.create_task(conn.put(key, [LEAD, body]))
        await asyncio.sleep(delay)
        if task.cancel():
            with pytest.raises(asyncio.CancelledError):
                await task
        assert list((tmp_path / "tmp").iterdir()) == []
        if await conn.exists(key):  # cancelled too late to stop: then it is whole
            assert_same_bytes(await conn.get(key), LEAD + bytes(body))
    await conn.close()


class PlacedRecorder:
    """An allocator with ``placed``: records the phases a connector asks for."""

    def __init__(self) -> None:
        self.phases: list[int] = []

    def __call__(self, n: int) -> memoryview:
        return memoryview(bytearray(n))

    def placed(self, n: int, phase: int) -> memoryview:
        self.phases.append(phase)
        page = aligned(bytes(n + rec.DIO_ALIGN))
        return page[phase : phase + n]


async def test_a_direct_read_asks_for_a_buffer_at_the_datas_phase(tmp_path: Path) -> None:
    body = make_bytes(3 * MiB + 7)
    conn = FileConnector(tmp_path, direct_io=True)
    await conn.put("k", [LEAD, aligned(body)])
    _, _, data_offset = record_fields(conn.path_for("k"))
    alloc = PlacedRecorder()
    assert_same_bytes(await conn.get_into("k", alloc), LEAD + body)
    await conn.close()
    again = FileConnector(tmp_path, direct_io=True)  # the phase comes from the scan now
    assert_same_bytes(await again.get_into("k", alloc), LEAD + body)
    assert alloc.phases == [data_offset % rec.DIO_ALIGN] * 2
    await again.close()


@pytest.mark.parametrize("size", [MiB, MiB + 1, 3 * MiB + 7])
@pytest.mark.parametrize("key", ["k", "long/" + "k" * 5000])  # a head over one block
async def test_a_placed_direct_read_is_one_request_and_leaves_no_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int, key: str
) -> None:
    # A raw O_DIRECT read of a file is one request; the header read on its own and the data's
    # partial blocks each cost one more, and the header's read filled the page cache.
    body = make_bytes(size, seed=size)
    conn = FileConnector(tmp_path, direct_io=True)
    await conn.put(key, [LEAD, aligned(body)])
    calls: list[int] = []
    real_preadv = os.preadv
    real_pread = os.pread

    def counting_preadv(fd: int, buffers: Any, offset: int) -> int:
        calls.append(offset)
        return real_preadv(fd, buffers, offset)

    def counting_pread(fd: int, n: int, offset: int) -> bytes:
        calls.append(offset)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "preadv", counting_preadv)
    monkeypatch.setattr(os, "pread", counting_pread)
    assert_same_bytes(await conn.get_into(key, PlacedRecorder()), LEAD + body)
    monkeypatch.undo()
    assert calls == [0]
    assert resident_bytes(conn.path_for(key)) == 0
    await conn.close()


@pytest.mark.parametrize(
    "mangle",
    [
        pytest.param(lambda p: flip_byte(p, file_size(p)), id="magic"),
        pytest.param(lambda p: flip_byte(p, file_size(p) - 24), id="key"),
        pytest.param(lambda p: os.truncate(p, file_size(p) - 1), id="truncated"),
        pytest.param(lambda p: os.truncate(p, file_size(p) + 1), id="longer by a byte"),
        pytest.param(lambda p: os.truncate(p, file_size(p) + 3 * 4096), id="longer by blocks"),
        pytest.param(lambda p: os.truncate(p, 100), id="cut in the head"),
        pytest.param(lambda p: os.truncate(p, 0), id="empty"),
    ],
)
async def test_a_placed_direct_read_of_a_broken_record_quarantines_it(
    tmp_path: Path, mangle: Any
) -> None:
    conn = FileConnector(tmp_path, direct_io=True)
    await conn.put("k", [LEAD, aligned(make_bytes(MiB))])
    mangle(conn.path_for("k"))
    with pytest.raises(CorruptObject):
        await conn.get_into("k", PlacedRecorder())
    assert not await conn.exists("k")
    assert conn.corrupt_files == 1
    await conn.close()


@pytest.mark.parametrize("other_size", [MiB, 2 * MiB, 100])
async def test_a_placed_direct_read_finds_the_record_that_replaced_the_indexed_one(
    tmp_path: Path, other_size: int
) -> None:
    """Another record of the key in place of the one indexed (as a put racing the read
    leaves it): read as that record, whatever its size and layout, never cut to the old one."""
    conn = FileConnector(tmp_path / "a", direct_io=True)
    await conn.put("k", [LEAD, aligned(make_bytes(MiB))])
    other = FileConnector(tmp_path / "b", direct_io=True)
    newer = make_bytes(other_size, seed=7)
    await other.put("k", [b"another lead", aligned(newer)] if other_size > 100 else newer)
    os.replace(other.path_for("k"), conn.path_for("k"))
    want = (b"another lead" + newer) if other_size > 100 else newer
    assert_same_bytes(await conn.get_into("k", PlacedRecorder()), want)
    await conn.close()
    await other.close()


async def test_another_keys_record_under_a_placed_direct_read_is_a_miss(tmp_path: Path) -> None:
    conn = FileConnector(tmp_path, direct_io=True)
    await conn.put("a", [LEAD, aligned(make_bytes(MiB))])
    await conn.put("b", [LEAD, aligned(make_bytes(MiB, seed=2))])
    os.replace(conn.path_for("b"), conn.path_for("a"))  # what a hash collision looks like
    with pytest.raises(CorruptObject):
        await conn.get_into("a", PlacedRecorder())
    await conn.close()


@pytest.mark.parametrize("offset", [0, 24, 4095, 4096, 5000])
@pytest.mark.parametrize("total", [1, 4096, 3 * MiB + 5, rec.DIRECT_READ_STEP + 4097])
@pytest.mark.parametrize("same_phase", [True, False])
def test_direct_steps_cover_the_buffer_once_and_read_in_place_only_aligned(
    offset: int, total: int, same_phase: bool
) -> None:
    page = aligned(bytes(total + 2 * rec.DIO_ALIGN))
    shift = offset % rec.DIO_ALIGN if same_phase else (offset + 64) % rec.DIO_ALIGN
    buf = page[shift : shift + total]
    steps = rec.Steps.direct(buf, offset)
    pieces = []
    while (piece := steps.take()) is not None:
        pieces.append(piece)
    assert pieces[0][0] == 0
    assert pieces[-1][1] == total
    assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
    for start, end, bounce in pieces:
        assert end - start <= (rec.BOUNCE_STEP if bounce else rec.DIRECT_READ_STEP)
        if not bounce:  # the disk writes these bytes into the buffer itself
            assert (offset + start) % rec.DIO_ALIGN == 0
            assert (end - start) % rec.DIO_ALIGN == 0
            assert rec.is_aligned(buf[start:end])
    in_place = sum(end - start for start, end, bounce in pieces if not bounce)
    whole_block_inside = -offset % rec.DIO_ALIGN + rec.DIO_ALIGN <= total
    assert (in_place > 0) == (same_phase and whole_block_inside)


async def test_a_filesystem_that_refuses_o_direct_writes_gets_them_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """O_DIRECT taken at open but refused by the writes (an alignment larger than a page)."""

    def refusing_pwrite(*args: Any) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    conn = FileConnector(tmp_path, direct_io=True)
    monkeypatch.setattr(os, "pwrite", refusing_pwrite)  # the positioned writes O_DIRECT uses
    monkeypatch.setattr(os, "pwritev", refusing_pwrite)
    body = make_bytes(2 * MiB)
    await conn.put("k", [LEAD, aligned(body)])
    monkeypatch.undo()
    assert conn.direct_io is False
    assert record_fields(conn.path_for("k"))[0] == rec.VERSION_PADDED  # the layout stays
    assert_same_bytes(await conn.get("k"), LEAD + body)
    await conn.close()


async def test_a_filesystem_that_refuses_o_direct_reads_gets_them_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_preadv = os.preadv

    def refusing_preadv(fd: int, buffers: Any, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    conn = FileConnector(tmp_path, direct_io=True)
    body = make_bytes(3 * MiB)
    await conn.put("k", [LEAD, aligned(body)])
    monkeypatch.setattr(os, "preadv", refusing_preadv)
    assert_same_bytes(await conn.get_into("k", PlacedRecorder()), LEAD + body)
    monkeypatch.undo()
    assert conn.direct_io is False
    await conn.close()


async def test_a_direct_put_on_a_full_disk_is_a_capacity_error_and_leaves_nothing_behind(
    small_disk: Path,
) -> None:
    """The O_DIRECT write path runs out of space (a short write, then ENOSPC) like the
    buffered one: CapacityError, no temp file, the other objects whole, and puts that fit
    still go the direct way."""
    conn = FileConnector(small_disk / "store", direct_io=True)
    try:
        kept = make_bytes(DIRECT_IO_BYTES, seed=1)
        await conn.put("kept", [LEAD, aligned(kept)])
        with pytest.raises(CapacityError, match="disk full"):
            await conn.put("too-big", [LEAD, aligned(make_bytes(3 * MiB, seed=2))])
        if not conn.direct_io:  # tmpfs takes O_DIRECT since Linux 6.6
            pytest.skip("this kernel's tmpfs refuses O_DIRECT: the direct path was not reached")
        assert list((small_disk / "store" / "tmp").iterdir()) == []
        assert not await conn.exists("too-big")
        assert not on_disk(conn.path_for("too-big"))
        assert_same_bytes(await conn.get("kept"), LEAD + kept)
        await conn.delete("kept")
        fits = make_bytes(DIRECT_IO_BYTES + 1, seed=3)
        await conn.put("fits", [LEAD, aligned(fits)])
        assert record_fields(conn.path_for("fits"))[0] == rec.VERSION_PADDED
        assert_same_bytes(await conn.get("fits"), LEAD + fits)
    finally:
        await conn.close()


async def test_records_of_every_tail_length_written_one_after_another_come_back_exact(
    tmp_path: Path,
) -> None:
    """Records written in turn by the same threads (which keep a bounce buffer between them):
    with and without a partial last block, after longer and shorter ones."""
    conn = FileConnector(tmp_path, direct_io=True)
    sizes = [2 * MiB, 2 * MiB + 4095, 2 * MiB + 1, 3 * MiB, 2 * MiB + 100, 2 * MiB]
    bodies = [make_bytes(n, seed=i) for i, n in enumerate(sizes)]
    for i, body in enumerate(bodies):
        await conn.put(f"k{i}", [LEAD, aligned(body)])
    for i, body in enumerate(bodies):
        got = await conn.get(f"k{i}")
        assert got is not None
        assert_same_bytes(got, LEAD + body)
    await conn.close()
