"""``kvgate bench scale``: how cost grows with the objects a disk tier holds and with the
concurrent clients of ``kvgate serve`` (the measures: gateway/bench/scale_*.py)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console
from rich.table import Table

from gateway.bench.scale_clients import clients_slopes, run_clients_curve
from gateway.bench.scale_objects import ObjectsPoint, objects_report, run_objects_curve
from gateway.bench.scale_stats import loadavg
from gateway.config import parse_size

err = Console(stderr=True)
CurveChoice = Literal["all", "objects", "clients"]


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(parse_size(part.strip())) for part in text.split(",") if part.strip()]
    except (ValueError, TypeError) as exc:
        raise typer.BadParameter(str(exc), param_hint=what) from None
    if not values or min(values) < 1:
        raise typer.BadParameter("a comma-separated list of positive numbers", param_hint=what)
    return values


def bench_scale(
    curve: Annotated[CurveChoice, typer.Option(help="which curves to measure")] = "all",
    objects: Annotated[
        str, typer.Option(help="object counts of the disk-tier curve, e.g. 10000,100000,1000000")
    ] = "10000,100000,1000000",
    object_size: Annotated[str, typer.Option(help="bytes per stored object")] = "4KiB",
    samples: Annotated[
        int, typer.Option(min=1, help="timed puts and gets per object count")
    ] = 1000,
    directory: Annotated[
        Path | None,
        typer.Option(
            "--dir", help="an empty directory to fill (default: a temporary one, removed after)"
        ),
    ] = None,
    clients: Annotated[
        str, typer.Option(help="concurrent HTTP clients of the serve curve")
    ] = "1,2,4,8,16,32,64",
    sizes: Annotated[str, typer.Option(help="object sizes of the serve curve")] = "4KiB,1MiB",
    duration: Annotated[
        float, typer.Option(min=0.01, help="seconds of puts, then of gets, per client count")
    ] = 3.0,
    serve_memory: Annotated[
        str, typer.Option(help="the served store's memory tier (the disk tier is below it)")
    ] = "1GiB",
    plot: Annotated[Path | None, typer.Option(help="write the curves to this PNG")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
) -> None:
    """How cost grows: a disk tier's start-up, index memory and put/get latency against the
    objects it holds; kvgate serve's throughput and latency against concurrent clients.

    Each curve comes with its growth exponent (slope on log-log axes: 0 flat, 1 linear).
    """
    if plot is not None:
        try:
            import matplotlib  # noqa: F401 - fail before measuring, not after
        except ModuleNotFoundError:
            err.print("--plot needs matplotlib: pip install 'kvgate[bench]'")
            raise typer.Exit(2) from None
    if curve in ("all", "clients"):
        try:
            import aiohttp  # noqa: F401 - the clients' process needs it: say so before measuring
        except ModuleNotFoundError:
            err.print("--curve clients needs aiohttp: pip install 'kvgate[bench]'")
            raise typer.Exit(2) from None
    levels = _ints(objects, "--objects")
    size = int(parse_size(object_size))
    report: dict[str, Any] = {"loadavg_start": loadavg()}
    quiet = as_json

    def said(point: ObjectsPoint) -> None:
        if not quiet:
            err.print(f"{point.objects:,} objects: {point}", soft_wrap=True, highlight=False)

    if curve in ("all", "objects"):
        started = time.perf_counter()
        if directory is None:
            with tempfile.TemporaryDirectory(prefix="kvgate-scale-") as tmp:
                points = run_objects_curve(tmp, levels, size=size, samples=samples, on_point=said)
        else:
            if directory.exists() and any(directory.iterdir()):
                raise typer.BadParameter("must be empty or missing", param_hint="--dir")
            points = run_objects_curve(
                str(directory), levels, size=size, samples=samples, on_point=said
            )
        report["objects"] = objects_report(points, started) | {"object_size": size}
    if curve in ("all", "clients"):
        started = time.perf_counter()
        served = run_clients_curve(
            _ints(sizes, "--sizes"),
            _ints(clients, "--clients"),
            duration=duration,
            memory=serve_memory,
            on_point=None if quiet else lambda p: err.print(json.dumps(p), soft_wrap=True),
        )
        report["clients"] = {
            "points": served,
            "slopes": clients_slopes(served),
            "duration": duration,
            "seconds": time.perf_counter() - started,
        }
    report["loadavg_end"] = loadavg()
    if plot is not None:
        from gateway.bench.scale_plot import draw_scale

        draw_scale(report, plot)
    if as_json:
        print(json.dumps(report))
        return
    _print_tables(report)
    if plot is not None:
        _wide_console().print(f"plot: {plot}", soft_wrap=True)


def _wide_console() -> Console:
    """A terminal's own width; piped output gets room for the tables instead of 80 columns."""
    console = Console()
    return console if console.is_terminal or "COLUMNS" in os.environ else Console(width=160)


