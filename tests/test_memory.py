"""The buffer pool: allocation, coalescing, and leases that outlive their creator."""

from __future__ import annotations

import gc
import itertools
import threading

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.memory import ALIGN, PAGE, PAGE_ALIGN_FROM, BufferPool


def test_alloc_free_coalesces() -> None:
    pool = BufferPool(1 << 20)
    slabs = [pool.alloc(1000) for _ in range(10)]
    assert all(s is not None for s in slabs)
    assert pool.used == 10 * 1024
    for s in slabs[::2]:
        s.release()  # type: ignore[union-attr]
    for s in slabs[1::2]:
        s.release()  # type: ignore[union-attr]
    assert pool.used == 0
    assert pool.largest_free() == pool.capacity


def test_full_pool_returns_none() -> None:
    pool = BufferPool(4 * ALIGN)
    a = pool.alloc(3 * ALIGN)
    assert a is not None
    assert pool.alloc(2 * ALIGN) is None
    a.release()
    assert pool.alloc(4 * ALIGN) is not None


def test_large_slabs_start_on_a_page_and_gaps_merge_back() -> None:
    """Large slabs are page-aligned (O_DIRECT writes them as they are); the gaps that this
    leaves are free memory, not lost memory."""
    pool = BufferPool(4 << 20)
    small = pool.alloc(100)
    big = [pool.alloc(PAGE_ALIGN_FROM + 300) for _ in range(3)]
    live = [s for s in (small, *big) if s is not None]
    assert len(live) == 4
    for b in live[1:]:
        addr = np.frombuffer(b.view(), np.uint8).ctypes.data
        assert addr % PAGE == 0
    assert pool.used == ALIGN + 3 * ((PAGE_ALIGN_FROM + 300 + ALIGN - 1) // ALIGN * ALIGN)
    tiny = pool.alloc(ALIGN)  # fits in a gap before a large slab, not after the last one
    assert tiny is not None
    assert tiny.offset < live[-1].offset
    for s in [*live, tiny]:
        s.release()
    assert pool.used == 0
    assert pool.largest_free() == pool.capacity


def test_zero_size() -> None:
    pool = BufferPool(ALIGN)
    s = pool.alloc(0)
    assert s is not None
    assert s.view().nbytes == 0
    s.release()
    assert pool.used == 0


def test_lease_keeps_slab_until_last_derived_view_dies() -> None:
    pool = BufferPool(1 << 20)
    slab = pool.alloc(4096)
    assert slab is not None
    lease = slab.lease()
    tensor = torch.from_numpy(np.frombuffer(lease, np.uint8)).view(torch.float32).view(32, 32)
    row = tensor[3]
    arr = np.frombuffer(slab.lease(), np.float32).reshape(32, 32)
    col = arr[:, 2].T
    del lease, tensor, arr
    slab.release()  # the owner lets go: readers still hold it
    gc.collect()
    assert pool.used == 4096
    del row
    gc.collect()
    assert pool.used == 4096
    del col
    gc.collect()
    assert pool.used == 0


def test_release_from_another_thread() -> None:
    pool = BufferPool(1 << 20)
    slab = pool.alloc(100)
    assert slab is not None
    lease = slab.lease()
    slab.release()
    holder = [lease]
    del lease
    t = threading.Thread(target=holder.clear)
    t.start()
    t.join()
    gc.collect()
    assert pool.used == 0


@settings(max_examples=60)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 150_000)), max_size=80))
def test_random_alloc_release_never_overlaps(ops: list[tuple[bool, int]]) -> None:
    pool = BufferPool(1 << 20)
    live = []
    for is_alloc, n in ops:
        if is_alloc or not live:
            s = pool.alloc(n)
            if s is not None:
                live.append(s)
        else:
            live.pop(n % len(live)).release()
        spans = sorted((s.offset, s.offset + s.size) for s in live if s.size)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert all(s.offset % PAGE == 0 for s in live if s.nbytes >= PAGE_ALIGN_FROM)
        assert pool.used == sum(s.size for s in live)
    for s in live:
        s.release()
    assert pool.used == 0
    assert pool.largest_free() == pool.capacity
