"""gateway.host_memory: zero-filled, page-aligned buffers, populated on request and backed by
transparent huge pages where the kernel offers them (what O_DIRECT reads need to be fast)."""

from __future__ import annotations

import mmap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gateway import Store
from gateway.config import StoreConfig
from gateway.host_memory import anonymous_memory
from gateway.memory import BufferPool

MiB = 1 << 20
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_SIZE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
PAGEMAP = Path("/proc/self/pagemap")


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
    return THP_MODE.exists() and THP_SIZE.exists() and "[never]" not in THP_MODE.read_text()


def huge_page_kib() -> int:
    return int(THP_SIZE.read_text()) // 1024


def thp_test_size() -> int:
    """Four huge pages (2 MiB each on x86-64, 512 MiB on arm64 with 64 KiB pages)."""
    return 4 * huge_page_kib() * 1024


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


@pytest.mark.skipif(not PAGEMAP.exists(), reason="no /proc/self/pagemap here")
def test_populate_faults_every_page_in() -> None:
    assert present_pages(anonymous_memory(32 * MiB, populate=False, huge_pages=False)) == 0
    assert (
        present_pages(anonymous_memory(32 * MiB, populate=True, huge_pages=False))
        == 32 * MiB // mmap.PAGESIZE
    )


@pytest.mark.skipif(not thp_offered(), reason="this kernel offers no transparent huge pages")
def test_memory_is_backed_by_huge_pages() -> None:
    memory = anonymous_memory(thp_test_size(), populate=True, huge_pages=True)
    # At least one: the ends of a mapping not aligned to a huge page stay in small pages, and
    # a fragmented memory may have few free huge pages. Without the advice (THP "madvise",
    # this machine's mode) there would be none.
    assert mapping_fields(address_of(memory)).get("AnonHugePages", 0) >= huge_page_kib()


@pytest.mark.skipif(not thp_offered(), reason="this kernel offers no transparent huge pages")
def test_the_pool_arena_is_backed_by_huge_pages() -> None:
    pool = BufferPool(thp_test_size(), pin=False, prefault=True, huge_pages=True)
    huge = mapping_fields(int(pool.array.ctypes.data)).get("AnonHugePages", 0)
    assert huge >= huge_page_kib()


def tiers(direct_io: bool | str | None) -> list[dict[str, object]]:
    disk: dict[str, object] = {"url": "file:///tmp/kvgate-never-opened"}
    if direct_io is not None:
        disk["options"] = {"direct_io": direct_io}
    return [{"url": "memory://", "capacity": "64MiB"}, disk]


@pytest.mark.parametrize(
    ("huge_pages", "direct_io", "expected"),
    [
        (None, True, True),  # O_DIRECT moves the pool's bytes: huge pages by default
        (None, "true", True),  # as an environment override says it
        (None, False, False),
        (None, None, False),
        (False, True, False),  # an explicit choice wins
        (True, None, True),
    ],
)
def test_the_store_asks_for_huge_pages_where_o_direct_uses_the_pool(
    huge_pages: bool | None, direct_io: bool | str | None, expected: bool
) -> None:
    config = StoreConfig.model_validate({"tiers": tiers(direct_io), "huge_pages": huge_pages})
    assert config.pool_in_huge_pages() is expected


@pytest.mark.skipif(not thp_offered(), reason="this kernel offers no transparent huge pages")
async def test_a_store_with_a_direct_io_tier_has_its_pool_in_huge_pages(tmp_path: Path) -> None:
    config = {
        "tiers": [
            {"url": "memory://", "capacity": thp_test_size()},
            {"url": f"file://{tmp_path}", "options": {"direct_io": True}},
        ],
        "pin_memory": False,
    }
    async with Store(config) as store:
        assert store.pool is not None
        arena = int(store.pool.array.ctypes.data)
        assert mapping_fields(arena).get("AnonHugePages", 0) >= huge_page_kib()


def test_populating_lets_other_threads_run() -> None:
    """Stores populate their pool in a worker thread so as not to block the event loop; that
    only helps if the populating call lets go of the GIL (Python's ``mmap.madvise`` does not:
    with it, populating 1 GiB stalled every other thread for 3.4 s here)."""
    done = threading.Event()
    kept: list[mmap.mmap] = []
    took: list[float] = []

    def populate() -> None:
        start = time.perf_counter()
        kept.append(anonymous_memory(1024 * MiB, populate=True, huge_pages=False))
        took.append(time.perf_counter() - start)
        done.set()

    worker = threading.Thread(target=populate)
    worst, last = 0.0, time.perf_counter()
    worker.start()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    worker.join()
    assert present_pages(kept[0]) == 1024 * MiB // mmap.PAGESIZE
    # Holding the GIL would stall this thread for about the whole populate.
    assert worst < max(0.02, took[0] / 3), f"stalled {worst:.3f} s of {took[0]:.3f} s"
