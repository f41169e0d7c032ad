"""Redis put and get through a kvgate Store against ``redis-benchmark`` on the same server.

Run with kvgate's python, against a running Redis (``redis-benchmark`` from redis-tools)::

    .venv/bin/python benchmarks/redis_wire.py --url redis://127.0.0.1:6379/0 \\
        [--size 32MiB] [-n 16] [--rounds 3] [--json]

Each round runs, back to back on the same server: ``redis-benchmark -t set,get -d SIZE -n N
-P 1 -c 1`` (one connection, one request at a time: the wire's own pace for one client), then
``kvgate bench``'s Store run (``gateway.bench.store.run_bench``) on that server as its only
tier, N puts then N gets of SIZE bytes. GB/s = N x SIZE / seconds, from redis-benchmark's
requests per second on its side. Rounds alternate the two, so a machine whose speed drifts
(a shared 2-core VM) slows both; the report is each side's median and their quotient, and
every round's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import shutil
import statistics
import subprocess
from typing import Any
from urllib.parse import urlsplit

from gateway.bench.store import run_bench
from gateway.config import parse_size


def redis_benchmark(url: str, size: int, count: int) -> dict[str, float]:
    """GB/s of SET and GET by ``redis-benchmark`` (one client, no pipelining)."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        raise SystemExit("redis-benchmark not found: apt-get install redis-tools")
    parts = urlsplit(url)
    argv = [binary, "-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379)]
    if parts.password:
        argv += ["-a", parts.password]
    argv += ["-t", "set,get", "-d", str(size), "-n", str(count), "-P", "1", "-c", "1", "--csv"]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=600).stdout
    rates: dict[str, float] = {}
    for row in csv.reader(io.StringIO(out)):
        if len(row) >= 2 and row[0] in ("SET", "GET"):
            rates[row[0].lower()] = float(row[1]) * size / 1e9
    if set(rates) != {"set", "get"}:
        raise SystemExit(f"unexpected redis-benchmark output: {out!r}")
    return rates


async def store_rates(url: str, size: int, count: int) -> dict[str, float]:
    result = await run_bench([url], size=size, count=count, baseline="none", kind="tensor")
    if result.get_hits != count:
        raise SystemExit(f"the Store read back {result.get_hits} of {count} objects")
    return {"set": result.put_gbps, "get": result.get_gbps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True, help="redis://host:port/db")
    parser.add_argument("--size", default="32MiB")
    parser.add_argument("-n", "--count", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    size = parse_size(args.size)
    rounds: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        wire = redis_benchmark(args.url, size, args.count)
        store = asyncio.run(store_rates(args.url, size, args.count))
        rounds.append({"redis_benchmark": wire, "kvgate": store})
    report: dict[str, Any] = {"size": size, "count": args.count, "rounds": rounds}
    for op in ("set", "get"):
        wire = statistics.median(r["redis_benchmark"][op] for r in rounds)
        ours = statistics.median(r["kvgate"][op] for r in rounds)
        report[op] = {"redis_benchmark_gbps": wire, "kvgate_gbps": ours, "ratio": ours / wire}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for op, name in (("set", "put"), ("get", "get")):
        r = report[op]
        print(
            f"{name}: kvgate {r['kvgate_gbps']:.3f} GB/s, redis-benchmark "
            f"{r['redis_benchmark_gbps']:.3f} GB/s, ratio {r['ratio']:.2f}"
        )


if __name__ == "__main__":
    main()
