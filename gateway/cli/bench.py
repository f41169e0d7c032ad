"""``kvgate bench`` (a Store against its baseline), ``kvgate bench codecs`` and
``kvgate bench lookup``."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table

from gateway.bench.lookup import DEFAULT_LENGTHS, DEFAULT_STACKS, parse_stack
from gateway.bench.store import BenchResult, combine_runs, run_bench
from gateway.config import parse_size

err = Console(stderr=True)


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint=what) from None
    if not isinstance(value, dict):
        raise typer.BadParameter("must be a JSON object", param_hint=what)
    return value


# `kvgate bench [options]` runs the Store bench; `kvgate bench codecs|lookup|scale [options]`
# the codec, prefix lookup and growth ones.
bench_app = typer.Typer(subcommand_metavar="[codecs | lookup | scale [OPTIONS]]")


@bench_app.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
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
    repeat: Annotated[
        int,
        typer.Option(
            min=1, help="runs; each side's median GB/s is reported, ratios are of medians"
        ),
    ] = 3,
    cold: Annotated[bool, typer.Option(help="evict files from the page cache before gets")] = False,
    write_policy: Annotated[
        str,
        typer.Option(help="back (a put returns once staged) or through (once every tier holds it)"),
    ] = "back",
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
) -> None:
    """Benchmarks: put then get COUNT objects through a Store, next to a baseline.

    The codecs instead (ratio, error, speed): kvgate bench codecs [OPTIONS]; prefix lookup
    latency: kvgate bench lookup [OPTIONS].
    """
    if ctx.invoked_subcommand is not None:
        return
    if write_policy not in ("back", "through"):
        raise typer.BadParameter("back or through", param_hint="--write-policy")
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
                        write_policy=write_policy,
                        progress=lambda n: bar.advance(task, n),
                        tier_options=options,
                    )
                )
            )
    result = combine_runs(results)  # medians of each side; why: combine_runs' docstring
    if as_json:
        print(json.dumps(result.as_dict()))
        return
    table = Table(
        title=f"kvgate bench: {count} x {size} via {' -> '.join(result.tiers)}, "
        f"concurrency {concurrency}, write-{result.write_policy}"
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


SampleChoice = Literal["all", "synthetic", "minilm", "smollm2"]
DtypeChoice = Literal["fp16", "bf16", "fp32"]


@bench_app.command("codecs")
def bench_codecs(
    sample: Annotated[SampleChoice, typer.Option(help="which K/V chunk")] = "all",
    codec: Annotated[
        list[str] | None, typer.Option("--codec", help="only this codec (repeat)")
    ] = None,
    points: Annotated[
        str | None,
        typer.Option(
            help='JSON list of {"codec": NAME, "options": {...}}, replacing the default sweep'
        ),
    ] = None,
    layers: Annotated[int, typer.Option(min=1, help="synthetic chunk: layers")] = 32,
    tokens: Annotated[int, typer.Option(min=2, help="tokens (MiniLM: at most 512)")] = 256,
    hidden: Annotated[int, typer.Option(min=1, help="synthetic chunk: hidden size")] = 1024,
    texts: Annotated[
        int, typer.Option(min=1, max=4, help="smollm2: test texts (1024 + 512 tokens each)")
    ] = 2,
    model_dir: Annotated[
        Path | None,
        typer.Option(
            help="smollm2: the converted model folder (default: $KVGATE_SMOLLM2_DIR, "
            ".venv-vllm/models/smollm2, ~/.cache/kvgate/smollm2)"
        ),
    ] = None,
    dtype: Annotated[DtypeChoice, typer.Option(help="dtype of the chunk")] = "fp16",
    repeat: Annotated[int, typer.Option(min=1, help="runs; the median time is reported")] = 3,
    plot: Annotated[
        Path | None, typer.Option(help="write the rate-distortion plot to this PNG")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
) -> None:
    """Ratio, K/V and attention-output error, encode/decode GB/s of every codec on KV chunks;
    on SmolLM2's K/V also end-to-end KL and top-1 agreement of the model reading on.

    Default points: every usable codec with its default options, plus a few option sweeps.
    """
    try:
        from gateway.bench import codecs as codec_bench
        from gateway.bench.rd_plot import draw_rate_distortion

        if plot is not None:
            import matplotlib  # noqa: F401 - fail before measuring, not after
        import torch  # noqa: F401
    except ModuleNotFoundError as exc:
        extra = "torch" if exc.name == "torch" else "bench"
        err.print(f"kvgate bench codecs needs {exc.name}: pip install 'kvgate[{extra}]'")
        raise typer.Exit(2) from None
    try:
        chosen = codec_bench.parse_points(points) if points else None
        selected, skipped = codec_bench.select_points(chosen, codec)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--points / --codec") from None
    try:
        samples, skipped_samples = codec_bench.load_samples(
            sample,
            layers=layers,
            tokens=tokens,
            hidden=hidden,
            dtype=dtype,
            texts=texts,
            model_dir=model_dir,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--tokens") from None
    for name, why in {**skipped, **skipped_samples}.items():
        err.print(f"skipped {name}: {why}", soft_wrap=True)
    if not samples:
        err.print(f"no sample to measure: {sample} was skipped")
        raise typer.Exit(2)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=not sys.stderr.isatty(),
    ) as bar:
        total = codec_bench.steps(len(samples), len(selected), repeat)
        task = bar.add_task("bench codecs", total=total)
        results = codec_bench.run_codec_bench(
            samples, selected, repeat=repeat, tick=lambda n: bar.advance(task, n)
        )
    report = codec_bench.CodecBenchReport(results, repeat, {**skipped, **skipped_samples})
    data = report.as_dict()
    if plot is not None:
        bits = {"fp16": 16, "bf16": 16, "fp32": 32}[dtype]
        title = f"kvgate codecs: rate vs distortion ({dtype} K/V)"
        draw_rate_distortion(data["samples"], plot, input_bits=bits, title=title)
    if as_json:
        print(json.dumps(data))
        return
    out = _wide_console()
    for result in results:
        table, errors = _codec_table(result, dtype)
        out.print(table)
        for line in errors:
            out.print(line, soft_wrap=True, highlight=False)
    if plot is not None:
        out.print(f"rate-distortion plot: {plot}", soft_wrap=True)


def _codec_table(result: Any, dtype: str) -> tuple[Table, list[str]]:
    """The sample's table, and one line per error row (too long for a cell). A sample with an
    end-to-end measure (a model reading on) gets its KL and top-1 columns."""
    shape = "x".join(map(str, result.shape))
    e2e = any(r.kl is not None for r in result.rows)
    caption = f"ratio: {dtype} bytes / stored frame bytes; errors: relative, 0 = exact"
    if e2e:
        caption += (
            "; KL: mean KL(exact || decoded) of next-token distributions (nats), top-1: same "
            "most likely token, the model reading on from the decoded K/V"
        )
    table = Table(
        title=f"{result.name} K/V [{shape}] {result.dtype}, {result.input_bytes / 2**20:.1f} MiB",
        caption=caption,
    )
    for col in ("codec", "options"):
        table.add_column(col)
    columns = ["ratio", "bits/el", "K err", "V err", "attn err"]
    columns += ["KL", "top-1"] if e2e else []
    for col in (*columns, "enc GB/s", "dec GB/s"):
        table.add_column(col, justify="right")
    memcpy = f"{result.memcpy_gbps:.2f}"
    bits = f"{result.input_bytes * 8 / math.prod(result.shape):.2f}"
    exact = ["0", "0", "0"] + (["0", "100.0%"] if e2e else [])
    table.add_row("memcpy", "(baseline)", "1.00", bits, *exact, memcpy, memcpy, style="dim")
    errors = []
    for r in result.rows:
        if r.error is not None:
            table.add_row(r.codec, r.label, "[red]error[/]", *["-"] * (len(columns) + 1))
            errors.append(f"[red]error[/] {result.name}, {r.codec} {r.label}: {r.error}")
            continue
        quality = [_err(e) for e in (r.k_rel_error, r.v_rel_error, r.attention_error)]
        if e2e:
            quality += [_err(r.kl), f"{r.top1:.1%}"]
        table.add_row(
            r.codec,
            r.label,
            f"{r.ratio:.2f}",
            f"{r.bits_per_element:.2f}",
            *quality,
            f"{r.encode_gbps:.2f}",
            f"{r.decode_gbps:.2f}",
        )
    return table, errors


def _err(value: float) -> str:
    if value == 0:
        return "0"
    return f"{value:.4f}" if value >= 1e-3 else f"{value:.2e}"


@bench_app.command("lookup")
def bench_lookup(
    stack: Annotated[
        list[str] | None,
        typer.Option(
            "--stack",
            "-s",
            help="tiers in order, comma-separated: memory, file, redis or URLs (repeat); "
            f"default: {'; '.join(DEFAULT_STACKS)}",
        ),
    ] = None,
    lengths: Annotated[str, typer.Option(help="prefix lengths (keys), comma-separated")] = ",".join(
        map(str, DEFAULT_LENGTHS)
    ),
    rounds: Annotated[int, typer.Option(min=3, help="timed lookups per point")] = 50,
    redis: Annotated[
        str | None,
        typer.Option(
            help="redis:// URL for 'redis' in a stack (default: a redis-server of its own)"
        ),
    ] = None,
    tier_options: Annotated[
        str | None,
        typer.Option(
            help="JSON connector options of each stack's last tier, e.g. "
            '\'{"endpoint_url": "..."}\''
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
) -> None:
    """Store.lookup latency (p50, p99) against the prefix length, per tier stack, every key
    answered by the stack's deepest tier, next to that tier's raw client on the same keys."""
    from gateway.bench.lookup import run_lookup_bench, summary

    try:
        stacks = [parse_stack(s) for s in (stack or list(DEFAULT_STACKS))]
        sizes = [int(n) for n in lengths.split(",") if n.strip()]
        if not sizes or min(sizes) < 1:
            raise ValueError("lengths must be positive integers")
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--stack / --lengths") from None
    options = _json_object(tier_options, "--tier-options") if tier_options else None
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        console=err,
        transient=True,
        disable=as_json or not sys.stderr.isatty(),
    ) as bar:
        task = bar.add_task("bench lookup", total=len(stacks) * len(sizes))
        try:
            points = asyncio.run(
                run_lookup_bench(
                    stacks,
                    lengths=sizes,
                    rounds=rounds,
                    redis_url=redis,
                    progress=lambda n: bar.advance(task, n),
                    tier_options=options,
                )
            )
        except RuntimeError as exc:
            err.print(f"kvgate bench lookup: {exc}", soft_wrap=True)
            raise typer.Exit(2) from None
    data = summary(points)
    if as_json:
        print(json.dumps(data))
        return
    table = Table(
        title=f"kvgate bench lookup: every key in the deepest tier, {rounds} rounds",
        caption="ratio: kvgate p50 / baseline p50 (1.0 = as fast); "
        f"load average {data['loadavg'][0]:.2f}",
    )
    for col in ("stack", "keys", "p50 ms", "p99 ms", "baseline", "base p50", "base p99"):
        table.add_column(col, justify="left" if col in ("stack", "baseline") else "right")
    table.add_column("ratio", justify="right")
    table.add_column("floor p50", justify="right")
    for p in points:
        table.add_row(
            p.stack,
            str(p.length),
            f"{p.p50_ms:.3f}",
            f"{p.p99_ms:.3f}",
            p.baseline or "-",
            _ms(p.baseline_p50_ms),
            _ms(p.baseline_p99_ms),
            "-" if p.ratio is None else f"{p.ratio:.2f}",
            _ms(p.floor_p50_ms),
        )
    _wide_console().print(table)
    if any(p.floor for p in points):
        floors = sorted({p.floor for p in points if p.floor})
        _wide_console().print(f"floor: {', '.join(floors)}", soft_wrap=True, highlight=False)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _wide_console() -> Console:
    """A terminal's own width; piped output gets room for a wide table instead of 80 columns."""
    console = Console()
    if console.is_terminal or "COLUMNS" in os.environ:
        return console
    return Console(width=160)


def register(app: typer.Typer) -> None:
    """Add ``bench`` (and ``bench codecs``, ``bench scale``) to the ``kvgate`` command."""
    from gateway.cli.bench_scale import register_scale

    register_scale(bench_app)
    app.add_typer(bench_app, name="bench")
