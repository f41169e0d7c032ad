"""Store listing: sorted pages over the memory tier and the tiers below, each key once."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway import Store
from gateway.listing import list_keys


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
        seen: list[str] = []
        after = None
        while True:
            page, after = await list_keys(store, "p/", limit=7, after=after)
            assert len(page) <= 7
            seen.extend(info.key for info in page)
            if after is None:
                break
        assert seen == sorted({f"p/{i:02d}" for i in range(25)} | {"p/memory-only"})
        first, _ = await list_keys(store, "p/", limit=1)
        assert first[0].key == "p/00"


async def test_limits_are_checked(tmp_path: Path) -> None:
    async with Store(config(tmp_path)) as store:
        for bad in (0, 1001):
            with pytest.raises(ValueError, match="limit"):
                await list_keys(store, limit=bad)
        assert await list_keys(store, "nothing/") == ([], None)
