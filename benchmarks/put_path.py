"""Where a durable put's time goes, against the tier's raw client: one process, alternated rounds.

Run with kvgate's python against a running server::

    .venv/bin/python benchmarks/put_path.py URL [--tier-options JSON] [--size 1MiB] [-n 64]
        [--rounds 9] [--json]

Four sides put the same distinct objects (``bench_sources``: rows spread over 256 MiB, so
none is sent from the CPU cache) one at a time, each to fresh keys, in rounds whose order
rotates, so that a drift of the machine's speed falls on every side alike:

- ``raw``: the connector class's ``raw_client_baseline`` (its plain client library, the
  baseline of ``kvgate bench``), one put at a time; only its puts count;
- ``frame``: the bare connector (no layers, no Store) putting a frame whose checksum is
  already known: what the raw client does plus kvgate's framing and connector;
- ``frame+hash``: the same with the frame's xxh3 of the payload computed per put;
- ``store``: ``Store.put`` with ``write_policy: through`` on that tier alone (the checksum,
  the layers, the Store's bookkeeping).

Each side's figure is the median over rounds of its mean time per put; ratios are to ``raw``.
The steps between sides say what each piece costs, which ``kvgate bench`` (one ratio per
cell) cannot. Keys are deleted after each round, untimed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import xxhash

from gateway.bench.store import bench_sources
from gateway.codec import frame_head
from gateway.config import parse_size
from gateway.connector import Connector
from gateway.malloc_thresholds import steady_malloc_thresholds
from gateway.object_meta import ObjectMeta
from gateway.registry import connect, connector_class, scheme_of
from gateway.store import Store

Put = Callable[[str, int], Awaitable[None]]
SIDES = ("raw", "frame", "frame+hash", "store")


def _meta(size: int) -> ObjectMeta:
    return ObjectMeta("bytes", "uint8", (size,), size)


async def _raw_round(
    url: str, options: dict[str, Any], payloads: list[bytes], size: int, n: int
) -> float:
    """Seconds per put of the raw client (its own client, keys and clean-up)."""
    raw = connector_class(scheme_of(url)).raw_client_baseline
    put_gbps, _ = await raw(url, options, size=size, count=n, concurrency=1, payloads=payloads)
    return float(size / (put_gbps * 1e9))


async def _timed(put: Put, tag: str, n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        await put(f"{tag}/{i}", i)
    return (time.perf_counter() - start) / n


async def measure(
    url: str, options: dict[str, Any], size: int, n: int, rounds: int
) -> dict[str, list[float]]:
    """Seconds per put of each side, one figure per round."""
    payloads = [row.tobytes() for row in bench_sources(size, n, 1)]
    sums = [xxhash.xxh3_64_intdigest(p) for p in payloads]
    meta = _meta(size)
    bare: Connector = connect(url, **options)
    store = Store({"tiers": [{"url": url, "options": options}], "write_policy": "through"})

    async def framed(key: str, i: int, *, hashed: bool) -> None:
        part = memoryview(payloads[i % len(payloads)])
        known = None if hashed else sums[i % len(sums)]
        head, _ = frame_head("raw", meta, [part], {}, None, known, key)
        await bare.put(key, [memoryview(head), part])

    async def frame(key: str, i: int) -> None:
        await framed(key, i, hashed=False)

    async def frame_hash(key: str, i: int) -> None:
        await framed(key, i, hashed=True)

    async def store_put(key: str, i: int) -> None:
        await store.put(key, payloads[i % len(payloads)])

    timed: dict[str, tuple[Put, Callable[[str], Awaitable[object]]]] = {
        "frame": (frame, bare.delete),
        "frame+hash": (frame_hash, bare.delete),
        "store": (store_put, store.delete),
    }
    results: dict[str, list[float]] = {side: [] for side in SIDES}
    async with store:
        try:
            for side, (put, _) in timed.items():  # connections up, first calls made
                await put(f"put-path/warm-{side}", 0)
            for r in range(rounds):
                order = SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]
                for side in order:
                    if side == "raw":
                        results[side].append(await _raw_round(url, options, payloads, size, n))
                        continue
                    put, delete = timed[side]
                    tag = f"put-path/{os.urandom(4).hex()}"
                    results[side].append(await _timed(put, tag, n))
                    for i in range(n):
                        await delete(f"{tag}/{i}")
            for side, (_, delete) in timed.items():
                await delete(f"put-path/warm-{side}")
        finally:
            await bare.close()
    return results


def report(results: dict[str, list[float]], size: int) -> dict[str, Any]:
    base = statistics.median(results["raw"])
    out: dict[str, Any] = {"size": size, "sides": {}}
    for side in SIDES:
        us = statistics.median(results[side]) * 1e6
        out["sides"][side] = {
            "us_per_put": round(us, 1),
            "ratio_to_raw": round(base * 1e6 / us, 3),
            "rounds_us": [round(s * 1e6, 1) for s in results[side]],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--tier-options", default="{}", help="the tier's options, as JSON")
    parser.add_argument("--size", default="1MiB")
    parser.add_argument("-n", type=int, default=64, help="puts per side and round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    steady_malloc_thresholds()  # as kvgate's CLI does
    size = parse_size(args.size)
    options = json.loads(args.tier_options)
    results = asyncio.run(measure(args.url, options, size, args.n, args.rounds))
    summary = report(results, size)
    if args.json:
        print(json.dumps(summary))
        return
    print(f"{args.url}, {args.size}, {args.n} puts a side and round, {args.rounds} rounds")
    for side, row in summary["sides"].items():
        print(f"  {side:11s} {row['us_per_put']:9.1f} us a put   {row['ratio_to_raw']:.3f}x raw")


if __name__ == "__main__":
    main()
