"""The memory tier refuses a request that eviction cannot make room for, and evicts nothing
for it: a lower tier's object larger than what the memory tier could free is served from
below, without promotion, and the cache keeps every object it held."""

from __future__ import annotations

from pathlib import Path

from gateway import Store
from gateway.memory import BufferPool
from gateway.testing import MiB, assert_same_bytes, make_bytes


def _config(tmp_path: Path) -> dict[str, object]:
    return {"tiers": [{"url": "memory://", "capacity": 64 * MiB}, {"url": f"file://{tmp_path}"}]}


async def test_object_larger_than_the_memory_tier_is_served_without_evicting(
    tmp_path: Path,
) -> None:
    big = make_bytes(100 * MiB, 7)
    async with Store(_config(tmp_path)) as store:
        assert store.l1 is not None
        await store.put("big", big)  # larger than the memory tier: written to file:// only
        for i in range(4):
            await store.put(f"small{i}", make_bytes(4 * MiB, i))
        await store.flush()
        got = await store.get("big")
        assert isinstance(got, bytes)
        assert_same_bytes(got, big)
        assert store.l1.stats.evictions == 0
        assert sorted(store.l1.index) == [f"small{i}" for i in range(4)]


async def test_request_that_eviction_cannot_satisfy_evicts_nothing(tmp_path: Path) -> None:
    below = make_bytes(30 * MiB, 1)
    async with Store(_config(tmp_path)) as store:
        l1 = store.l1
        assert l1 is not None
        await store.put("below", below)
        await store.flush()
        # A memoryview comes back as a view of the cache's memory (bytes would be a copy).
        await store.put("held", memoryview(make_bytes(40 * MiB, 2)))  # evicts "below"
        await store.flush()
        assert "below" not in l1
        held = await store.get("held")  # a reader holds it: evicting it would free nothing
        await store.put("a", make_bytes(8 * MiB, 3))
        await store.put("b", make_bytes(8 * MiB, 4))
        await store.flush()
        evictions = l1.stats.evictions
        # 8 MiB free, and 16 MiB that only the cache holds: 30 MiB cannot be made free.
        got = await store.get("below")
        assert isinstance(got, bytes)
        assert_same_bytes(got, below)
        assert l1.stats.evictions == evictions
        assert sorted(l1.index) == ["a", "b", "held"]
        del held


def test_room_after_eviction_counts_cached_slabs_that_nothing_else_holds() -> None:
    pool = BufferPool(4 * MiB)
    cached, other = pool.alloc(MiB), pool.alloc(MiB)
    assert cached is not None
    assert other is not None
    pool.set_cached(cached, True)
    assert pool.room_after_eviction() == 3 * MiB  # 2 MiB free, and the cached slab
    lease = cached.lease()  # a reader: evicting would not free it
    assert pool.room_after_eviction() == 2 * MiB
    del lease
    assert pool.room_after_eviction() == 3 * MiB
    pool.set_cached(cached, False)
    cached.release()
    assert pool.room_after_eviction() == 3 * MiB  # freed now, not counted twice
