"""The timing half of a connector's ``raw_client_baseline`` (the hook ``kvgate bench`` calls).

A connector class may offer::

    @classmethod
    async def raw_client_baseline(
        cls, url, options, *, size: int, count: int, concurrency: int,
        payloads: Sequence[bytes] = (),
    ) -> tuple[float, float]: ...

returning (put GB/s, get GB/s) of its plain client library doing the bench's work the obvious
way: one put and one get call per object, ``concurrency`` in flight, its own keys, deleted
afterwards. Put i sends ``payloads[i % len(payloads)]``: the bench passes the distinct objects
its Store puts, so that both sides read their input from the same kind of memory (one object
sent again and again stays in the CPU cache at 1 MiB, which the Store's puts never do).
``baseline_objects`` checks them, or makes one random object for a caller that passes none.
The connector sets up the client, maps its errors and cleans up; ``timed_put_get`` is the part
they all share.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence

from gateway.errors import GatewayError


def baseline_objects(size: int, payloads: Sequence[bytes]) -> Sequence[bytes]:
    """The objects a baseline puts (put i sends item ``i % len``): ``payloads``, each
    ``size`` bytes long, or one random object of ``size`` bytes when there are none."""
    if not payloads:
        return [os.urandom(size)]
    for i, payload in enumerate(payloads):
        if len(payload) != size:
            raise ValueError(f"baseline payload {i} is {len(payload)} bytes, not {size}")
    return payloads


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
