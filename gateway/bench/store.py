"""``kvgate bench``: put then get N objects through a Store, next to a same-run baseline.

The baseline is measured in the same process on the same bytes, so the ratio means something
on a noisy machine: memcpy into preallocated buffers for memory tiers, raw write+fsync and
read of the same number of same-sized files for file tiers, written with as many threads as
the tier has write workers and read with the bench's concurrency. ``cold`` evicts both sides'
files from the page cache before the reads, so that they measure the disk. Both sides read
their input from the same distinct objects (``bench_sources``) and write into destinations
that rotate over hundreds of MiB, so neither is served from the CPU cache where the other is
not.

For a remote tier whose connector class offers ``raw_client_baseline`` (Redis, S3, ...), the
baseline is that connector's plain client library doing the same puts and gets one call per
object, against the same server in the same run ("client").

``get`` from the memory tier returns a zero-copy view of the cached object, so its throughput
is not a copy rate; ``get_copy_gbps`` is get plus a copy into a preallocated destination
(what an engine does when it loads the chunk into its own KV buffer), the figure to compare
with memcpy.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import numpy as np

from gateway.bench.disk_baseline import (
    disk_baseline,
    drop_page_cache,
    settle_disk,
    warm_free_memory,
)
from gateway.config import redact_url
from gateway.errors import GatewayError
from gateway.objects import HAS_TORCH
from gateway.registry import connector_class, scheme_of
from gateway.store import Store, is_l1_url

Progress = Callable[[int], None]


@dataclass
class BenchResult:
    tiers: list[str]
    size: int
    count: int
    concurrency: int
    baseline: str
    cold: bool = False
    get_zero_copy: bool = False
    write_policy: str = "back"
    put_gbps: float = 0.0
    get_gbps: float = 0.0
    get_copy_gbps: float = 0.0
    baseline_put_gbps: float = 0.0
    baseline_get_gbps: float = 0.0
    put_ratio: float = 0.0
    get_ratio: float = 0.0
    get_copy_ratio: float = 0.0
    put_ops_per_s: float = 0.0
    get_ops_per_s: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    put_p50_ms: float = 0.0
    put_p99_ms: float = 0.0
    get_hits: int = 0
    put_runs: list[float] = field(default_factory=list)  # GB/s of each run (--repeat)
    get_runs: list[float] = field(default_factory=list)
    get_copy_runs: list[float] = field(default_factory=list)
    baseline_put_runs: list[float] = field(default_factory=list)
    baseline_get_runs: list[float] = field(default_factory=list)
    errors: dict[str, dict[str, int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pct(samples: list[float], q: float) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0


SOURCE_SPREAD = 256 << 20  # the puts' objects (and the baselines' sources) span this much


def bench_sources(size: int, count: int, concurrency: int) -> np.ndarray[Any, Any]:
    """The bytes the bench puts: distinct random objects spanning SOURCE_SPREAD (or ``count``
    of them), as an engine's KV chunks are distinct memory. Put i stores row ``i % rows``;
    the baselines write and copy the same rows, so both sides read their input from the same
    kind of memory. (One object put again and again partly stays in the CPU cache: memcpy of
    32 MiB ran at 18.3 GB/s from one source and 16.7 from eight, median of 5 here.)"""
    rows = min(count, max(concurrency, 4, SOURCE_SPREAD // max(size, 1)))
    return np.random.default_rng(0).integers(0, 256, (rows, size), dtype=np.uint8)


def _as_kind(raw: np.ndarray[Any, Any], kind: str) -> object:
    if kind == "bytes":
        return raw.tobytes()
    if kind == "ndarray" or not HAS_TORCH:
        return raw
    import torch

    t = torch.from_numpy(raw)
    return t.view(torch.bfloat16) if raw.nbytes % 2 == 0 else t


async def _run_ops(
    n: int, concurrency: int, op: Callable[[int], Awaitable[None]], progress: Progress | None
) -> tuple[float, list[float]]:
    """Run op(0..n-1) with ``concurrency`` workers; (elapsed seconds, per-op latencies)."""
    latencies: list[float] = []
    next_i = 0

    async def worker() -> None:
        nonlocal next_i
        while next_i < n:
            i = next_i
            next_i += 1
            t0 = time.perf_counter()
            await op(i)
            latencies.append(time.perf_counter() - t0)
            if progress is not None:
                progress(1)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    return time.perf_counter() - start, latencies


def copy_slots(size: int, count: int, threads: int) -> int:
    """How many destinations a copy rotates over: at least 512 MiB of them, or ``count``."""
    return min(count, max(threads, (512 << 20) // max(size, 1)))


def memcpy_baseline(sources: np.ndarray[Any, Any], count: int, threads: int = 1) -> float:
    """memcpy of ``count`` objects (rows of ``sources``, in turn) into preallocated, faulted-in
    destinations, as the store's puts copy them into its pool.

    The destinations rotate over at least 512 MiB (or all ``count`` of them), so the copy is
    not served from the CPU cache when the store's copies are not. ``threads`` copies run at
    once (numpy releases the GIL), as the store's puts do at that concurrency.
    """
    size = int(sources.shape[1])
    slots = copy_slots(size, count, threads)
    dst = np.ones((slots, size), dtype=np.uint8)  # ones(): every page touched up front

    def copy(i: int) -> None:
        np.copyto(dst[i % slots], sources[i % len(sources)])

    start = time.perf_counter()
    if threads <= 1:
        for i in range(count):
            copy(i)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(copy, range(count)))
    return size * count / (time.perf_counter() - start) / 1e9


def _file_root(tiers: Sequence[str]) -> Path | None:
    for url in tiers:
        if scheme_of(url) == "file":
            return Path(urlsplit(url).path)
    return None


async def run_bench(
    tiers: Sequence[str],
    *,
    size: int,
    count: int,
    concurrency: int = 1,
    kind: str = "tensor",
    capacity: int | None = None,
    baseline: str = "auto",
    cold: bool = False,
    write_policy: str = "back",
    progress: Progress | None = None,
    tier_options: Mapping[str, Any] | None = None,
) -> BenchResult:
    """Put ``count`` objects of ``size`` bytes through a Store on ``tiers``, then get them.

    ``tier_options`` are the connector options of the last tier (the one under test).
    ``write_policy``: the Store's (``through``: every put returns once every tier holds it).
    """
    root = _file_root(tiers)
    tier_cfgs: list[dict[str, Any]] = []
    writers = 4
    for url in tiers:
        cfg: dict[str, Any] = {
            "url": url,
            "queue_size": max(64, concurrency * 2),
            "workers": writers,
        }
        if scheme_of(url) == "memory":
            cfg["capacity"] = capacity or int(size * count * 1.1) + (64 << 20)
        tier_cfgs.append(cfg)
    if tier_options and tier_cfgs:
        tier_cfgs[-1]["options"] = dict(tier_options)
    client = _client_baseline(tiers[-1], tier_options or {}) if tiers else None
    staging = max(256 << 20, size * (concurrency + 2) * 2)
    # Each direction is compared with what limits it: a put is done when the lowest tier has
    # it (disk when there is a file tier); a get is served by the memory tier when there is
    # one (memcpy), else by the file tier (disk reads).
    served_by_l1 = bool(tiers) and is_l1_url(tiers[0])
    if baseline == "auto":
        lowest = "disk" if root is not None else "client" if client is not None else "memcpy"
        put_base = lowest
        get_base = "memcpy" if served_by_l1 else lowest
    else:
        put_base = get_base = baseline
    baseline = put_base if put_base == get_base else f"{put_base}/{get_base}"
    # A file tier with direct_io bypasses the page cache; so does the disk baseline then.
    direct = bool(
        root is not None
        and tiers
        and scheme_of(tiers[-1]) == "file"
        and (tier_options or {}).get("direct_io")
    )
    if direct:
        baseline = baseline.replace("disk", "disk-direct")
    sources = bench_sources(size, count, concurrency)
    # The baseline puts with as many in flight as the Store's puts have: the tier's write
    # workers under write-back, but under write-through each put holds one of the bench's
    # ``concurrency`` callers until every tier has it (4 against 1 made 1 MiB S3 puts look
    # half as fast as the client).
    put_parallelism = concurrency if write_policy == "through" else writers
    objs = [_as_kind(row, kind) for row in sources]
    # With bytes objects, the Store's objects are what a client baseline sends: no copy.
    payloads = [o for o in objs if isinstance(o, bytes)] if kind == "bytes" else None
    measure = _Baselines(
        put_base,
        get_base,
        root,
        sources,
        count,
        put_parallelism,
        concurrency,
        cold,
        client,
        direct,
        payloads,
    )
    if root is not None:
        await asyncio.to_thread(settle_disk)  # start from a clean disk, like every phase after
    before = await measure()
    run_id = os.urandom(4).hex()  # fresh keys per run: a repeat measures puts, not overwrites
    keys = [f"bench/{run_id}/{size}/{i}" for i in range(count)]
    result = BenchResult(
        [redact_url(t) for t in tiers],
        size,
        count,
        concurrency,
        baseline,
        cold=cold,
        get_zero_copy=served_by_l1,
        write_policy=write_policy,
    )
    # get+copy copies into destinations that rotate like memcpy_baseline's, so that neither
    # side writes into one buffer that stays in the CPU cache.
    dest = np.ones((copy_slots(size, count, concurrency), size), dtype=np.uint8)
    hits = 0

    store_cfg = {"tiers": tier_cfgs, "staging": staging, "write_policy": write_policy}
    async with Store(store_cfg) as store:
        # One untimed round trip first: opening connectors (the disk tier scans its
        # directory), starting worker threads and first calls are not what a put costs.
        warm_key = f"bench/{run_id}/warm-up"
        await _warm_up(store, warm_key, objs[0])
        if root is not None:
            await asyncio.to_thread(settle_disk)
            await asyncio.to_thread(warm_free_memory, size * count)  # as the baseline does

        async def put(i: int) -> None:
            await store.put(keys[i], objs[i % len(objs)])

        put_elapsed, put_lat = await _run_ops(count, concurrency, put, progress)
        t0 = time.perf_counter()
        await store.flush()  # puts count as done when the lowest tier has them
        put_elapsed += time.perf_counter() - t0
        if cold and root is not None:  # reads must come from the disk, not the page cache
            drop_page_cache(p for p in root.rglob("*.kvo") if p.is_file())

        async def get(i: int) -> None:
            nonlocal hits
            if await store.get(keys[i]) is not None:
                hits += 1

        get_elapsed, get_lat = await _run_ops(count, concurrency, get, progress)

        async def get_copy(i: int) -> None:
            got = await store.get(keys[i])
            if got is not None:
                np.copyto(dest[i % len(dest)], _as_uint8(got))

        if cold and root is not None:
            drop_page_cache(p for p in root.rglob("*.kvo") if p.is_file())
        copy_elapsed, _ = await _run_ops(count, concurrency, get_copy, progress)
        # The bench's objects are not the user's: leave the tiers as they were. A tier that
        # failed during the run may fail these too (a delete raises then): its failures are
        # in ``errors`` below, and the measurement is kept.
        await asyncio.gather(*(store.delete(k) for k in [warm_key, *keys]), return_exceptions=True)
        result.errors = {n: dict(s.errors) for n, s in store.stats().items() if s.errors}
    if root is not None:
        await asyncio.to_thread(settle_disk)

    total = size * count
    result.put_gbps = total / put_elapsed / 1e9
    result.get_gbps = total / get_elapsed / 1e9
    result.get_copy_gbps = total / copy_elapsed / 1e9
    result.put_ops_per_s = count / put_elapsed
    result.get_ops_per_s = count / get_elapsed
    result.p50_ms, result.p99_ms = _pct(get_lat, 0.5), _pct(get_lat, 0.99)
    result.put_p50_ms, result.put_p99_ms = _pct(put_lat, 0.5), _pct(put_lat, 0.99)
    result.get_hits = hits

    result.put_runs = [result.put_gbps]
    result.get_runs = [result.get_gbps]
    result.get_copy_runs = [result.get_copy_gbps]

    # The baseline runs before and after the store (above and below) and their mean counts:
    # bracketing cancels a drift in disk speed. (The better of the two, used before, biased
    # ratios low on a disk that flips between two speeds: a max of two samples against one.)
    # Both runs are in the result, so a reader can see the spread.
    after = await measure()
    result.baseline_put_runs = [before[0], after[0]]
    result.baseline_get_runs = [before[1], after[1]]
    result.baseline_put_gbps = (before[0] + after[0]) / 2
    result.baseline_get_gbps = (before[1] + after[1]) / 2
    _set_ratios(result)
    return result


def _set_ratios(result: BenchResult) -> None:
    if result.baseline_put_gbps:
        result.put_ratio = result.put_gbps / result.baseline_put_gbps
    if result.baseline_get_gbps:
        # A zero-copy get moves no bytes: its "ratio" to a copy would mean nothing.
        zero_copy = result.get_zero_copy
        result.get_ratio = 0.0 if zero_copy else result.get_gbps / result.baseline_get_gbps
        result.get_copy_ratio = result.get_copy_gbps / result.baseline_get_gbps


def combine_runs(runs: Sequence[BenchResult]) -> BenchResult:
    """One result for ``--repeat`` runs: every rate, ops/s and latency is the median of the
    runs' figures (a baseline's, of all its before and after runs) and every ratio is the
    quotient of two such medians.

    Why medians of each side and not the median of the runs' ratios: on this kind of machine
    one phase's speed is bimodal. Buffered writes of 1 GiB ran at either ~1 or ~2 GB/s from one
    phase to the next (the guest's page cache takes pages the host has reclaimed through free
    page reporting, and faulting them back costs as much as the disk; see warm_free_memory).
    A single run's ratio is then a ratio of two coin flips, 0.5, 1 or 2 whatever kvgate does;
    the median of each side over several runs is that side's typical speed. Every run's
    figures are kept (``put_runs``, ``baseline_put_runs``, ...), so a reader can see the spread.
    """
    if not runs:
        raise ValueError("combine_runs needs at least one run")
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    out = BenchResult(
        first.tiers,
        first.size,
        first.count,
        first.concurrency,
        first.baseline,
        cold=first.cold,
        get_zero_copy=first.get_zero_copy,
        write_policy=first.write_policy,
    )
    for rate in ("put", "get", "get_copy", "baseline_put", "baseline_get"):
        every = [g for r in runs for g in getattr(r, f"{rate}_runs")]
        setattr(out, f"{rate}_runs", every)
        setattr(out, f"{rate}_gbps", statistics.median(every))
    for name in ("put_ops_per_s", "get_ops_per_s", "p50_ms", "p99_ms", "put_p50_ms", "put_p99_ms"):
        setattr(out, name, statistics.median(getattr(r, name) for r in runs))
    out.get_hits = min(r.get_hits for r in runs)  # a run with misses must show
    for r in runs:
        for tier, kinds in r.errors.items():
            counts = out.errors.setdefault(tier, {})
            for kind, n in kinds.items():
                counts[kind] = counts.get(kind, 0) + n
    _set_ratios(out)
    return out


async def _warm_up(store: Store, key: str, obj: object) -> None:
    """Put, flush and get ``key`` (deleted with the bench's keys at the end: a delete right
    after a get waits out the read's lease on some backends, Mooncake's 2-10 s, and after
    such an idle spell the first puts ran 2-3x slower there)."""
    await store.put(key, obj)
    await store.flush()
    await store.get(key)


@dataclass
class _Baselines:
    """Measures (put GB/s, get GB/s) of the chosen baselines for one bench run."""

    put_kind: str
    get_kind: str
    root: Path | None
    sources: np.ndarray[Any, Any]
    count: int
    writers: int  # puts in flight: the tier's write workers, or the bench's callers (through)
    readers: int
    cold: bool
    client: ClientBaseline | None
    direct: bool = False

    # The sources as ``bytes`` (which every client library takes), when the bench has them;
    # else a client measurement makes them and drops them after.
    payloads: list[bytes] | None = None

    @property
    def size(self) -> int:
        return int(self.sources.shape[1])

    async def __call__(self) -> tuple[float, float]:
        rates: dict[str, tuple[float, float]] = {}
        for kind in {self.put_kind, self.get_kind}:
            rates[kind] = await self._measure(kind)
        return rates[self.put_kind][0], rates[self.get_kind][1]

    async def _measure(self, kind: str) -> tuple[float, float]:
        if kind == "client":
            if self.client is None:
                raise ValueError("the client baseline needs a tier whose connector offers one")
            # Like the disk baseline: puts with the Store's put parallelism (``writers``),
            # gets with the bench's concurrency.
            # Put i sends row i % rows of the sources, as the Store's put i does, not one
            # object again and again (which a 1 MiB put sends from the CPU cache).
            payloads: Sequence[bytes]
            if self.payloads is not None:
                payloads = self.payloads
            else:  # 256 MiB or more: made off the loop, kept only meanwhile
                payloads = await asyncio.to_thread(_rows_as_bytes, self.sources)
            run = functools.partial(
                self.client, size=self.size, count=self.count, payloads=payloads
            )
            got = await run(concurrency=self.readers)
            if self.writers == self.readers:
                return got
            put = await run(concurrency=self.writers)
            return put[0], got[1]
        if kind == "memcpy":
            rate = memcpy_baseline(self.sources, self.count, self.readers)
            return rate, rate
        if kind == "disk":
            if self.root is None:
                raise ValueError("the disk baseline needs a file:// tier")
            self.root.parent.mkdir(parents=True, exist_ok=True)
            bdir = Path(tempfile.mkdtemp(prefix="kvgate-baseline-", dir=self.root.parent))
            try:
                return disk_baseline(
                    bdir,
                    self.sources,
                    self.count,
                    writers=self.writers,
                    readers=self.readers,
                    cold=self.cold,
                    direct=self.direct,
                )
            finally:
                shutil.rmtree(bdir, ignore_errors=True)
        return 0.0, 0.0


def _rows_as_bytes(rows: np.ndarray[Any, Any]) -> list[bytes]:
    return [row.tobytes() for row in rows]


class ClientBaseline(Protocol):
    """A connector's plain client library doing the bench's work: (put GB/s, get GB/s)."""

    def __call__(
        self, *, size: int, count: int, concurrency: int, payloads: Sequence[bytes]
    ) -> Awaitable[tuple[float, float]]: ...


def _client_baseline(url: str, options: Mapping[str, Any]) -> ClientBaseline | None:
    """The tier's ``raw_client_baseline`` bound to its URL and options, if its class has one."""
    try:
        cls = connector_class(scheme_of(url))
    except GatewayError:
        return None  # an unknown scheme fails later, with the Store's own message
    raw = getattr(cls, "raw_client_baseline", None)
    if raw is None:
        return None
    if _takes_payloads(raw):
        return functools.partial(raw, url, options)

    # A plugin written before baselines were handed the bench's objects puts its own.
    async def without_payloads(
        *, size: int, count: int, concurrency: int, payloads: Sequence[bytes]
    ) -> tuple[float, float]:
        rates: tuple[float, float] = await raw(
            url, options, size=size, count=count, concurrency=concurrency
        )
        return rates

    return without_payloads


def _takes_payloads(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "payloads" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _as_uint8(obj: object) -> np.ndarray[Any, Any]:
    if isinstance(obj, np.ndarray):
        return obj.reshape(-1).view(np.uint8)
    if isinstance(obj, bytes | bytearray | memoryview):
        return np.frombuffer(obj, dtype=np.uint8)
    import torch

    assert isinstance(obj, torch.Tensor)
    return obj.reshape(-1).view(torch.uint8).numpy()
