"""``kvgate bench lookup``: how long ``Store.lookup`` takes against the prefix length, per tier
stack, next to the raw client's existence check of the same keys in the same run.

For each stack and each prefix length N, N small objects are written through a Store and then
removed from every tier but the stack's last (the memory tier included, unless it is the only
one): every key is answered by the deepest tier, the case a scheduler meets when the memory
tier has evicted a long context. Each round times one ``lookup`` of the N keys, then the
baseline on the same keys; rounds alternate, so both sides see the same load. p50 and p99 are
over the rounds; the ratio is kvgate's p50 over the baseline's.

The baselines, one per scheme of the deepest tier (Redis, Valkey, memcached, S3 on aioboto3
or obstore, the disk tier, the memory tier alone), are in ``gateway.bench.lookup_baselines``.
``tier_options`` are connector options of each stack's last tier (an S3 stack's endpoint and
credentials).
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.bench.lookup_baselines import LookupBaseline, Timed
from gateway.store import Store

DEFAULT_LENGTHS = (16, 64, 256, 1024, 4096)
DEFAULT_STACKS = ("memory", "memory,file", "memory,redis", "memory,file,redis")
VALUE = b"k" * 64  # the objects' payload: lookup never reads it


@dataclass
class LookupPoint:
    """One stack at one prefix length."""

    stack: str
    length: int
    p50_ms: float
    p99_ms: float
    baseline: str | None = None
    baseline_p50_ms: float | None = None
    baseline_p99_ms: float | None = None
    floor: str | None = None
    floor_p50_ms: float | None = None
    rounds: int = 0

    @property
    def ratio(self) -> float | None:
        """kvgate's p50 over the baseline's: 1.0 is as fast, 2.0 twice as slow."""
        if self.baseline_p50_ms is None or self.baseline_p50_ms <= 0:
            return None
        return self.p50_ms / self.baseline_p50_ms

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ratio": self.ratio}


@dataclass
class Servers:
    """What ``redis`` and ``file`` in a stack stand for, and what to clean up after."""

    redis_url: str | None = None
    root: str = ""
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)


def parse_stack(text: str) -> list[str]:
    """``memory,file,redis`` (names) or URLs, comma-separated, in tier order."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"empty tier stack {text!r}")
    return items


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_redis(directory: str) -> tuple[str, subprocess.Popen[bytes]]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not on PATH: give --redis URL (or leave redis out)")
    port = _free_port()
    argv = [binary, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", directory]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return f"redis://127.0.0.1:{port}/0", proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start within 10 s")


@contextmanager
def servers(stacks: Sequence[Sequence[str]], redis_url: str | None) -> Iterator[Servers]:
    """A temp directory for ``file`` tiers and, when a stack names ``redis`` and no URL was
    given, a redis-server of our own (no persistence), stopped at the end."""
    with ExitStack() as stack:
        root = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-bench-lookup-"))
        found = Servers(redis_url=redis_url, root=root)
        if redis_url is None and any("redis" in s for s in stacks):
            found.redis_url, proc = _start_redis(root)
            found.started.append(proc)
        try:
            yield found
        finally:
            for proc in found.started:
                proc.terminate()
                proc.wait(10)


def tier_urls(
    stack: Sequence[str], where: Servers, run: str, last_options: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    tiers: list[dict[str, Any]] = []
    for i, item in enumerate(stack):
        if item == "memory":
            tiers.append({"url": "memory://", "capacity": "256MiB"})
        elif item == "file":
            tiers.append({"url": f"file://{where.root}/{run}-{i}"})
        elif item == "redis":
            assert where.redis_url is not None
            tiers.append({"url": where.redis_url})
        else:
            tiers.append({"url": item})
    if last_options and tiers:
        tiers[-1]["options"] = dict(last_options)
    return tiers


async def _alternating(calls: Sequence[Timed], rounds: int) -> list[list[float]]:
    """Seconds per call of each of ``calls``, in rounds that call each once in turn (after
    two warm-up rounds), so that all see the same load."""
    samples: list[list[float]] = [[] for _ in calls]
    for r in range(rounds + 2):
        for call, out in zip(calls, samples, strict=True):
            t = time.perf_counter()
            await call()
            took = time.perf_counter() - t
            if r >= 2:
                out.append(took)
    return samples


def _p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1e3


async def measure_stack(
    stack: Sequence[str],
    where: Servers,
    lengths: Sequence[int],
    rounds: int,
    progress: Callable[[int], None] = lambda n: None,
    tier_options: Mapping[str, Any] | None = None,
) -> list[LookupPoint]:
    """Every prefix length on one tier stack (module docs)."""
    run = uuid.uuid4().hex[:8]
    cfg = {"tiers": tier_urls(stack, where, run, tier_options), "prefault": False}
    name = "+".join(stack)
    points: list[LookupPoint] = []
    async with Store(cfg) as store:
        for n in lengths:
            keys = [f"bench-lookup/{run}/{n}/{i}" for i in range(n)]
            await _place_in_deepest(store, keys)
            found = await store.lookup(keys)
            if found != n:
                raise RuntimeError(f"{name}: lookup found {found} of {n} keys placed")
            base = LookupBaseline(store, keys)
            calls: list[Timed] = [functools.partial(store.lookup, keys)]
            calls += [c for c in (base.run, base.floor) if c is not None]
            try:
                ours, *others = await _alternating(calls, rounds)
            finally:
                await base.close()
            theirs = others[0] if base.run is not None else []
            floor = others[1] if base.floor is not None else []
            points.append(
                LookupPoint(
                    stack=name,
                    length=n,
                    p50_ms=_p(ours, 0.5),
                    p99_ms=_p(ours, 0.99),
                    baseline=base.name,
                    baseline_p50_ms=_p(theirs, 0.5) if theirs else None,
                    baseline_p99_ms=_p(theirs, 0.99) if theirs else None,
                    floor=base.floor_name,
                    floor_p50_ms=_p(floor, 0.5) if floor else None,
                    rounds=rounds,
                )
            )
            for key in keys:
                await store.delete(key)
            progress(1)
    return points


async def _place_in_deepest(store: Store, keys: list[str]) -> None:
    """Write ``keys`` through the store, then leave them in the deepest tier only."""
    for key in keys:
        await store.put(key, VALUE)
    await store.flush()
    if not store.tiers:
        return  # the memory tier is the stack
    if store.l1 is not None:
        for key in keys:
            store.l1.remove(key)
    for tier in store.tiers[:-1]:
        for key in keys:
            await tier.delete(key)


async def run_lookup_bench(
    stacks: Sequence[Sequence[str]],
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    rounds: int = 50,
    redis_url: str | None = None,
    progress: Callable[[int], None] = lambda n: None,
    tier_options: Mapping[str, Any] | None = None,
) -> list[LookupPoint]:
    # Starting redis-server polls with time.sleep, and stopping it waits for the process:
    # both in a worker thread, never on this loop.
    opened = servers(stacks, redis_url)
    where = await asyncio.to_thread(opened.__enter__)
    try:
        points: list[LookupPoint] = []
        for stack in stacks:
            points += await measure_stack(stack, where, lengths, rounds, progress, tier_options)
        return points
    finally:
        await asyncio.to_thread(opened.__exit__, None, None, None)


def summary(points: Sequence[LookupPoint]) -> dict[str, Any]:
    """The JSON form: every point, and the load average while it ran (read ratios)."""
    return {
        "points": [p.as_dict() for p in points],
        "loadavg": list(os.getloadavg()),
        "median_ratio": statistics.median([p.ratio for p in points if p.ratio is not None])
        if any(p.ratio is not None for p in points)
        else None,
    }
