"""A memory tier full of small objects makes room for a large one in time proportional to what
it evicts, not to that times everything it holds.

The pool used to find a block first-fit, walking every free block in address order, and the
memory tier asks again after each eviction: with LRU order scattered by reads, a 1 MiB put
into 64 MiB of 4 KiB objects evicted thousands of them, each followed by a walk over thousands
of holes (15 s of CPU for 8 such puts; 0.4 s with the best-fit search by size).
"""

from __future__ import annotations

import os
import random
import time

from gateway import Store


async def test_large_puts_into_a_fragmented_memory_tier_stay_cheap() -> None:
    cfg = {"tiers": [{"url": "memory://", "capacity": "64MiB"}], "prefault": False}
    small, big = os.urandom(4096), os.urandom(1 << 20)
    async with Store(cfg) as store:
        count = (64 << 20) // 4096 - 64
        for i in range(count):
            await store.put(f"small/{i}", small)
        # Reads reorder the LRU, so evictions free holes scattered over the arena.
        for i in random.Random(0).sample(range(count), count // 2):
            assert await store.get(f"small/{i}") is not None
        started = time.thread_time()  # this (the loop's) thread's CPU: pauses do not count
        for j in range(8):
            await store.put(f"big/{j}", big)
        spent = time.thread_time() - started
        for j in range(8):
            got = await store.get(f"big/{j}")
            assert got is not None
            assert bytes(memoryview(got)) == big  # type: ignore[arg-type]
        assert store.stats()["memory"].evictions > 256  # room was made by evicting
    assert spent < 4.0, f"8 large puts took {spent:.1f} s of CPU"
