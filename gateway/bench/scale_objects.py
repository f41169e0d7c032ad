"""``kvgate bench scale``'s first curve: a disk tier's cost against the objects it holds.

For each level (10k, 100k, 1M by default) the tier is filled up to it, then reopened in a
fresh process (``scale_tier measure``): the start-up time of that reopen as after a crash (the
index is rebuilt from the files) and after a clean close (the saved index is read), the
resident bytes the index adds per object, and the p50/p99 of sampled durable puts and random
gets through a Store, and the time to list every key page by page. The fill rate of each
stretch (objects per second put through the connector, CPU per put) is a second view of
whether a put costs more as the tier grows. Levels are cumulative: one directory, filled in
stretches.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gateway.bench.scale_stats import loadavg, loglog_slope


@dataclass
class ObjectsPoint:
    objects: int
    open_s: float  # a start that scans every record (as after a crash)
    snapshot_open_s: float  # a start after a clean close: reads the saved index
    snapshot_bytes: int
    close_save_s: float  # closing the Store after the samples, which saves the index
    index_bytes_per_object: float
    rss_after_open: int
    peak_rss: int
    put_p50_ms: float
    put_p99_ms: float
    get_p50_ms: float
    get_p99_ms: float
    get_hits: int
    samples: int
    listed: int  # keys the listing returned: all of ``objects``
    list_first_page_ms: float  # reads the whole tier into the listing's snapshot
    list_page_p50_ms: float  # each later page
    list_all_s: float  # every key, 1000 a page
    fill_ops_per_s: float  # of the stretch that reached this level
    fill_cpu_us_per_op: float
    loadavg: list[float]


def _step(*args: object) -> dict[str, Any]:
    """Run one ``scale_tier`` step in a child interpreter; its JSON answer."""
    argv = [sys.executable, "-m", "gateway.bench.scale_tier", *map(str, args)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[2:])} failed: {done.stderr.strip()[-2000:]}")
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def run_objects_curve(
    root: str,
    levels: Sequence[int],
    *,
    size: int,
    samples: int,
    on_point: Callable[[ObjectsPoint], None] | None = None,
) -> list[ObjectsPoint]:
    """Fill ``root`` (an empty or missing directory) level by level and measure each level."""
    top = max(levels, default=0)
    # A capacity above everything stored: the eviction policy is kept (as the default config's
    # disk tier has one) but never evicts. Frames add their head to each object's bytes.
    capacity = 2 * top * (size + 4096) + (1 << 30)
    points: list[ObjectsPoint] = []
    filled = 0
    for level in sorted(set(levels)):
        fill = _step("fill", root, filled, level, size, capacity)
        filled = level
        load = loadavg()
        m = _step("measure", root, level, size, capacity, samples)
        point = ObjectsPoint(
            objects=level,
            open_s=m["open_s"],
            snapshot_open_s=m["snapshot_open_s"],
            snapshot_bytes=m["snapshot_bytes"],
            close_save_s=m["close_save_s"],
            index_bytes_per_object=m["index_bytes_per_object"],
            rss_after_open=m["rss_after_open"],
            peak_rss=m["peak_rss"],
            put_p50_ms=m["put_p50_ms"],
            put_p99_ms=m["put_p99_ms"],
            get_p50_ms=m["get_p50_ms"],
            get_p99_ms=m["get_p99_ms"],
            get_hits=m["get_hits"],
            samples=samples,
            listed=m["listed"],
            list_first_page_ms=m["list_first_page_ms"],
            list_page_p50_ms=m["list_page_p50_ms"],
            list_all_s=m["list_all_s"],
            fill_ops_per_s=fill["fill_ops_per_s"],
            fill_cpu_us_per_op=fill["fill_cpu_us_per_op"],
            loadavg=load,
        )
        points.append(point)
        if on_point is not None:
            on_point(point)
    return points


def objects_slopes(points: Sequence[ObjectsPoint]) -> dict[str, float | None]:
    """Each measure's growth exponent against the object count (see ``loglog_slope``)."""
    xs = [float(p.objects) for p in points]
    names = (
        "open_s",
        "snapshot_open_s",
        "rss_after_open",
        "put_p50_ms",
        "put_p99_ms",
        "get_p50_ms",
        "get_p99_ms",
        "list_first_page_ms",
        "list_page_p50_ms",
        "list_all_s",
    )
    slopes = {name: loglog_slope(xs, [float(getattr(p, name)) for p in points]) for name in names}
    # Index bytes: the RSS the index adds, whose slope says whether bytes per object stay flat.
    index = [p.index_bytes_per_object * p.objects for p in points]
    slopes["index_bytes"] = loglog_slope(xs, index)
    slopes["fill_cpu_us_per_op"] = loglog_slope(xs, [p.fill_cpu_us_per_op for p in points])
    return slopes


def objects_report(points: Sequence[ObjectsPoint], started: float) -> dict[str, Any]:
    return {
        "points": [asdict(p) for p in points],
        "slopes": objects_slopes(points),
        "seconds": time.perf_counter() - started,
    }
