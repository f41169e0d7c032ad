"""Store listing: sorted pages over the memory tier and the tiers below, each key once, with
each source read once per listing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from connectors.fs.connector import FileConnector
from gateway import Store
from gateway.listing import KeyListings
from gateway.types import ObjectInfo


def config(root: Path) -> dict[str, object]:
    return {
        "tiers": [
            {"url": "memory://", "capacity": "64MiB"},
            {"url": f"file://{root}", "capacity": "64MiB"},
        ]
    }


async def test_pages_cover_memory_and_disk_once_in_order(tmp_path: Path) -> None:
    async with Store(config(tmp_path)) as store:
        for i in range(25):
            await store.put(f"p/{i:02d}", b"v" * (i + 1))
        await store.put("q/other", b"z")
        await store.flush()
    # A new store: its memory tier is empty, so these come from the disk tier's listing; two
    # more keys only in memory (not flushed yet) must join them.
    async with Store(config(tmp_path)) as store:
        await store.put("p/memory-only", b"m")
        await store.put("p/05", b"v" * 6)  # also on disk: listed once
        listings = KeyListings(store)
        seen: list[str] = []
        after = None
        while True:
            page, after = await listings.page("p/", limit=7, after=after)
            assert len(page) <= 7
            seen.extend(info.key for info in page)
            if after is None:
                break
        assert seen == sorted({f"p/{i:02d}" for i in range(25)} | {"p/memory-only"})
        first, _ = await listings.page("p/", limit=1)
        assert first[0].key == "p/00"


async def test_limits_are_checked(tmp_path: Path) -> None:
    async with Store(config(tmp_path)) as store:
        listings = KeyListings(store)
        for bad in (0, 1001):
            with pytest.raises(ValueError, match="limit"):
                await listings.page(limit=bad)
        assert await listings.page("nothing/") == ([], None)


class CountedListings(FileConnector):
    """A real disk tier that counts how often it is asked to list."""

    listings = 0

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        type(self).listings += 1
        async for info in super().list(prefix):
            yield info


async def all_pages(listings: KeyListings, prefix: str, limit: int) -> list[str]:
    seen: list[str] = []
    after = None
    while True:
        page, after = await listings.page(prefix, limit=limit, after=after)
        seen.extend(info.key for info in page)
        if after is None:
            return seen


async def test_a_listing_reads_each_tier_once_however_many_pages(tmp_path: Path) -> None:
    # Reading every source for every page made listing a large tier quadratic.
    CountedListings.listings = 0
    disk = CountedListings(tmp_path)
    async with Store(config(tmp_path), connectors={1: disk}) as store:
        for i in range(300):
            await store.put(f"k/{i:03d}", b"x")
        await store.flush()
        listings = KeyListings(store)
        assert await all_pages(listings, "k/", limit=10) == [f"k/{i:03d}" for i in range(300)]
        assert CountedListings.listings == 1
        # A new listing (no cursor) reads the sources again, so it sees what changed since.
        await store.put("k/999", b"x")
        assert await store.delete("k/000")
        seen = await all_pages(listings, "k/", limit=100)
        assert seen == [f"k/{i:03d}" for i in range(1, 300)] + ["k/999"]
        assert CountedListings.listings == 2


async def test_later_pages_see_the_first_pages_keys_until_the_snapshot_lapses(
    tmp_path: Path,
) -> None:
    async with Store(config(tmp_path)) as store:
        for key in ("a", "b", "c"):
            await store.put(key, b"x")
        listings = KeyListings(store)
        page, after = await listings.page(limit=1)
        assert [i.key for i in page] == ["a"]
        assert after == "a"
        await store.put("bb", b"x")  # after the first page: not in this listing
        page, after = await listings.page(limit=2, after=after)
        assert [i.key for i in page] == ["b", "c"]
        assert after is None
        # With no time to live, every page reads the sources: the new key appears.
        lapsing = KeyListings(store, ttl=0.0)
        await lapsing.page(limit=1)
        page, _ = await lapsing.page(limit=5, after="a")
        assert [i.key for i in page] == ["b", "bb", "c"]


async def test_snapshots_are_bounded(tmp_path: Path) -> None:
    CountedListings.listings = 0
    disk = CountedListings(tmp_path)
    async with Store(config(tmp_path), connectors={1: disk}) as store:
        await store.put("p0/a", b"x")
        listings = KeyListings(store, max_snapshots=2)
        for n in range(3):  # three prefixes listed at once: the first one's snapshot goes
            await listings.page(f"p{n}/", limit=1)
        assert CountedListings.listings == 3
        await listings.page("p2/", limit=1, after="p2/")  # kept: no new read
        assert CountedListings.listings == 3
        page, _ = await listings.page("p0/", limit=1, after="p0/")  # dropped: read again
        assert [i.key for i in page] == ["p0/a"]
        assert CountedListings.listings == 4
