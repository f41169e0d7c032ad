"""Per-key read/write locks: this process's reads of a key never overlap its writes of it.

Mooncake's overwrite (``upsert``) is not invisible to readers: while it runs, the key reads as
"being written" and, for a moment, as missing (measured here). Reads of a key in this process
therefore wait for this process's write of it, and a write waits for the reads in flight.
Waiters are served in arrival order (a reader never overtakes a writer that came before it, nor
a writer anybody that came before it), so neither a key read in a loop nor one written in a
loop starves the other side. Locks exist only while someone holds or waits for them.

A task taking several keys takes them once each and in sorted order (``reading_many``):
writers hold a single key, so no cycle of waits can form.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Entry:
    readers: int = 0
    writing: bool = False
    users: int = 0
    tickets: int = 0
    queue: dict[int, bool] = field(default_factory=dict)  # waiting ticket -> is a writer
    waiters: list[asyncio.Future[None]] = field(default_factory=list)

    def writer_before(self, ticket: int) -> bool:
        return any(t < ticket and writer for t, writer in self.queue.items())

    def anyone_before(self, ticket: int) -> bool:
        return any(t < ticket for t in self.queue)

    async def queue_for(self, writer: bool) -> None:
        ticket = self.tickets
        self.tickets += 1
        self.queue[ticket] = writer
        try:
            if writer:
                await self.wait_until(
                    lambda: not self.writing and not self.readers and not self.anyone_before(ticket)
                )
                self.writing = True
            else:
                await self.wait_until(lambda: not self.writing and not self.writer_before(ticket))
                self.readers += 1
        finally:
            del self.queue[ticket]
            self.changed()  # whoever waited behind this ticket may go now

    async def wait_until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            waiter = asyncio.get_running_loop().create_future()
            self.waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self.waiters:
                    self.waiters.remove(waiter)

    def changed(self) -> None:
        """Wake every waiter to look again (synchronous: releasing never awaits)."""
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(None)
        self.waiters.clear()


class ReadWriteLocks:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _enter(self, key: str) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
        entry.users += 1
        return entry

    def _leave(self, key: str, entry: _Entry) -> None:
        entry.users -= 1
        if entry.users == 0:
            del self._entries[key]

    @asynccontextmanager
    async def reading(self, key: str) -> AsyncIterator[None]:
        entry = self._enter(key)
        try:
            await entry.queue_for(writer=False)
            try:
                yield
            finally:
                entry.readers -= 1
                entry.changed()
        finally:
            self._leave(key, entry)

    @asynccontextmanager
    async def reading_many(self, keys: Iterable[str]) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            for key in sorted(set(keys)):
                await stack.enter_async_context(self.reading(key))
            yield

    @asynccontextmanager
    async def writing(self, key: str) -> AsyncIterator[None]:
        entry = self._enter(key)
        try:
            await entry.queue_for(writer=True)
            try:
                yield
            finally:
                entry.writing = False
                entry.changed()
        finally:
            self._leave(key, entry)
