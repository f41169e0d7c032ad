"""The raw-client baseline for ``kvgate bench``: Mooncake's plain Python API, the obvious way.

One ``put(key, bytes)`` and one ``get(key)`` per object, in ``threads`` threads (the API
blocks), on a client of its own whose transfer buffer holds ``threads`` objects at once, after
one untimed put and get per thread (a warm client, like a connector that has been running). Keys
live under ``kvgate-baseline/<random>/``; they are force-removed afterwards (nobody else reads
them, so their leases do not matter). Every object is checked for its length.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from connectors.mooncake import errors as codes
from connectors.mooncake.client import load_store_class
from connectors.mooncake.config import MooncakeOptions, Target
from gateway.client_baseline import baseline_objects
from gateway.errors import GatewayError, Unavailable


def _timed(op: Callable[[int], None], count: int, threads: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(max(1, min(threads, count))) as pool:
        list(pool.map(op, range(count)))
    return time.perf_counter() - start


def raw_put_get(
    target: Target,
    options: MooncakeOptions,
    *,
    size: int,
    count: int,
    threads: int,
    payloads: Sequence[bytes] = (),
) -> tuple[float, float]:
    """(put GB/s, get GB/s) of ``count`` plain puts and gets of ``size`` bytes."""
    store = load_store_class()()
    rc = store.setup(
        options.local_hostname,
        target.metadata_server,
        0,
        max(options.local_buffer_size, 2 * size * max(1, threads)),
        options.protocol,
        options.device_name,
        target.master,
    )
    if rc != 0:
        raise Unavailable(f"baseline: no Mooncake client for {target.shown} (setup: {rc})")
    objects = baseline_objects(size, payloads)
    keys = [f"kvgate-baseline/{uuid.uuid4().hex}/{i}" for i in range(count)]

    def put(i: int) -> None:
        codes.check(store.put(keys[i], objects[i % len(objects)]), f"baseline: put {keys[i]}")

    def get(i: int) -> None:
        value = store.get(keys[i])
        if len(value) != size:
            raise GatewayError(f"baseline: {keys[i]} came back with {len(value)} bytes")

    warm = [f"kvgate-baseline/{uuid.uuid4().hex}/warm-{i}" for i in range(max(1, threads))]

    def warm_up(i: int) -> None:
        codes.check(store.put(warm[i], objects[0]), f"baseline: put {warm[i]}")
        store.get(warm[i])

    try:
        # One untimed put and get per thread first: the client's transfer buffer is faulted
        # in and its connections are up, as they are for a connector that has been running.
        _timed(warm_up, len(warm), threads)
        put_s = _timed(put, count, threads)
        get_s = _timed(get, count, threads)
    finally:
        for key in warm:
            store.remove(key, True)
        for key in keys:
            store.remove(key, True)  # force: skip the leases the gets just took
        store.close()
    total = size * count / 1e9
    return total / put_s, total / get_s
