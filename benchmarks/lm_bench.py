"""LMCache's own lm:// client against the stock ``lmcache_server`` and kvgate's lm:// server.

Run with kvgate's python (after ``.ci/lmcache-env``)::

    .venv/bin/python benchmarks/lm_bench.py [--size-mib 32] [--rounds 8] [--repeat 3]

It starts ``lmcache_server 127.0.0.1 P cpu`` from LMCache's venv and kvgate's server
(``gateway.lmcache.server.serve_lm`` over a memory-only Store) in this process, then runs this same
file as ``client`` under LMCache's python against each in turn, in the same run, and prints
put and get throughput (median of ``--repeat``). Puts are timed until an EXIST on the same
connection answers (PUT has no reply), so both servers are timed to "stored".

The ``client`` and ``check`` roles run under LMCache's python: ``check`` puts one KV chunk with
LMCache's ``LMCServerConnector``, reads it back and compares (the interoperability test).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


# -- the LMCache side (LMCache's python) ------------------------------------------------------


def _lmcache_client(port: int, size_mib: int, dtype_name: str) -> tuple[Any, Any, Any]:
    """LMCache's lm:// connector on ``port`` and a CPU backend that allocates its chunks."""
    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    dtype = getattr(torch, dtype_name)
    # kv_shape (layers, 2, tokens, heads, head_size); heads grow to reach the chunk size.
    per_head = 8 * 2 * 256 * 128 * dtype.itemsize
    heads = max(1, size_mib * MiB // per_head)
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=256,
        local_cpu=False,
        max_local_cpu_size=max(1.0, 4 * size_mib / 1024),
        remote_url=f"lm://127.0.0.1:{port}",
    )
    meta = LMCacheMetadata(
        model_name="kvgate-bench",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=dtype,
        kv_shape=(8, 2, 256, heads, 128),
    )
    cpu = LocalCPUBackend(config=cfg, metadata=meta, dst_device="cpu")
    conn = LMCServerConnector("127.0.0.1", port, asyncio.get_running_loop(), cpu)
    return conn, cpu, dtype


def _key(i: int, dtype: Any) -> Any:
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey("kvgate-bench", 1, 0, 0x5EED0000 + i, dtype)


async def _check(port: int, size_mib: int, dtype_name: str) -> dict[str, Any]:
    import torch

    conn, cpu, dtype = _lmcache_client(port, size_mib, dtype_name)
    obj = cpu.allocate(conn.meta_shapes, conn.meta_dtypes, conn.meta_fmt)
    src = torch.randn(obj.tensor.shape).to(dtype)
    obj.tensor.copy_(src)
    key = _key(1, dtype)
    await conn.put(key, obj)
    result = {
        "key": key.to_string(),
        "exists": await conn.exists(key),
        "missing_exists": await conn.exists(_key(999, dtype)),
        "missing_get": await conn.get(_key(998, dtype)) is None,
    }
    got = await conn.get(key)
    result["shape"] = list(got.get_shape()) if got is not None else None
    result["fmt"] = int(got.get_memory_format().value) if got is not None else None
    result["dtype"] = str(got.get_dtype()) if got is not None else None
    result["equal"] = got is not None and torch.equal(
        got.tensor.view(torch.uint8), src.view(torch.uint8)
    )
    await conn.close()
    return result


async def _client(port: int, size_mib: int, rounds: int) -> dict[str, float]:
    conn, cpu, dtype = _lmcache_client(port, size_mib, "bfloat16")
    obj = cpu.allocate(conn.meta_shapes, conn.meta_dtypes, conn.meta_fmt)
    obj.tensor.fill_(1)
    nbytes = len(obj.byte_array)
    keys = [_key(i, dtype) for i in range(rounds)]
    await conn.put(keys[0], obj)  # warm up: connection, server buffers
    await conn.exists(keys[0])
    start = time.perf_counter()
    for key in keys:
        await conn.put(key, obj)
    assert await conn.exists(keys[-1])  # same connection: every put before it is stored
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    for key in keys:
        got = await conn.get(key)
        assert got is not None
        got.ref_count_down()
    get_s = time.perf_counter() - start
    await conn.close()
    total = nbytes * rounds
    return {"bytes": nbytes, "put_MiBps": total / put_s / MiB, "get_MiBps": total / get_s / MiB}


# -- the orchestrator (kvgate's python) -------------------------------------------------------


def _venv() -> Path:
    return Path(os.environ.get("INTEROP_LMCACHE_VENV") or ROOT / ".venv-lmcache")


async def _run_client(port: int, args: argparse.Namespace) -> dict[str, float]:
    proc = await asyncio.create_subprocess_exec(
        str(_venv() / "bin" / "python"),
        __file__,
        "client",
        "--port",
        str(port),
        "--size-mib",
        str(args.size_mib),
        "--rounds",
        str(args.rounds),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 600)
    if proc.returncode != 0:
        raise RuntimeError(f"client failed:\n{err.decode()[-3000:]}")
    return dict(json.loads(out.decode().strip().splitlines()[-1]))


async def _orchestrate(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from servers.proc import ServerProcess, free_port, port_open

    from gateway.lmcache.server import serve_lm
    from gateway.store import Store

    stock_port, ours_port = free_port(), free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"lm-bench-{stock_port}.log"
    stock = ServerProcess(
        [str(_venv() / "bin" / "lmcache_server"), "127.0.0.1", str(stock_port), "cpu"],
        ready=lambda: port_open(stock_port),
        log_path=log,
        env={"LMCACHE_DISABLE_BANNER": "1"},
        ready_timeout=60,
    ).start()
    capacity = (args.rounds + 2) * args.size_mib * MiB * 2
    store = Store({"tiers": [{"url": "memory://", "capacity": capacity}], "prefault": True})
    results: dict[str, list[dict[str, float]]] = {"lmcache_server": [], "kvgate": []}
    try:
        async with store:
            server = await serve_lm(store, "127.0.0.1", ours_port)
            for _ in range(args.repeat):  # alternate, so drift hits both alike
                results["lmcache_server"].append(await _run_client(stock_port, args))
                results["kvgate"].append(await _run_client(ours_port, args))
            server.close()
    finally:
        stock.stop()
    print(
        f"LMCache's lm:// client, {args.size_mib} MiB chunks x {args.rounds}, "
        f"median of {args.repeat} (MiB/s)"
    )
    print(f"{'server':16} {'put':>8} {'get':>8}")
    for name, runs in results.items():
        put = statistics.median(r["put_MiBps"] for r in runs)
        get = statistics.median(r["get_MiBps"] for r in runs)
        print(f"{name:16} {put:8.0f} {get:8.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("role", nargs="?", default="bench", choices=["bench", "client", "check"])
    parser.add_argument("--port", type=int)
    parser.add_argument("--size-mib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    if args.role == "bench":
        asyncio.run(_orchestrate(args))
    elif args.role == "client":
        print(json.dumps(asyncio.run(_client(args.port, args.size_mib, args.rounds))))
    else:
        print(json.dumps(asyncio.run(_check(args.port, args.size_mib, args.dtype))))


if __name__ == "__main__":
    main()