def _slope(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def _print_tables(report: dict[str, Any]) -> None:
    out = _wide_console()
    if "objects" in report:
        part = report["objects"]
        table = Table(title=f"disk tier, {part['object_size']:,} B objects (file://)")
        columns = ["objects", "scan start s", "saved start s", "index B/obj", "RSS MiB"]
        columns += ["peak MiB"]
        columns += ["put p50 ms", "put p99 ms", "get p50 ms", "get p99 ms"]
        columns += ["list 1st page ms", "list page ms", "list all s", "fill/s"]
        for col in columns:
            table.add_column(col, justify="right")
        for p in part["points"]:
            table.add_row(
                f"{p['objects']:,}",
                f"{p['open_s']:.2f}",
                f"{p['snapshot_open_s']:.2f}",
                f"{p['index_bytes_per_object']:.0f}",
                f"{p['rss_after_open'] / 2**20:.0f}",
                f"{p['peak_rss'] / 2**20:.0f}",
                f"{p['put_p50_ms']:.3f}",
                f"{p['put_p99_ms']:.3f}",
                f"{p['get_p50_ms']:.3f}",
                f"{p['get_p99_ms']:.3f}",
                f"{p['list_first_page_ms']:.1f}",
                f"{p['list_page_p50_ms']:.3f}",
                f"{p['list_all_s']:.2f}",
                f"{p['fill_ops_per_s']:,.0f}",
            )
        out.print(table)
        slopes = ", ".join(f"{k} {_slope(v)}" for k, v in part["slopes"].items())
        out.print(f"growth exponents vs objects: {slopes}", soft_wrap=True)
    if "clients" in report:
        part = report["clients"]
        table = Table(title="kvgate serve (memory + disk tiers) against concurrent clients")
        for col in ("size", "clients", "put op/s", "put p50", "put p99"):
            table.add_column(col, justify="right")
        for col in ("get op/s", "get p50", "get p99", "server MiB"):
            table.add_column(col, justify="right")
        for p in part["points"]:
            put, get = p["put"], p["get"]
            table.add_row(
                f"{p['size']:,}",
                str(p["clients"]),
                f"{put['ops_per_s']:,.0f}",
                f"{put['p50_ms']:.2f}",
                f"{put['p99_ms']:.2f}",
                f"{get['ops_per_s']:,.0f}",
                f"{get['p50_ms']:.2f}",
                f"{get['p99_ms']:.2f}",
                f"{p['server_rss'] / 2**20:.0f}",
            )
        out.print(table)
        for name, slopes in part["slopes"].items():
            text = ", ".join(f"{k} {_slope(v)}" for k, v in slopes.items())
            out.print(f"growth exponents vs clients, {name}: {text}", soft_wrap=True)
    out.print(f"load average: {report['loadavg_start']} -> {report['loadavg_end']}")


def register_scale(app: typer.Typer) -> None:
    """Add ``scale`` under ``kvgate bench``."""
    app.command("scale")(bench_scale)
