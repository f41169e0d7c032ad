"""The disk-tier side of ``kvgate bench scale``, run as a child process per step:

    python -m gateway.bench.scale_tier fill    ROOT FIRST END SIZE CAPACITY
    python -m gateway.bench.scale_tier measure ROOT COUNT SIZE CAPACITY SAMPLES

Each step prints one JSON object. Why child processes: the file tier locks its directory for
its connector's lifetime, and the memory an index costs is only readable in a process that
did nothing else. ``measure`` is a restart as a user's would be: a fresh interpreter opens the
filled directory, once as after a crash (the index is rebuilt from the files' headers), which
gives that start-up time and the index's resident bytes, and once after a clean close (the
index the close saved is read back); then it times sampled puts and gets through a Store, and
reading every key page by page (``GET /v1/keys``'s listing, 1000 keys a page).

``fill`` writes frames through the connector itself, many at once and without fsync: filling
is not what is measured, and a million puts through the Store with fsync would take the best
part of an hour on a 2-core machine. The frames are the ones the Store writes (raw codec,
bound to their key), so the Store reads them back like its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import sys
import time
from typing import Any

import numpy as np

from connectors.fs import FileConnector, snapshot
from gateway.bench.scale_stats import memory_of, percentile_ms
from gateway.frame import encode_header, payload_checksum
from gateway.listing import MAX_PAGE, KeyListings
from gateway.store import Store

FILL_CONCURRENCY = 64  # puts in flight while filling: enough to keep the tier's threads busy
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def key_of(i: int) -> str:
    """The i-th stored key, in LMCache's form with a chunk hash that looks like one: key length
    is part of what an index costs per object (62 characters here)."""
    chunk_hash = (i * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF
    return f"{MODEL}@1@0@{chunk_hash:016x}@bfloat16"


def _connector(root: str, capacity: int, *, fsync: bool) -> FileConnector:
    # A capacity, as the default config's disk tier has: the eviction policy's order is part
    # of the index's cost. Set above what is stored, so nothing is evicted.
    return FileConnector(root, capacity=capacity, fsync=fsync)


async def fill(root: str, first: int, end: int, size: int, capacity: int) -> dict[str, Any]:
    """Put keys ``first``..``end - 1`` (``size`` random bytes each) into the tier at ``root``."""
    payload = memoryview(np.random.default_rng(first).bytes(size))
    checksum = payload_checksum(payload)
    conn = _connector(root, capacity, fsync=False)
    try:
        t0 = time.perf_counter()
        await conn.open()
        open_s = time.perf_counter() - t0
        todo = iter(range(first, end))

        async def writer() -> None:
            for i in todo:
                key = key_of(i)
                head, _ = encode_header(
                    codec="raw",
                    kind="bytes",
                    dtype="uint8",
                    shape=[size],
                    raw_len=size,
                    payload=payload,
                    checksum=checksum,
                    key=key,
                )
                await conn.put(key, [memoryview(head), payload])

        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(writer() for _ in range(FILL_CONCURRENCY)))
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        await conn.close()
    count = end - first
    return {
        "first": first,
        "end": end,
        "open_s": open_s,
        "fill_s": elapsed,
        "fill_ops_per_s": count / elapsed if elapsed else 0.0,
        "fill_cpu_us_per_op": cpu / count * 1e6 if count else 0.0,
    }


async def measure(root: str, count: int, size: int, capacity: int, samples: int) -> dict[str, Any]:
    """Reopen the tier holding ``count`` objects; time the start and sampled puts and gets.

    Two starts: one as after a crash (the saved index removed, so every record is read), the
    measured one for index memory; and one after the clean close that ends the first, which
    reads the index the close saved.
    """
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(root, snapshot.NAME))  # the fill's close saved one
    conn = _connector(root, capacity, fsync=True)  # sampled puts are what a user's cost
    gc.collect()
    rss_before, _ = memory_of()
    t0 = time.perf_counter()
    await conn.open()
    open_s = time.perf_counter() - t0
    gc.collect()
    rss_after, peak = memory_of()
    config = {"tiers": [{"url": f"file://{root}"}], "staging": 64 << 20}
    rng = np.random.default_rng(count)
    obj = rng.bytes(size)
    probes = [f"scale-probe/{count}/{j}" for j in range(samples)]
    put_lat: list[float] = []
    get_lat: list[float] = []
    hits = 0
    async with Store(config, connectors={0: conn}) as store:
        await store.put("scale-probe/warm-up", obj, durable=True)  # threads, first calls
        await store.get("scale-probe/warm-up")
        await store.delete("scale-probe/warm-up")
        for key in probes:
            t0 = time.perf_counter()
            # durable: returns once the disk tier holds it, so the latency is the tier's put
            # (index update included), not a hand-off to a queue.
            await store.put(key, obj, durable=True)
            put_lat.append(time.perf_counter() - t0)
        for i in rng.integers(0, max(count, 1), samples):
            t0 = time.perf_counter()
            got = await store.get(key_of(int(i)))
            get_lat.append(time.perf_counter() - t0)
            hits += got is not None
        for key in probes:  # leave exactly ``count`` objects for the next step
            await store.delete(key)
        listed, first_page_s, page_s = await _list_all(store)
        t0 = time.perf_counter()
    save_s = time.perf_counter() - t0  # closing the Store, which saves the index
    again = _connector(root, capacity, fsync=True)
    snapshot_bytes = os.stat(os.path.join(root, snapshot.NAME)).st_size
    t0 = time.perf_counter()
    await again.open()
    snapshot_open_s = time.perf_counter() - t0
    await again.close()
    return {
        "objects": count,
        "open_s": open_s,
        "snapshot_open_s": snapshot_open_s,
        "close_save_s": save_s,
        "snapshot_bytes": snapshot_bytes,
        "rss_before_open": rss_before,
        "rss_after_open": rss_after,
        "peak_rss": peak,
        "index_bytes_per_object": (rss_after - rss_before) / count if count else 0.0,
        "put_p50_ms": percentile_ms(put_lat, 0.5),
        "put_p99_ms": percentile_ms(put_lat, 0.99),
        "get_p50_ms": percentile_ms(get_lat, 0.5),
        "get_p99_ms": percentile_ms(get_lat, 0.99),
        "samples": samples,
        "get_hits": hits,
        "listed": listed,
        "list_first_page_ms": first_page_s * 1e3,
        "list_page_p50_ms": percentile_ms(page_s, 0.5),
        "list_all_s": first_page_s + sum(page_s),
    }


async def _list_all(store: Store) -> tuple[int, float, list[float]]:
    """Read every key page by page: the keys seen, the first page's time (it reads the tier),
    and each later page's."""
    listings = KeyListings(store)
    t0 = time.perf_counter()
    page, after = await listings.page(limit=MAX_PAGE)
    first = time.perf_counter() - t0
    listed, later = len(page), []
    while after is not None:
        t0 = time.perf_counter()
        page, after = await listings.page(limit=MAX_PAGE, after=after)
        later.append(time.perf_counter() - t0)
        listed += len(page)
    return listed, first, later


def main(argv: list[str]) -> None:
    step, root, *numbers = argv
    n = [int(x) for x in numbers]
    if step == "fill":
        result = asyncio.run(fill(root, n[0], n[1], n[2], n[3]))
    elif step == "measure":
        result = asyncio.run(measure(root, n[0], n[1], n[2], n[3]))
    else:
        raise SystemExit(f"unknown step {step!r}: fill or measure")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
