"""Counting operations in flight, so that a close can wait until none is left."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator


class InFlight:
    """A count of running operations and an event set whenever it is zero."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.count += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.count -= 1
            if self.count == 0:
                self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()
