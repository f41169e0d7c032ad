"""A preallocated host buffer pool: the store's L1 memory and its in-flight write staging.

One arena is allocated once (pinned through torch when CUDA is available, otherwise anonymous
memory, in huge pages on request: see ``host_memory``), so steady-state puts allocate nothing:
they copy into a slab.
Slabs are reference counted. The cache index holds one reference, every queued write holds
one, and every object handed to a reader holds one through a *lease*: a numpy array over the
slab whose finalizer releases the reference when the last view of it (torch tensor, numpy
view, memoryview) is gone. Memory is returned to the free list only at zero references, so an
object being read is never freed or reused under its reader.

Finalizers can run on any thread (a tensor dropped in a worker thread), hence the lock.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from gateway.connector import PLACEMENT
from gateway.host_memory import anonymous_memory
from gateway.objects import HAS_TORCH

ALIGN = 256  # DMA-friendly and enough for every dtype's alignment
# Slabs of at least PAGE_ALIGN_FROM bytes start on a page: O_DIRECT (the file tier's
# ``direct_io``) can then write a staged object straight from its slab. The gap this leaves
# before such a slab (under a page) stays free and merges back when its neighbours are freed.
PAGE = PLACEMENT
PAGE_ALIGN_FROM = 64 << 10


def _cuda_available() -> bool:
    if not HAS_TORCH:
        return False
    import torch

    return bool(torch.cuda.is_available())


class Slab:
    """A reference-counted block of the pool. ``view`` is valid while a reference is held."""

    __slots__ = ("cached", "nbytes", "offset", "pool", "refs", "size")

    def __init__(self, pool: BufferPool, offset: int, size: int, nbytes: int) -> None:
        self.pool = pool
        self.offset = offset
        self.size = size  # allocated (aligned) size
        self.nbytes = nbytes  # requested size
        self.refs = 1
        self.cached = False  # one reference is the cache index's (``BufferPool.set_cached``)

    def _end(self, start: int, length: int | None) -> int:
        end = self.nbytes if length is None else start + length
        if start < 0 or end < start or end > self.nbytes:
            # A view past the slab would expose a neighbouring object.
            raise ValueError(f"range {start}..{end} outside a slab of {self.nbytes} bytes")
        return end

    def view(self, start: int = 0, length: int | None = None) -> memoryview:
        end = self._end(start, length)
        return self.pool.arena[self.offset + start : self.offset + end]

    def acquire(self) -> Slab:
        with self.pool.lock:
            if self.refs <= 0:
                raise RuntimeError("acquire of a freed slab")
            self.refs += 1
            if self.cached and self.refs == 2:  # no longer the cache's alone
                self.pool.reclaimable -= self.size
        return self

    def release(self) -> None:
        self.pool.release(self)

    def lease(self, start: int = 0, length: int | None = None) -> memoryview:
        """A view that keeps this slab alive for as long as anything derived from it lives."""
        end = self._end(start, length)
        self.acquire()
        holder: np.ndarray[Any, Any] = self.pool.array[self.offset + start : self.offset + end]
        # Slicing an ndarray that owns nothing would let numpy collapse views to the arena, so
        # the holder is a fresh array object; memoryview(holder) keeps it alive, and torch or
        # numpy objects built on that memoryview keep the memoryview alive.
        holder = holder.view()
        weakref.finalize(holder, self.release)
        return holder.data


class BufferPool:
    """Byte-capacity arena with best-fit allocation and a coalescing free list."""

    def __init__(
        self,
        capacity: int,
        *,
        pin: bool | None = None,
        prefault: bool = False,
        huge_pages: bool = False,
    ) -> None:
        """``prefault`` faults the arena in now (up to a second per GiB: build it off the loop).
        ``huge_pages`` backs an unpinned arena with transparent huge pages (``host_memory``)."""
        if capacity < 0:
            raise ValueError("pool capacity must be >= 0")
        self.capacity = capacity // ALIGN * ALIGN
        self.pinned = _cuda_available() if pin is None else pin
        self.lock = threading.Lock()
        self._keepalive: object
        if self.pinned and self.capacity:
            import torch

            t = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=True)
            self._keepalive = t
            self.array: np.ndarray[Any, Any] = t.numpy()
        else:
            buf = anonymous_memory(self.capacity, populate=prefault, huge_pages=huge_pages)
            self._keepalive = buf
            self.array = np.frombuffer(buf, dtype=np.uint8)[: self.capacity]
        self.arena = self.array.data
        # The free blocks three ways: starts in address order (to merge neighbours), the size
        # of each start, and (size, start) in size order (to find the best fit by bisection).
        self._starts: list[int] = []
        self._sizes: dict[int, int] = {}
        self._by_size: list[tuple[int, int]] = []
        if self.capacity:
            self._add_block(0, self.capacity)
        self.used = 0
        self.reclaimable = 0  # bytes of cached slabs that only the cache holds
        self.on_free: list[Callable[[], None]] = []

    def alloc(self, nbytes: int) -> Slab | None:
        """A slab of ``nbytes`` (one reference, the caller's), or None when nothing fits."""
        if nbytes == 0:
            return Slab(self, 0, 0, 0)
        size = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        align = PAGE if nbytes >= PAGE_ALIGN_FROM else ALIGN
        with self.lock:
            found = self._best_fit(size, align)
            if found is None:
                return None
            free, start = found
            at = (start + align - 1) // align * align
            self._take_block(start, free)
            if at > start:  # the gap before an aligned slab stays free
                self._add_block(start, at - start)
            end = start + free
            if end > at + size:
                self._add_block(at + size, end - at - size)
            self.used += size
        return Slab(self, at, size, nbytes)

    def _best_fit(self, size: int, align: int) -> tuple[int, int] | None:
        """(free bytes, start) of the smallest free block that holds ``size`` bytes at
        ``align``, or None. A bisection in the size order: O(log blocks), where the first-fit
        walk over the blocks in address order it replaced was O(blocks) per call, and the
        memory tier calls it again after every eviction while it makes room. A 1 MiB put into a
        memory tier holding 16k objects of 4 KiB, half of them read since (so that evictions
        freed scattered holes), took 16k calls walking 2.4k blocks each: 15 s of CPU for 8
        puts (``kvgate bench scale``'s README section).

        Blocks start on ALIGN, so at that alignment the first block large enough fits; a page
        aligned slab may not fit a block less than a page larger than it, hence the walk on to
        the first block that does (every block of ``size + PAGE - ALIGN`` bytes or more does)."""
        order = self._by_size
        for j in range(bisect.bisect_left(order, (size, -1)), len(order)):
            free, start = order[j]
            at = (start + align - 1) // align * align
            if at - start + size <= free:
                return free, start
        return None

    def _add_block(self, start: int, size: int) -> None:
        bisect.insort(self._starts, start)
        self._sizes[start] = size
        bisect.insort(self._by_size, (size, start))

    def _take_block(self, start: int, size: int) -> None:
        del self._starts[bisect.bisect_left(self._starts, start)]
        del self._sizes[start]
        del self._by_size[bisect.bisect_left(self._by_size, (size, start))]

    def release(self, slab: Slab) -> None:
        with self.lock:
            slab.refs -= 1
            if slab.cached and slab.refs == 1:  # the cache's alone again
                self.reclaimable += slab.size
            if slab.refs > 0:
                return
            if slab.refs < 0:
                raise RuntimeError("slab released more often than acquired")
            if slab.size:
                self._free(slab.offset, slab.size)
            callbacks = list(self.on_free)
        for cb in callbacks:
            cb()

    def _free(self, start: int, size: int) -> None:
        self.used -= size
        i = bisect.bisect_left(self._starts, start)
        if i > 0:  # merge with the block before
            prev = self._starts[i - 1]
            if prev + self._sizes[prev] == start:
                before = self._sizes[prev]
                self._take_block(prev, before)
                start, size = prev, before + size
        after = start + size
        if after in self._sizes:  # and the block after
            more = self._sizes[after]
            self._take_block(after, more)
            size += more
        self._add_block(start, size)

    def set_cached(self, slab: Slab, cached: bool) -> None:
        """Say that one of ``slab``'s references is (or no longer is) the cache index's, so
        that ``room_after_eviction`` counts the slab while nothing else holds it."""
        with self.lock:
            if slab.cached == cached:
                return
            slab.cached = cached
            if slab.refs == 1:
                self.reclaimable += slab.size if cached else -slab.size

    def room_after_eviction(self) -> int:
        """Free bytes if the cache dropped every slab that only it holds: an allocation
        larger than this cannot succeed by evicting (readers and queued writes hold the
        rest). Fragmentation may still make a smaller one fail."""
        with self.lock:
            return self.capacity - self.used + self.reclaimable

    def largest_free(self) -> int:
        with self.lock:
            return self._by_size[-1][0] if self._by_size else 0
