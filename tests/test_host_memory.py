"""gateway.host_memory: zero-filled, page-aligned buffers, populated on request and backed by
transparent huge pages where the kernel offers them (what O_DIRECT reads need to be fast)."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from gateway import Store
from gateway.config import StoreConfig
from gateway.host_memory import anonymous_memory
from gateway.memory import BufferPool

MiB = 1 << 20
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mapping_fields(address: int) -> dict[str, int]:
    """The kB figures of this process's /proc/self/smaps entry that contains ``address``. The
    kernel merges neighbouring anonymous mappings into one entry, so a figure may include a
    neighbour's pages: checks with it can pass wrongly, never fail wrongly."""
    fields: dict[str, int] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.endswith(" kB"):
            name, value, _unit = line.split()
            fields[name.rstrip(":")] = int(value)
    return fields


def address_of(memory: mmap.mmap) -> int:
    return int(np.frombuffer(memory, dtype=np.uint8).ctypes.data)


def thp_offered() -> bool:
    return THP_MODE.exists() and "[never]" not in THP_MODE.read_text()


@pytest.mark.parametrize("nbytes", [0, 1, 4097, 3 * MiB + 5])
def test_zero_filled_page_aligned_and_large_enough(nbytes: int) -> None:
    memory = anonymous_memory(nbytes, populate=False, huge_pages=True)
    assert len(memory) >= max(nbytes, 1)
    assert address_of(memory) % mmap.PAGESIZE == 0
    assert not np.frombuffer(memory, dtype=np.uint8).any()


def present_pages(memory: mmap.mmap) -> int:
    """How many of the mapping's pages are in memory (bit 63 of each /proc/self/pagemap
    entry; readable without privileges)."""
    first = address_of(memory) // mmap.PAGESIZE
    count = len(memory) // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = np.frombuffer(pagemap.read(count * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


def test_populate_faults_every_page_in() -> None:
    assert present_pages(anonymous_memory(32 * MiB, populate=False, huge_pages=False)) == 0
    assert (
        present_pages(anonymous_memory(32 * MiB, populate=True, huge_pages=False))
        == 32 * MiB // mmap.PAGESIZE
    )


@pytest.mark.skipif(not thp_offered(), reason="this kernel offers no transparent huge pages")
def test_memory_is_backed_by_huge_pages() -> None:
    memory = anonymous_memory(64 * MiB, populate=True, huge_pages=True)
    # Most of it: the ends of a mapping not aligned to 2 MiB stay in small pages, and the
    # kernel may fail to find a few free huge pages.
    assert mapping_fields(address_of(memory)).get("AnonHugePages", 0) >= 32 * 1024


@pytest.mark.skipif(not thp_offered(), reason="this kernel offers no transparent huge pages")
def test_the_pool_arena_is_backed_by_huge_pages() -> None:
    pool = BufferPool(64 * MiB, pin=False, prefault=True, huge_pages=True)
    assert mapping_fields(int(pool.array.ctypes.data)).get("AnonHugePages", 0) >= 32 * 1024


def tiers(direct_io: bool | None) -> list[dict[str, object]]:
    disk: dict[str, object] = {"url": "file:///tmp/kvgate-never-opened"}
    if direct_io is not None:
        disk["options"] = {"direct_io": direct_io}
    return [{"url": "memory://", "capacity": "64MiB"}, disk]


@pytest.mark.parametrize(
    ("huge_pages", "direct_io", "expected"),
    [
        (None, True, True),  # O_DIRECT moves the pool's bytes: huge pages by default
        (None, False, False),
        (None, None, False),
        (False, True, False),  # an explicit choice wins
        (True, None, True),
    ],
)
def test_the_store_asks_for_huge_pages_where_o_direct_uses_the_pool(
    huge_pages: bool | None, direct_io: bool | None, expected: bool
) -> None:
    config = StoreConfig.model_validate({"tiers": tiers(direct_io), "huge_pages": huge_pages})
    assert config.pool_in_huge_pages() is expected


@pytest.mark.skipif(not thp_offered(), reason="this kernel offers no transparent huge pages")
async def test_a_store_with_a_direct_io_tier_has_its_pool_in_huge_pages(tmp_path: Path) -> None:
    config = {
        "tiers": [
            {"url": "memory://", "capacity": "64MiB"},
            {"url": f"file://{tmp_path}", "options": {"direct_io": True}},
        ],
        "pin_memory": False,
    }
    async with Store(config) as store:
        assert store.pool is not None
        arena = int(store.pool.array.ctypes.data)
        assert mapping_fields(arena).get("AnonHugePages", 0) >= 32 * 1024
