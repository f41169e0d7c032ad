"""The timing half of a connector's ``raw_client_baseline`` (the hook ``kvgate bench`` calls).

A connector class may offer::

    @classmethod
    async def raw_client_baseline(
        cls, url, options, *, size: int, count: int, concurrency: int
    ) -> tuple[float, float]: ...

returning (put GB/s, get GB/s) of its plain client library doing the bench's work the obvious
way: one put and one get call per object, ``concurrency`` in flight, its own keys, deleted
afterwards. The connector sets up the client, maps its errors and cleans up; ``timed_put_get``
is the part they all share.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from gateway.errors import GatewayError


async def timed_put_get(
    put: Callable[[int], Awaitable[object]],
    get: Callable[[int], Awaitable[int | None]],
    *,
    size: int,
    count: int,
    concurrency: int,
) -> tuple[float, float]:
    """(put GB/s, get GB/s) of ``put(i)`` then ``get(i)`` for every i < count.

    ``get`` returns the length it read (None for a miss); anything but ``size`` is an error,
    so a baseline that silently reads nothing cannot look fast.
    """
    slots = asyncio.Semaphore(max(1, concurrency))

    async def bounded(call: Awaitable[object]) -> object:
        async with slots:
            return await call

    start = time.perf_counter()
    await asyncio.gather(*(bounded(put(i)) for i in range(count)))
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    lengths = await asyncio.gather(*(bounded(get(i)) for i in range(count)))
    get_s = time.perf_counter() - start
    for i, length in enumerate(lengths):
        if length != size:
            raise GatewayError(f"baseline: object {i} read back {length} bytes, not {size}")
    total = size * count / 1e9
    return total / put_s, total / get_s
