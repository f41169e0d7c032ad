"""Per-key mutual exclusion for connectors that keep an index next to their backend.

``hold(*keys)`` registers every key *before* its first ``await``: a connector that picks
eviction victims with ``busy`` as the filter and then holds them in the same step can be sure no
put of a victim slips in between its choice and its unlink. Locks exist only while someone holds
or waits for them, so the table stays as small as the number of operations in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Entry:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class KeyLocks:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def busy(self, key: str) -> bool:
        """Whether an operation holds ``key`` or waits for it."""
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @asynccontextmanager
    async def hold(self, *keys: str) -> AsyncIterator[None]:
        """Hold every key in ``keys`` (distinct; acquired in the given order) for the block."""
        entries = []
        for key in keys:  # synchronous on purpose: see the module docstring
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry()
            entry.users += 1
            entries.append((key, entry))
        try:
            async with AsyncExitStack() as stack:
                for _, entry in entries:
                    await stack.enter_async_context(entry.lock)
                yield
        finally:
            for key, entry in entries:
                entry.users -= 1
                if entry.users == 0:
                    del self._entries[key]
