"""The staging arena: host memory registered once with Mooncake's transfer engine.

Every transfer goes between Mooncake and a block of this arena, never the caller's own buffer:

- RDMA can only move registered memory, and registering a caller's buffer per call costs more
  than copying it (milliseconds per 32 MiB);
- a call that times out leaves its Mooncake call running in its worker thread (a blocking C++
  call cannot be interrupted). It keeps writing into, or reading from, its staging block, which
  goes back to the free list only when that thread returns: the caller's buffers are released
  at once, and nothing touches them afterwards.

Blocks come from ``gateway.memory.BufferPool`` (first fit, coalescing). ``take`` waits, in the
worker thread, until a block of the size is free or the deadline passes.
"""

from __future__ import annotations

import threading
import time

from gateway.errors import Timeout
from gateway.memory import BufferPool, Slab


class Staging:
    def __init__(self, capacity: int) -> None:
        self.pool = BufferPool(capacity, pin=False)
        self.capacity = self.pool.capacity
        self.base = int(self.pool.array.ctypes.data)
        self._freed = threading.Condition()
        self._generation = 0  # bumped on every free, so a waiter never misses one
        self.pool.on_free.append(self._on_free)

    def _on_free(self) -> None:
        with self._freed:
            self._generation += 1
            self._freed.notify_all()

    def address(self, slab: Slab) -> int:
        return self.base + slab.offset

    def take(self, nbytes: int, deadline: float) -> Slab:
        """A block of ``nbytes`` (``nbytes <= capacity``), waiting for one up to ``deadline``."""
        while True:
            with self._freed:
                seen = self._generation
            slab = self.pool.alloc(nbytes)
            if slab is not None:
                return slab
            with self._freed:
                while self._generation == seen:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise Timeout(
                            f"no {nbytes} bytes of Mooncake staging memory came free in time "
                            f"({self.capacity} in all; raise local_buffer_size)"
                        )
                    self._freed.wait(left)
