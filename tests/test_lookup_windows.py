"""``Store.lookup`` asks lower tiers in growing windows: the prefix is the same wherever the
first miss falls, and a tier that lacks the first keys is asked about a few keys, not all."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import pytest

from connectors.memory import MemoryConnector
from gateway import Store
from gateway.store import LOOKUP_GROWTH, LOOKUP_WINDOW

COUNT = 1400


class _Counting(MemoryConnector):
    """A memory connector that records every batch it is asked about."""

    def __init__(self) -> None:
        super().__init__(uuid.uuid4().hex)
        self.asked: list[int] = []

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        self.asked.append(len(keys))
        return await super().exists_many(keys)


def _config() -> dict[str, object]:
    return {"tiers": [{"url": "memory://"}, {"url": "memory://lower"}], "staging": 8 << 20}


async def _store_with(lower: _Counting, keys: list[str]) -> Store:
    store = Store(_config(), connectors={1: lower})
    await store.__aenter__()
    for key in keys:
        await store.put(key, b"x")
    await store.flush()
    assert store.l1 is not None
    for key in keys:
        store.l1.remove(key)  # the lower tier answers every key
    return store


@pytest.mark.parametrize(
    "first_miss",
    [0, 1, LOOKUP_WINDOW - 1, LOOKUP_WINDOW, LOOKUP_WINDOW + 1, 319, 320, 321, 1343, 1344, COUNT],
)
async def test_the_prefix_ends_at_the_first_miss_wherever_it_falls(first_miss: int) -> None:
    keys = [f"k{i}" for i in range(COUNT)]
    lower = _Counting()
    store = await _store_with(lower, keys)
    try:
        if first_miss < COUNT:
            await lower.delete(keys[first_miss])
        lower.asked.clear()
        assert await store.lookup(keys) == first_miss
        # The window that holds the miss is at most (growth - 1) times the keys before it.
        assert sum(lower.asked) <= LOOKUP_GROWTH * first_miss + LOOKUP_WINDOW
    finally:
        await store.__aexit__(None, None, None)


async def test_a_tier_without_the_first_key_is_asked_about_one_window() -> None:
    keys = [f"k{i}" for i in range(COUNT)]
    lower = _Counting()
    store = await _store_with(lower, keys)
    try:
        await lower.delete(keys[0])
        lower.asked.clear()
        assert await store.lookup(keys) == 0
        assert lower.asked == [LOOKUP_WINDOW]
        lower.asked.clear()
        assert await store.lookup(keys[1:]) == COUNT - 1  # all held: every key asked once
        assert sum(lower.asked) == COUNT - 1
        assert len(lower.asked) <= 4
    finally:
        await store.__aexit__(None, None, None)
