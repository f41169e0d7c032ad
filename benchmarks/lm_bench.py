"""LMCache's own lm:// client against the stock ``lmcache_server`` and kvgate's lm:// server.

Run with kvgate's python (after ``.ci/lmcache-env``)::

    .venv/bin/python benchmarks/lm_bench.py [--size-mib 32] [--rounds 8] [--repeat 3] [--json]

It starts ``lmcache_server 127.0.0.1 P cpu`` from LMCache's venv and kvgate's server the way
users run it, ``kvgate serve --lm-port P`` (``python -m gateway.cli serve``: uvloop when
installed), twice: with a memory-only tier list (a 2 GiB ``memory://`` tier, the default's
first) and with no config (the default memory + disk, its data in a temporary folder). Then it
runs this same file as ``client`` under LMCache's python against each in turn, ``--repeat``
times round, and prints put and get throughput (medians) with each server's ratio to
``lmcache_server`` in the same run. Puts are timed until an EXIST on the same connection
answers (PUT has no reply), so every server is timed to "stored". It also reports each server's
CPU time (all its threads, from /proc) per GiB moved over the client's run (the warm-up put,
the puts and the gets): on a machine shared with other work the MiB/s move with the load, and
CPU seconds a GiB much less.

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
import tempfile
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

# kvgate's servers, each as ``kvgate serve --lm-port`` runs it (uvloop when installed): a
# memory-only tier list, and the default memory + disk (no config: the embedded tiers).
MEMORY_ONLY = "tiers:\n  - url: memory://\n    capacity: 2GiB\n    eviction: lru\n"
KVGATE_SERVERS = {"kvgate memory": MEMORY_ONLY, "kvgate memory+disk": None}
BASELINE = "lmcache_server"


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


def _server_env(config: Path | None, data_dir: Path) -> dict[str, str]:
    """kvgate's environment without the settings that would change its tiers: no KVGATE_* but
    the kernels and malloc choices, and no LMCACHE_* (LMCache's variables would be read as its
    config), the data in ``data_dir``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KVGATE_", "LMCACHE_"))
        or k in ("KVGATE_KERNELS", "KVGATE_MALLOC_THRESHOLDS")
    }
    env["KVGATE_DATA_DIR"] = str(data_dir)
    if config is not None:
        env["KVGATE_CONFIG"] = str(config)
    return env


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid``, all its threads (None off Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start_servers(work: Path, only: list[str]) -> tuple[list[Any], dict[str, tuple[int, int]]]:
    """``lmcache_server`` and kvgate's servers named in ``only`` (all when empty), started;
    their lm:// ports and process ids by name."""
    from servers.proc import ServerProcess, free_port, port_open

    started: list[Any] = []
    ports: dict[str, tuple[int, int]] = {}

    def start(name: str, argv: list[str], port: int, env: dict[str, str]) -> None:
        process = ServerProcess(
            argv,
            ready=lambda: port_open(port),
            log_path=work / f"{name.replace(' ', '-')}.log",
            cwd=ROOT,
            ready_timeout=90,
        )
        process.env = env  # exactly this environment (ServerProcess adds to os.environ)
        started.append(process.start())
        ports[name] = (port, process.proc.pid)

    try:
        port = free_port()
        stock = [str(_venv() / "bin" / "lmcache_server"), "127.0.0.1", str(port), "cpu"]
        start(BASELINE, stock, port, {**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
        for name, yaml_text in KVGATE_SERVERS.items():
            if only and name not in only:
                continue
            folder = work / name.replace(" ", "-")
            folder.mkdir()
            config = None
            if yaml_text is not None:
                config = folder / "kvgate.yaml"
                config.write_text(yaml_text)
            port, http_port = free_port(), free_port()
            argv = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(http_port)]
            argv += ["--lm-port", str(port), "--log-level", "warning"]
            start(name, argv, port, _server_env(config, folder / "data"))
    except BaseException:
        for process in started:
            process.stop()
        raise
    return started, ports


async def _orchestrate(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    runs: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="lm-bench-") as tmp:
        processes, ports = _start_servers(Path(tmp), args.only)
        try:
            for _ in range(args.repeat):  # alternate, so that drift hits every server alike
                for name, (port, pid) in ports.items():
                    before = _cpu_seconds(pid)
                    result = await _run_client(port, args)
                    after = _cpu_seconds(pid)
                    if before is not None and after is not None:  # put + get, and the warm-up
                        moved = 2 * (args.rounds + 1) * result["bytes"] / (1 << 30)
                        result["cpu_s_per_GiB"] = (after - before) / moved
                    runs.setdefault(name, []).append(result)
        finally:
            for process in processes:
                process.stop()
    servers: dict[str, dict[str, Any]] = {}
    for name, results in runs.items():
        servers[name] = {
            "put_MiBps": statistics.median(r["put_MiBps"] for r in results),
            "get_MiBps": statistics.median(r["get_MiBps"] for r in results),
            "put_runs": [round(r["put_MiBps"], 1) for r in results],
            "get_runs": [round(r["get_MiBps"], 1) for r in results],
        }
        if all("cpu_s_per_GiB" in r for r in results):
            cpu = [r["cpu_s_per_GiB"] for r in results]
            servers[name]["cpu_s_per_GiB"] = statistics.median(cpu)
            servers[name]["cpu_runs"] = [round(c, 3) for c in cpu]
    base = servers[BASELINE]
    for figures in servers.values():
        figures["put_ratio"] = figures["put_MiBps"] / base["put_MiBps"]
        figures["get_ratio"] = figures["get_MiBps"] / base["get_MiBps"]
        if "cpu_s_per_GiB" in figures and "cpu_s_per_GiB" in base:
            figures["cpu_ratio"] = figures["cpu_s_per_GiB"] / base["cpu_s_per_GiB"]
    return {
        "size_mib": args.size_mib,
        "rounds": args.rounds,
        "repeat": args.repeat,
        "baseline": BASELINE,
        "servers": servers,
    }


def _print_table(result: dict[str, Any]) -> None:
    print(
        f"LMCache's lm:// client, {result['size_mib']} MiB chunks x {result['rounds']}, "
        f"median of {result['repeat']} (MiB/s; ratio to {result['baseline']})"
    )
    print(f"{'server':20} {'put':>8} {'ratio':>6} {'get':>8} {'ratio':>6} {'CPU s/GiB':>10}")
    for name, f in result["servers"].items():
        cpu = f"{f['cpu_s_per_GiB']:6.3f} {f['cpu_ratio']:4.2f}x" if "cpu_ratio" in f else ""
        print(
            f"{name:20} {f['put_MiBps']:8.0f} {f['put_ratio']:5.2f}x "
            f"{f['get_MiBps']:8.0f} {f['get_ratio']:5.2f}x {cpu}"
        )
    print("runs (put / get MiB/s):")
    for name, f in result["servers"].items():
        print(f"  {name:18} {f['put_runs']} / {f['get_runs']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("role", nargs="?", default="bench", choices=["bench", "client", "check"])
    parser.add_argument("--port", type=int)
    parser.add_argument("--size-mib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        choices=list(KVGATE_SERVERS),
        help="run only this kvgate server (repeatable; lmcache_server always runs)",
    )
    args = parser.parse_args()
    if args.role == "bench":
        result = asyncio.run(_orchestrate(args))
        if args.json:
            print(json.dumps(result))
        else:
            _print_table(result)
    elif args.role == "client":
        print(json.dumps(asyncio.run(_client(args.port, args.size_mib, args.rounds))))
    else:
        print(json.dumps(asyncio.run(_check(args.port, args.size_mib, args.dtype))))


if __name__ == "__main__":
    main()
