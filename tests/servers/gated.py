"""A lower tier whose writes can be held: a real memory connector behind a gate."""

from __future__ import annotations

import asyncio
import uuid

from connectors.memory import MemoryConnector
from gateway.layers import Layer
from gateway.types import BufferParts


class Gated(Layer):
    """A real memory connector whose puts wait while ``gate`` is closed (open at first when
    ``open`` is true)."""

    def __init__(self, *, open: bool = True) -> None:
        self.backing = MemoryConnector.from_url(f"memory://{uuid.uuid4().hex}")
        super().__init__(self.backing)
        self.gate = asyncio.Event()
        if open:
            self.gate.set()
        self.started = 0  # puts that reached the gate
        self.reached = asyncio.Event()  # set by the first

    async def put(self, key: str, data: BufferParts) -> None:
        self.started += 1
        self.reached.set()
        await self.gate.wait()
        await self.inner.put(key, data)
