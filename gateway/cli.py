"""The ``kvgate`` command."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table

from gateway.bench import BenchResult, run_bench
from gateway.config import parse_size
from gateway.registry import codec_status, connector_status

app = typer.Typer(add_completion=False, no_args_is_help=True, help="kvgate: KV-cache gateway")
err = Console(stderr=True)


@app.command()
def connectors(
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
) -> None:
    """List registered connectors and codecs, and whether each is usable here."""
    rows = {"connectors": connector_status(), "codecs": codec_status()}
    if as_json:
        print(
            json.dumps(
                {
                    k: [vars(s) if hasattr(s, "__dict__") else _status_dict(s) for s in v]
                    for k, v in rows.items()
                }
            )
        )
        return
    for title, statuses in rows.items():
        table = Table(title=title)
        for col in ("name", "usable", "provided by", "problem"):
            table.add_column(col)
        for s in statuses:
            table.add_row(
                s.name, "yes" if s.usable else "no", f"{s.distribution} ({s.target})", s.problem
            )
        Console().print(table)


def _status_dict(s: object) -> dict[str, object]:
    return {f: getattr(s, f) for f in ("name", "target", "distribution", "usable", "problem")}


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint=what) from None
    if not isinstance(value, dict):
        raise typer.BadParameter("must be a JSON object", param_hint=what)
    return value


@app.command()
def bench(
    tier: Annotated[
        list[str] | None,
        typer.Option("--tier", "-t", help="tier URL, in order (repeat); default: memory://"),
    ] = None,
    size: Annotated[str, typer.Option(help="object size, e.g. 32MiB or 4KiB")] = "32MiB",
    count: Annotated[int, typer.Option("--count", "-n", help="number of objects")] = 64,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c")] = 1,
    kind: Annotated[str, typer.Option(help="tensor, ndarray or bytes")] = "tensor",
    capacity: Annotated[str | None, typer.Option(help="memory tier capacity")] = None,
    baseline: Annotated[
        str, typer.Option(help="auto, memcpy, disk, client (the raw client library) or none")
    ] = "auto",
    tier_options: Annotated[
        str | None,
        typer.Option(help='JSON options of the last tier, e.g. \'{"endpoint_url": "..."}\''),
    ] = None,
    repeat: Annotated[int, typer.Option(help="runs; the median run is reported")] = 1,
    cold: Annotated[bool, typer.Option(help="evict files from the page cache before gets")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
) -> None:
    """Put then get COUNT objects through a Store; print throughput next to a baseline."""
    tiers = tier or ["memory://"]
    nbytes = parse_size(size)
    cap = parse_size(capacity) if capacity else None
    options = _json_object(tier_options, "--tier-options") if tier_options else None
    results: list[BenchResult] = []
    show = not as_json and sys.stderr.isatty() and count * repeat >= 50
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=not show,
    ) as bar:
        task = bar.add_task("bench", total=count * 3 * repeat)
        for _ in range(repeat):
            results.append(
                asyncio.run(
                    run_bench(
                        tiers,
                        size=nbytes,
                        count=count,
                        concurrency=concurrency,
                        kind=kind,
                        capacity=cap,
                        baseline=baseline,
                        cold=cold,
                        progress=lambda n: bar.advance(task, n),
                        tier_options=options,
                    )
                )
            )
    results.sort(key=lambda r: r.put_gbps + r.get_copy_gbps)
    result = results[len(results) // 2]
    if as_json:
        print(json.dumps(result.as_dict()))
        return
    table = Table(
        title=f"kvgate bench: {count} x {size} via {' -> '.join(result.tiers)}, "
        f"concurrency {concurrency}"
    )
    for col in ("", "kvgate GB/s", f"baseline ({result.baseline}) GB/s", "ratio", "ops/s"):
        table.add_column(col)
    table.add_row(
        "put",
        f"{result.put_gbps:.2f}",
        f"{result.baseline_put_gbps:.2f}",
        f"{result.put_ratio:.2f}",
        f"{result.put_ops_per_s:,.0f}",
    )
    table.add_row(
        "get (zero-copy)" if result.get_zero_copy else "get",
        f"{result.get_gbps:.2f}",
        f"{result.baseline_get_gbps:.2f}",
        "-" if result.get_zero_copy else f"{result.get_ratio:.2f}",
        f"{result.get_ops_per_s:,.0f}",
    )
    table.add_row(
        "get+copy",
        f"{result.get_copy_gbps:.2f}",
        f"{result.baseline_get_gbps:.2f}",
        f"{result.get_copy_ratio:.2f}",
        "",
    )
    Console().print(table)
    Console().print(
        f"get latency p50 {result.p50_ms:.3f} ms, p99 {result.p99_ms:.3f} ms; "
        f"put p50 {result.put_p50_ms:.3f} ms, p99 {result.put_p99_ms:.3f} ms; "
        f"hits {result.get_hits}/{count}",
        soft_wrap=True,  # one line, whatever the terminal width: scripts grep it
    )
    if result.errors:
        Console().print(f"errors: {result.errors}")


LOOPBACK = ("127.0.0.1", "localhost", "::1")


@app.command()
def serve(
    config: Annotated[
        str | None,
        typer.Option(
            "--config", "-f", help="YAML config (default: $KVGATE_CONFIG or memory + disk)"
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="bind address (loopback only for now)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port")] = 8080,
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
) -> None:
    """Serve a Store over HTTP (object API, /healthz, /v1/tiers)."""
    if host not in LOOPBACK:
        # Without authentication a non-loopback bind would expose the cache to the network.
        err.print(
            f"refusing to bind {host}: only loopback addresses are served until "
            "bearer-token auth is available"
        )
        raise typer.Exit(2)
    try:
        import uvicorn

        from gateway.service import create_app
    except ModuleNotFoundError as exc:
        err.print(
            f"kvgate serve needs the serve extra ({exc.name} is missing): "
            "pip install 'kvgate[serve]'"
        )
        raise typer.Exit(2) from None
    from gateway.config import load_config, redact_url

    cfg = load_config(config)
    tiers = " -> ".join(
        redact_url(t.url) + (f" ({t.capacity:,} B)" if t.capacity else "") for t in cfg.tiers
    )
    typer.echo(err=True, message=f"kvgate serving on http://{host}:{port}; tiers: {tiers}")
    uvicorn.run(create_app(cfg), host=host, port=port, log_level=log_level)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
