"""The HTTP clients of ``kvgate bench scale``'s second curve, run as a child process:

    python -m gateway.bench.scale_load BASE_URL SERVER_PID SPEC_JSON

SPEC_JSON: {"sizes": [bytes...], "clients": [n...], "duration": seconds}. For each size and
client count: ``n`` clients (one keep-alive connection each) put for ``duration`` seconds, then
get for as long, each with one request in flight at a time; one JSON line per (size, clients)
with ops/s, MB/s and p50/p99 of each phase, and the server's CPU and resident memory.

A process apart from the server (as ``kvgate serve``'s users are), on uvloop when it is
installed: the clients and the server do not share one event loop or one GIL. On a 2-core
machine they share the cores, which the server's CPU per operation makes visible.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import aiohttp

from gateway.bench.scale_stats import cpu_seconds_of, memory_of, percentile_ms

KEY_BYTES = 128 << 20  # the keys of one size span at most this much: all in the memory tier


def keys_for(size: int) -> list[str]:
    """64-256 keys (as many as fit in KEY_BYTES): more than the most clients, so that no two
    clients work on one key at once."""
    count = max(64, min(256, KEY_BYTES // max(size, 1)))
    return [f"scale/{size}/{i}" for i in range(count)]


async def _phase(
    base: str, method: str, keys: list[str], body: bytes, clients: int, duration: float
) -> dict[str, Any]:
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as session:
        stop_at = time.perf_counter() + duration

        async def client(first: int) -> None:
            nonlocal errors
            i = first
            while time.perf_counter() < stop_at:
                url = f"{base}/v1/objects/{keys[i % len(keys)]}"
                i += clients
                t0 = time.perf_counter()
                if method == "PUT":
                    headers = {"content-type": "application/octet-stream"}
                    async with session.put(url, data=body, headers=headers) as answer:
                        await answer.read()
                        ok = answer.status == 204
                else:
                    async with session.get(url) as answer:
                        got = await answer.read()
                        ok = answer.status == 200 and len(got) == len(body)
                latencies.append(time.perf_counter() - t0)
                errors += not ok

        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        elapsed = time.perf_counter() - t0
    ops = len(latencies)
    return {
        "ops_per_s": ops / elapsed,
        "mb_per_s": ops * len(body) / elapsed / 1e6,
        "p50_ms": percentile_ms(latencies, 0.5),
        "p99_ms": percentile_ms(latencies, 0.99),
        "ops": ops,
        "errors": errors,
    }


async def _store_all(base: str, keys: list[str], body: bytes) -> None:
    headers = {"content-type": "application/octet-stream"}
    async with aiohttp.ClientSession() as session:

        async def store(key: str) -> None:
            async with session.put(f"{base}/v1/objects/{key}", data=body, headers=headers):
                pass

        await asyncio.gather(*map(store, keys))


async def run(base: str, server_pid: int, spec: dict[str, Any]) -> None:
    for size in spec["sizes"]:
        body = os.urandom(size)
        keys = keys_for(size)
        await _store_all(base, keys, body)  # so that every get of the sweep is a hit
        for clients in spec["clients"]:
            point: dict[str, Any] = {"size": size, "clients": clients}
            for method in ("PUT", "GET"):
                cpu0 = cpu_seconds_of(server_pid)
                result = await _phase(base, method, keys, body, clients, spec["duration"])
                server_cpu = cpu_seconds_of(server_pid) - cpu0
                ops = max(result["ops"], 1)
                result["server_cpu_us_per_op"] = server_cpu / ops * 1e6
                point[method.lower()] = result
            point["server_rss"] = memory_of(server_pid)[0]
            print(json.dumps(point), flush=True)


def main(argv: list[str]) -> None:
    base, pid, spec = argv
    try:
        import uvloop
    except ModuleNotFoundError:
        asyncio.run(run(base, int(pid), json.loads(spec)))
        return
    uvloop.run(run(base, int(pid), json.loads(spec)))


if __name__ == "__main__":
    main(sys.argv[1:])
