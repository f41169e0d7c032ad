"""The disk effects behind ``kvgate bench``'s file-tier method and file://'s defaults.

Run with kvgate's python::

    .venv/bin/python benchmarks/disk_effects.py [--dir /tmp/kvgate-effects] [--rounds 6]

Each experiment alternates its variants round by round (the disk here swings between about
0.6 and 2.2 GB/s from one round to the next, so only many alternated rounds compare them) and
prints every round and the median. With 14 rounds here the differences were within that noise:
sources 1.86 (one buffer) against 1.69 (eight), fsync_dir 1.07 (false) against 0.94 (true).
32 files or objects of 32 MiB, 4 writing threads, the disk synced between variants.

- ``sources``: raw write+fsync from one 32 MiB buffer written again and again, against eight
  distinct buffers (what the store writes from: pool slabs; what an engine puts: distinct
  chunks).
- ``fsync_dir``: 32 puts through a Store on ``file://`` with ``fsync_dir`` false (the default)
  and true (a directory fsync, one more journal commit, after every rename).
- ``deletes``: raw write+fsync right after deleting the previous round's files, against the
  same after ``os.sync()`` (why the bench syncs before each phase).
- ``warm_memory``: raw write+fsync after 2.5 s idle, as is and with memory
  (1.2 GiB touched and freed) first, and the same files written with O_DIRECT, which takes
  no page cache (why the bench warms free memory before each write phase: on this VM, memory
  left free for a second or two goes back to the host, and the page cache pays to fault it
  in again). Here, 6 rounds: medians 0.92 GB/s as is, 1.87 warmed, 1.98 O_DIRECT.
- ``warm_sizes``: the same after 0, 0.75, 1, 1.5 and 2 times the written bytes were touched
  and freed (how much the bench should warm). Here, 4 rounds: medians 1.10, 1.23, 1.79, 1.87
  and 1.85 GB/s; the slowest round was 1.33 with 1x, 1.68 with 1.5x. Warming less than the
  phase writes clearly loses; above 1x the differences are within the noise of 4 rounds, and
  the bench warms 1.5x as a margin.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import mmap
import os
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from gateway.bench.disk_baseline import write_fsynced
from gateway.store import Store

MiB = 1 << 20
SIZE = 32 * MiB
COUNT = 32
WRITERS = 4


def _write_files(directory: Path, source: Callable[[int], np.ndarray[Any, Any]]) -> float:
    """GB/s of COUNT files written and fsynced by WRITERS threads; the files stay."""
    directory.mkdir(parents=True, exist_ok=True)

    def write(i: int) -> None:
        write_fsynced(directory / f"f{i}", source(i).data)

    start = time.perf_counter()
    with ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(write, range(COUNT)))
    return SIZE * COUNT / (time.perf_counter() - start) / 1e9


def _clear(directory: Path, *, sync: bool = True) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    if sync:
        os.sync()


def sources(root: Path) -> dict[str, float]:
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, (8, SIZE), dtype=np.uint8)
    one = rows[0]
    out = {}
    for name, pick in (("one buffer", lambda i: one), ("eight buffers", lambda i: rows[i % 8])):
        out[name] = _write_files(root / "sources", pick)
        _clear(root / "sources")
    return out


async def _store_puts(root: Path, fsync_dir: bool) -> float:
    rows = np.random.default_rng(1).integers(0, 256, (8, SIZE), dtype=np.uint8)
    tier = {"url": root.as_uri(), "workers": WRITERS, "options": {"fsync_dir": fsync_dir}}
    async with Store({"tiers": [tier], "staging": 256 * MiB}) as store:
        await store.put("warm-up", rows[0])
        await store.flush()
        start = time.perf_counter()
        for i in range(COUNT):
            await store.put(f"k{i}", rows[i % 8])
        await store.flush()
        return SIZE * COUNT / (time.perf_counter() - start) / 1e9


def fsync_dir(root: Path) -> dict[str, float]:
    out = {}
    for flag in (False, True):
        out[f"fsync_dir={str(flag).lower()}"] = asyncio.run(_store_puts(root / "store", flag))
        _clear(root / "store")
    return out


def deletes(root: Path) -> dict[str, float]:
    rows = np.random.default_rng(2).integers(0, 256, (8, SIZE), dtype=np.uint8)
    out = {}
    for name, sync in (("right after deletes", False), ("after os.sync()", True)):
        _write_files(root / "previous", lambda i: rows[i % 8])
        _clear(root / "previous", sync=sync)
        out[name] = _write_files(root / "deletes", lambda i: rows[i % 8])
        _clear(root / "deletes")
    return out


def _write_direct(directory: Path, rows: np.ndarray[Any, Any]) -> float:
    """GB/s of COUNT files written with O_DIRECT (page-aligned rows, no page cache) and fsynced."""
    directory.mkdir(parents=True, exist_ok=True)

    def write(i: int) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT
        fd = os.open(directory / f"f{i}", flags, 0o600)
        try:
            view = rows[i % len(rows)].data
            while view.nbytes:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    start = time.perf_counter()
    with ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(write, range(COUNT)))
    return SIZE * COUNT / (time.perf_counter() - start) / 1e9


def warm_memory(root: Path) -> dict[str, float]:
    # mmap gives page-aligned rows, as O_DIRECT needs
    arena = mmap.mmap(-1, 8 * SIZE)
    rows = np.frombuffer(arena, dtype=np.uint8).reshape(8, SIZE)
    rows[:] = np.random.default_rng(3).integers(0, 256, (8, SIZE), dtype=np.uint8)
    out: dict[str, float] = {}
    for name in ("after idle", "warmed", "O_DIRECT"):
        time.sleep(2.5)  # long enough for this VM to hand free memory back to the host
        if name == "warmed":
            np.ones(1200 * MiB, dtype=np.uint8)  # touched and freed on return
        if name == "O_DIRECT":
            out[name] = _write_direct(root / "warm", rows)
        else:
            out[name] = _write_files(root / "warm", functools.partial(_row, rows))
        _clear(root / "warm")
    del rows  # the mmap closes only once no array views it
    arena.close()
    return out


_WARM_ROUNDS = itertools.count()


def warm_sizes(root: Path) -> dict[str, float]:
    """Raw write+fsync of COUNT files after 2.5 s idle, with nothing or 0.75, 1, 1.5 or 2
    times the bytes written touched and freed just before (in turn, reversed every round)."""
    rows = np.random.default_rng(4).integers(0, 256, (8, SIZE), dtype=np.uint8)
    factors = (0.0, 0.75, 1.0, 1.5, 2.0)
    out: dict[str, float] = {}
    order = factors if next(_WARM_ROUNDS) % 2 == 0 else factors[::-1]
    for factor in order:
        time.sleep(2.5)
        os.sync()
        if factor:
            np.ones(int(SIZE * COUNT * factor), dtype=np.uint8)  # touched, freed on return
        out[f"warm {factor:g}x"] = _write_files(root / "warm", functools.partial(_row, rows))
        _clear(root / "warm")
    return {f"warm {f:g}x": out[f"warm {f:g}x"] for f in factors}


def _row(rows: np.ndarray[Any, Any], i: int) -> np.ndarray[Any, Any]:
    row: np.ndarray[Any, Any] = rows[i % len(rows)]
    return row


EXPERIMENTS = {
    "sources": sources,
    "fsync_dir": fsync_dir,
    "deletes": deletes,
    "warm_memory": warm_memory,
    "warm_sizes": warm_sizes,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/kvgate-effects"))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--only", choices=sorted(EXPERIMENTS), action="append")
    args = parser.parse_args()
    root: Path = args.dir
    for name in args.only or list(EXPERIMENTS):
        rounds: dict[str, list[float]] = {}
        _clear(root)
        for _ in range(args.rounds):
            for variant, gbps in EXPERIMENTS[name](root).items():
                rounds.setdefault(variant, []).append(gbps)
        print(f"{name} (GB/s, {COUNT} x {SIZE // MiB} MiB, {WRITERS} writers):")
        for variant, values in rounds.items():
            runs = " ".join(f"{v:.2f}" for v in values)
            print(f"  {variant:22s} median {statistics.median(values):.2f}   runs {runs}")
    _clear(root)


if __name__ == "__main__":
    main()
