"""Where a durable put's time goes, against the tier's raw client, in alternated rounds.

Run with kvgate's python against a running server::

    .venv/bin/python benchmarks/put_path.py URL [--tier-options JSON] [--size 1MiB] [-n 64]
        [--rounds 9] [--json]

Four sides put the same distinct objects (``bench_sources``: rows spread over 256 MiB, so
none is sent from the CPU cache) one at a time, each to fresh keys, in rounds (the raw client
first, the others in an order that rotates), so that a drift of the machine's speed falls on
every side alike:

- ``raw``: the connector class's ``raw_client_baseline`` (its plain client library, the
  baseline of ``kvgate bench``), one put at a time; only its puts count. It runs in a child
  process (this script again, ``--raw-round``), on the same objects: it sets up and closes a
  client every round, and a Mooncake client closed in a process slowed the puts of another
  one still open there about 2.5x (a scratch script: 1.2-1.4 ms a 1 MiB put before, 2.9-3.6
  after; a client closed in another process did not);
- ``frame``: the Store's own connector without its layers (the same client and connections)
  putting a frame whose checksum is already known: what the raw client does plus kvgate's
  framing and connector;
- ``frame+hash``: the same with the frame's xxh3 of the payload computed per put;
- ``store``: ``Store.put`` with ``write_policy: through`` on that tier alone (the checksum,
  the layers, the Store's bookkeeping).

Each side's figure is the median over rounds of its mean time per put; ratios are to ``raw``.
The steps between sides say what each piece costs, which ``kvgate bench`` (one ratio per
cell) cannot. Each kvgate side's round starts with ``WARM_BYTES`` of untimed puts (16 at 1
MiB), as the raw baseline warms its client: the sides wait while the child runs, and after an
idle spell the first ~16 Mooncake puts were 2-3x slower. Keys are deleted after each round,
untimed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import xxhash

from gateway.bench.store import bench_sources
from gateway.codec import frame_head
from gateway.config import parse_size, redact_url
from gateway.connector import Connector
from gateway.layers import Layer
from gateway.malloc_thresholds import steady_malloc_thresholds
from gateway.object_meta import ObjectMeta
from gateway.registry import connector_class, scheme_of
from gateway.store import Store

Put = Callable[[str, int], Awaitable[None]]
SIDES = ("raw", "frame", "frame+hash", "store")
WARM_BYTES = 16 << 20  # untimed puts before each kvgate side's round: this much, 2 at least


def _meta(size: int) -> ObjectMeta:
    return ObjectMeta("bytes", "uint8", (size,), size)


async def _raw_round(url: str, options: dict[str, Any], size: int, n: int) -> float:
    """Seconds per put of the raw client, measured in a child process (see the module doc).
    The URL and options go to it on stdin, not its command line, which others can read."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--raw-round",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    job = {"url": url, "options": options, "size": size, "n": n}
    out, _ = await child.communicate(json.dumps(job).encode())
    if child.returncode != 0:
        raise RuntimeError(f"the raw client's round failed (exit {child.returncode})")
    # The last line: a client library may print lines of its own before it.
    return float(json.loads(out.splitlines()[-1])["seconds_per_put"])


async def raw_round_here(url: str, options: dict[str, Any], size: int, n: int) -> float:
    """Seconds per put of ``raw_client_baseline`` on the bench's objects, in this process."""
    payloads = [row.tobytes() for row in bench_sources(size, n, 1)]
    raw = connector_class(scheme_of(url)).raw_client_baseline
    put_gbps, _ = await raw(url, options, size=size, count=n, concurrency=1, payloads=payloads)
    return float(size / (put_gbps * 1e9))


def _warm_count(size: int) -> int:
    return max(2, WARM_BYTES // max(size, 1))


async def _timed(put: Put, tag: str, n: int, warm: int) -> float:
    for i in range(warm):
        await put(f"{tag}/warm-{i}", i)
    start = time.perf_counter()
    for i in range(n):
        await put(f"{tag}/{i}", i)
    return (time.perf_counter() - start) / n


async def measure(
    url: str, options: dict[str, Any], size: int, n: int, rounds: int
) -> dict[str, list[float]]:
    """Seconds per put of each side, one figure per round."""
    payloads = [row.tobytes() for row in bench_sources(size, n, 1)]
    store = Store({"tiers": [{"url": url, "options": options}], "write_policy": "through"})
    async with store:
        return await _rounds(store, url, options, payloads, n, rounds)


async def _rounds(
    store: Store, url: str, options: dict[str, Any], payloads: list[bytes], n: int, rounds: int
) -> dict[str, list[float]]:
    size = len(payloads[0])
    sums = [xxhash.xxh3_64_intdigest(p) for p in payloads]
    meta = _meta(size)
    bare = _unlayered(store.tiers[0].connector)

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
    for r in range(rounds):
        # The raw client's child first, then the others in an order that rotates: each of
        # them follows the child in a third of the rounds (the round right after it ran
        # slower on memcached: 0.61-0.64 ms a put against 0.32-0.49).
        kvgate = SIDES[1:]
        order = ("raw", *kvgate[r % len(kvgate) :], *kvgate[: r % len(kvgate)])
        for side in order:
            if side == "raw":
                results[side].append(await _raw_round(url, options, size, n))
                continue
            put, delete = timed[side]
            tag = f"put-path/{os.urandom(4).hex()}"
            warm = _warm_count(size)
            try:
                results[side].append(await _timed(put, tag, n, warm))
            finally:  # whatever happened, the round's keys do not stay behind
                keys = [f"{tag}/warm-{i}" for i in range(warm)] + [f"{tag}/{i}" for i in range(n)]
                await asyncio.gather(*(delete(k) for k in keys), return_exceptions=True)
    return results


def _unlayered(connector: Connector) -> Connector:
    """The connector under a tier's layers (each layer wraps the next as ``inner``)."""
    while isinstance(connector, Layer):
        connector = connector.inner
    return connector


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
    parser.add_argument("url", nargs="?", help="the tier under test (required)")
    parser.add_argument("--tier-options", default="{}", help="the tier's options, as JSON")
    parser.add_argument("--size", default="1MiB")
    parser.add_argument("-n", type=int, default=64, help="puts per side and round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--raw-round", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steady_malloc_thresholds()  # as kvgate's CLI does
    if args.raw_round:  # the child of _raw_round: its job comes on stdin
        job = json.loads(sys.stdin.read())
        seconds = asyncio.run(raw_round_here(job["url"], job["options"], job["size"], job["n"]))
        print(json.dumps({"seconds_per_put": seconds}))
        return
    if args.url is None:
        parser.error("the URL of the tier under test is required")
    if args.rounds < 1 or args.n < 1:
        parser.error("--rounds and -n must be at least 1")
    size = parse_size(args.size)
    options = json.loads(args.tier_options)
    results = asyncio.run(measure(args.url, options, size, args.n, args.rounds))
    summary = report(results, size)
    if args.json:
        print(json.dumps(summary))
        return
    shown = redact_url(args.url)
    print(f"{shown}, {args.size}, {args.n} puts a side and round, {args.rounds} rounds")
    for side, row in summary["sides"].items():
        print(f"  {side:11s} {row['us_per_put']:9.1f} us a put   {row['ratio_to_raw']:.3f}x raw")


if __name__ == "__main__":
    main()
