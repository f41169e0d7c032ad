"""What a call costs in kvgate's own code: loop-thread CPU per call, layer by layer.

Run with kvgate's python::

    .venv/bin/python benchmarks/call_overhead.py [--calls 20000] [--json]
    .venv/bin/python benchmarks/call_overhead.py --tier redis://127.0.0.1:6379 [--size 4KiB]

Without ``--tier`` every call goes to ``blackhole://`` (a connector that keeps nothing and
costs about a microsecond), so what is measured is kvgate's own work: the bare connector's
``put``, each layer of a tier's stack alone around it (timeout, retry, breaker, limit,
metrics), the whole stack, ``ConnectorTier.write`` (framing and checksum of the object) and
``Store.put`` under ``write_policy: through``, all with a ``--size`` object (4 KiB: the fixed
cost, not the bytes'). With ``--tier URL`` (``--tier-options JSON``), ``Store.put``
(write-through) and ``Store.get`` of ``--size`` objects against that tier, one at a time, fresh
keys. Each figure is the median of ``--runs`` runs of ``--calls`` calls, as CPU time of the
loop's thread (``time.thread_time``): on a shared machine wall time per call varies more than
the costs compared, and a remote tier's wall time is mostly the server's. ``--loop uvloop``
runs on the loop ``kvgate serve`` uses (asyncio's own by default). Compare figures within one
run of the script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from connectors.blackhole import BlackholeConnector
from gateway.config import parse_size
from gateway.connector import Connector
from gateway.layers import (
    CircuitBreakerLayer,
    LimitLayer,
    MetricsLayer,
    RetryLayer,
    TimeoutLayer,
)
from gateway.objects import to_object_data
from gateway.store import Store
from gateway.types import TierStats

Call = Callable[[int], Awaitable[object]]


async def cpu_per_call(call: Call, calls: int, runs: int) -> float:
    """Median loop-thread CPU microseconds per ``call(i)``, after a warm-up tenth."""
    for i in range(max(1, calls // 10)):
        await call(i)
    figures = []
    for run in range(runs):
        start = time.thread_time()
        for i in range(calls):
            await call((run + 1) * calls + i)
        figures.append((time.thread_time() - start) / calls * 1e6)
    return statistics.median(figures)


def _putter(connector: Connector, parts: list[memoryview]) -> Call:
    return lambda i: connector.put("k", parts)


async def blackhole_costs(size: int, calls: int, runs: int) -> dict[str, float]:
    data = os.urandom(size)
    parts = [memoryview(bytes(64)), memoryview(data)]  # a frame's head and its payload
    sink = BlackholeConnector()
    alone: dict[str, Connector] = {
        "timeout layer": TimeoutLayer(sink, 5.0),
        "retry layer": RetryLayer(sink, 2, 0.02, 0.5),
        "breaker layer": CircuitBreakerLayer(sink, 5, 5.0),
        "limit layer": LimitLayer(sink, 16),
        "metrics layer": MetricsLayer(sink, TierStats("bench")),
    }
    out = {"connector put": await cpu_per_call(lambda i: sink.put("k", parts), calls, runs)}
    for name, layer in alone.items():
        out[name] = await cpu_per_call(_putter(layer, parts), calls, runs)
    config = {"tiers": [{"url": "blackhole://"}], "write_policy": "through"}
    async with Store(config) as store:
        tier = store.tiers[0]
        obj = to_object_data(data)
        out["whole stack"] = await cpu_per_call(
            lambda i: tier.connector.put("k", parts), calls, runs
        )
        out["ConnectorTier.write"] = await cpu_per_call(lambda i: tier.write("k", obj), calls, runs)
        out["Store.put"] = await cpu_per_call(lambda i: store.put("k", data), calls, runs)
    return out


async def tier_costs(
    url: str, options: dict[str, Any], size: int, calls: int, runs: int
) -> dict[str, float]:
    data = os.urandom(size)
    run_id = os.urandom(4).hex()
    config = {"tiers": [{"url": url, "options": options}], "write_policy": "through"}
    async with Store(config) as store:
        keys = [f"call-overhead/{run_id}/{i}" for i in range((runs + 1) * calls)]

        async def get(i: int) -> None:
            key = keys[calls + i % calls]  # the first timed run's puts
            if await store.get(key) is None:
                raise SystemExit(f"{key} is missing from {url}")

        try:
            put = await cpu_per_call(lambda i: store.put(keys[i], data), calls, runs)
            got = await cpu_per_call(get, calls, runs)
        finally:
            for key in keys:
                await store.delete(key)
    return {"Store.put (through)": put, "Store.get": got}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--size", default="4KiB")
    parser.add_argument("--tier", help="a tier URL: Store put/get against it, not blackhole://")
    parser.add_argument("--tier-options", default="{}", help="its connector options (JSON)")
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    size = parse_size(args.size)
    run: Callable[[Coroutine[Any, Any, dict[str, float]]], dict[str, float]] = asyncio.run
    if args.loop == "uvloop":
        import uvloop

        run = uvloop.run
    if args.tier:
        calls = min(args.calls, 2000)  # each is a round trip
        figures = run(tier_costs(args.tier, json.loads(args.tier_options), size, calls, args.runs))
    else:
        figures = run(blackhole_costs(size, args.calls, args.runs))
    if args.json:
        print(json.dumps({"size": size, "us_loop_cpu_per_call": figures}))
        return
    where = args.tier or "blackhole://"
    print(f"loop-thread CPU per call, {size}-byte objects, {where}, {args.loop} loop")
    for name, micros in figures.items():
        print(f"  {name:22s} {micros:8.2f} us")


if __name__ == "__main__":
    main()
