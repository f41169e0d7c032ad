"""Counting operations in flight, so that a close can wait until none is left."""

from __future__ import annotations

import asyncio


class InFlight:
    """A count of running operations and an event set whenever it is zero."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def track(self) -> InFlight:
        """``with in_flight.track():`` counts the block as one operation in flight."""
        return self

    # A class-based context manager, not a contextlib generator: every put and delete enters
    # one, and the generator's machinery cost more than the counting.
    def __enter__(self) -> None:
        self.count += 1
        if self.count == 1:
            self._idle.clear()

    def __exit__(self, *exc: object) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()
