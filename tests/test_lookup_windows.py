"""``Store.lookup`` asks lower tiers in windows: the prefix is the same wherever the first miss
falls; a tier that lacks the first keys is asked about one window, not all; a batch tier that
holds the window is asked about the rest at once, any other in growing windows."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence

import pytest

from connectors.memory import MemoryConnector
from gateway import Store
from gateway.store import LOOKUP_GROWTH, LOOKUP_WINDOW

COUNT = 1400


class _Counting(MemoryConnector):
    """A memory connector that records every batch it is asked about; ``batch`` says whether
    it claims one-round-trip batches (as Redis does) or not (as S3 does)."""

    def __init__(self, batch: bool) -> None:
        super().__init__(uuid.uuid4().hex)
        self.capabilities = dataclasses.replace(self.capabilities, batch=batch)
        self.asked: list[int] = []

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        self.asked.append(len(keys))
        return await super().exists_many(keys)


async def _store_with(lower: _Counting, keys: list[str]) -> Store:
    """A memory tier above ``lower``, which alone holds ``keys`` (lookup checks existence
    only, so what they hold does not matter)."""
    config = {
        "tiers": [{"url": "memory://", "capacity": 1 << 20}, {"url": "memory://lower"}],
        "staging": 1 << 20,
        "prefault": False,
    }
    store = Store(config, connectors={1: lower})
    await store.__aenter__()
    for key in keys:
        await lower.put(key, b"x")
    return store


@pytest.mark.parametrize("batch", [True, False], ids=["batch", "per-key"])
@pytest.mark.parametrize(
    "first_miss",
    [0, 1, LOOKUP_WINDOW - 1, LOOKUP_WINDOW, LOOKUP_WINDOW + 1, 319, 320, 321, 1343, 1344, COUNT],
)
async def test_the_prefix_ends_at_the_first_miss_wherever_it_falls(
    first_miss: int, batch: bool
) -> None:
    keys = [f"k{i}" for i in range(COUNT)]
    lower = _Counting(batch)
    store = await _store_with(lower, keys)
    try:
        if first_miss < COUNT:
            await lower.delete(keys[first_miss])
        lower.asked.clear()
        assert await store.lookup(keys) == first_miss
        if first_miss < LOOKUP_WINDOW:
            assert lower.asked == [LOOKUP_WINDOW]
        elif batch:
            assert lower.asked == [LOOKUP_WINDOW, COUNT - LOOKUP_WINDOW]
        else:  # the window that holds the miss is at most (growth - 1) times the keys before
            assert sum(lower.asked) <= LOOKUP_GROWTH * first_miss + LOOKUP_WINDOW
    finally:
        await store.__aexit__(None, None, None)


@pytest.mark.parametrize("batch", [True, False], ids=["batch", "per-key"])
async def test_every_key_is_asked_once_when_all_are_held(batch: bool) -> None:
    keys = [f"k{i}" for i in range(COUNT)]
    lower = _Counting(batch)
    store = await _store_with(lower, keys)
    try:
        assert await store.lookup(keys) == COUNT
        assert sum(lower.asked) == COUNT
        assert len(lower.asked) == (2 if batch else 4)  # 64 + rest; 64, 256, 1024, rest
    finally:
        await store.__aexit__(None, None, None)
