"""The raw-client baseline for ``kvgate bench``: plain aiomcache, the obvious way.

One ``set`` and one ``get`` per object, ``concurrency`` in flight over a pool of as many
connections, keys under ``kvgate-baseline/``, deleted afterwards. Each object is one item, so
the server's ``-I`` must exceed the object size (the bench's server runs with ``-I 64m``).
aiomcache has no timeouts of its own: the puts and gets run under one deadline sized from
``seconds_per_object``, and the client is closed (all its connections) whatever happens.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

import aiomcache

from gateway.client_baseline import baseline_objects, timed_put_get
from gateway.errors import CapacityError, GatewayError, Timeout, Unavailable


async def aiomcache_baseline(
    host: str,
    port: int,
    *,
    size: int,
    count: int,
    concurrency: int,
    payloads: Sequence[bytes] = (),
    seconds_per_object: float,
) -> tuple[float, float]:
    """(put GB/s, get GB/s) of aiomcache ``set``/``get`` of ``count`` objects of ``size``."""
    client = aiomcache.Client(host, port, pool_size=max(1, concurrency))
    objects = baseline_objects(size, payloads)
    keys = [f"kvgate-baseline/{uuid.uuid4().hex}/{i}".encode() for i in range(count)]
    deadline = seconds_per_object * max(1, count)

    async def get(i: int) -> int | None:
        value = await client.get(keys[i])
        return None if value is None else len(value)

    try:
        async with asyncio.timeout(2 * deadline):  # the put phase, then the get phase
            return await timed_put_get(
                lambda i: client.set(keys[i], objects[i % len(objects)]),
                get,
                size=size,
                count=count,
                concurrency=concurrency,
            )
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
