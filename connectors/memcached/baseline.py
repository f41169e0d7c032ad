"""The raw-client baseline for ``kvgate bench``: plain aiomcache, the obvious way.

One ``set`` and one ``get`` per object, ``concurrency`` in flight over a pool of as many
connections, keys under ``kvgate-baseline/``, deleted afterwards. Each object is one item, so
the server's ``-I`` must exceed the object size (the bench's server runs with ``-I 64m``).
aiomcache has no timeouts of its own: each phase runs under one deadline sized from
``seconds_per_object``, and the client is closed (all its connections) whatever happens.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Awaitable, Callable

import aiomcache

from gateway.errors import CapacityError, GatewayError, Timeout, Unavailable


async def _timed(
    op: Callable[[int], Awaitable[None]], count: int, concurrency: int, deadline: float
) -> float:
    """Seconds to run ``op(i)`` for every i < count, ``concurrency`` at a time."""
    next_index = iter(range(count))

    async def worker() -> None:
        for i in next_index:  # shared iterator: each index is taken once
            await op(i)

    start = time.perf_counter()
    async with asyncio.timeout(deadline):
        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, count)))))
    return time.perf_counter() - start


async def aiomcache_baseline(
    host: str,
    port: int,
    *,
    size: int,
    count: int,
    concurrency: int,
    seconds_per_object: float,
) -> tuple[float, float]:
    """(put GB/s, get GB/s) of aiomcache ``set``/``get`` of ``count`` objects of ``size``."""
    client = aiomcache.Client(host, port, pool_size=max(1, concurrency))
    data = os.urandom(size)
    keys = [f"kvgate-baseline/{uuid.uuid4().hex}/{i}".encode() for i in range(count)]
    deadline = seconds_per_object * max(1, count)

    async def put(i: int) -> None:
        await client.set(keys[i], data)

    async def get(i: int) -> None:
        value = await client.get(keys[i])
        if value is None or len(value) != size:
            raise GatewayError(f"baseline: object {i} came back missing or of another size")

    try:
        put_s = await _timed(put, count, concurrency, deadline)
        get_s = await _timed(get, count, concurrency, deadline)
    except aiomcache.ClientException as exc:
        if "too large" in str(exc):
            raise CapacityError(
                f"baseline: memcached refused a {size}-byte item; start it with -I above that"
            ) from exc
        raise GatewayError(f"baseline: {exc}") from exc
    except TimeoutError as exc:
        raise Timeout(f"baseline: no result within {deadline:g} s") from exc
    except OSError as exc:
        raise Unavailable(f"baseline: {exc}") from exc
    finally:
        try:
            async with asyncio.timeout(seconds_per_object * 2):
                for key in keys:
                    await client.delete(key)
        except (aiomcache.ClientException, OSError):
            pass  # the server went away or stalled: its keys are its own problem now
        await client.close()
    total = size * count / 1e9
    return total / put_s, total / get_s
