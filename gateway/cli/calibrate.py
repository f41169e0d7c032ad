"""``kvgate calibrate``: fit a ``kvtc`` calibration and write it (and optionally store it).

The calibration file is what the ``kvtc`` codec's ``calibration`` option names; ``--put``
also writes it into a store's tiers under its reserved key, so that readers can fetch it
(a writer's tiers do this themselves before their first frame). Prints the SHA-256 that
frames will name and the size of the stored bases.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from gateway.cli.calibrate_sources import (
    SAMPLES,
    WEIGHT_MODES,
    from_file,
    from_sample,
    from_store,
    model_weights,
    put_calibration,
)

if TYPE_CHECKING:
    from serde.kvtc.fit import Chunk

err = Console(stderr=True)


def calibrate(
    out: Annotated[Path, typer.Argument(help="where to write the calibration")],
    sample: Annotated[
        str | None, typer.Option(help=f"a bench sample: {', '.join(SAMPLES)}")
    ] = None,
    chunks_file: Annotated[
        Path | None, typer.Option("--chunks", help="a safetensors file of [2, L, T, D] chunks")
    ] = None,
    store: Annotated[
        str | None, typer.Option(help="a store config whose chunks to use (with --prefix)")
    ] = None,
    prefix: Annotated[str, typer.Option(help="key prefix of the store's chunks")] = "",
    count: Annotated[int, typer.Option(help="chunks to use (sample, store)")] = 8,
    tokens: Annotated[int, typer.Option(help="tokens per sample chunk")] = 256,
    group: Annotated[int, typer.Option(help="layers per PCA group")] = 1,
    rel_error: Annotated[float, typer.Option(help="target relative error per plane")] = 0.05,
    rope_theta: Annotated[float, typer.Option(help="RoPE base (with --head-dim)")] = 0.0,
    head_dim: Annotated[int, typer.Option(help="head dimension: undo RoPE on keys")] = 0,
    sinks: Annotated[int, typer.Option(help="leading sequence tokens kept exact")] = 4,
    max_basis_mb: Annotated[float, typer.Option(help="cap on the stored bases")] = 0.0,
    weights: Annotated[
        str,
        typer.Option(
            help=f"{'|'.join(WEIGHT_MODES)}: weigh errors by what the sample's model does with "
            "them (queries, output projections, layer sensitivity); auto: when the sample "
            "has a model"
        ),
    ] = "auto",
    put: Annotated[
        str | None, typer.Option(help="a store config to write the calibration into")
    ] = None,
) -> None:
    """Fit a kvtc calibration (PCA per layer group, one step per plane, rANS tables).

    With model weights, --rel-error is relative in the weighted metric (keys and values
    share one step): a different scale than without; see the README's kvtc table."""
    from serde.kvtc import registry
    from serde.kvtc.fit import fit
    from serde.kvtc.rope import Rope

    given = [s for s in (sample, chunks_file, store) if s is not None]
    if len(given) != 1:
        raise _fail("give exactly one of --sample, --chunks, --store")
    sample_rope = None  # a RoPE model's sample knows its RoPE: keys are calibrated unrotated
    if sample is not None:
        chunks, sample_rope = from_sample(sample, count, tokens)
    elif chunks_file is not None:
        chunks = from_file(chunks_file)
    else:
        assert store is not None
        chunks = asyncio.run(from_store(store, prefix, count))
    if not chunks:
        raise _fail("no [2, layers, tokens, channels] chunks found")
    _warn_if_few(chunks, group)
    rope = Rope(head_dim, rope_theta) if head_dim else sample_rope
    cap = int(max_basis_mb * (1 << 20)) or None
    try:
        plane_weights = model_weights(sample, weights)
        if plane_weights is not None and rope is not None:  # post-RoPE keys: the keys' ones
            plane_weights = [*plane_weights, plane_weights[0]]
        loaded = fit(
            chunks,
            group=group,
            rel_error=rel_error,
            rope=rope,
            sinks=sinks,
            max_basis_bytes=cap,
            weights=plane_weights,
            shared_step=plane_weights is not None,
            note=f"kvgate calibrate: {len(chunks)} chunks"
            + ("" if plane_weights is None else ", model weights"),
        )
    except ValueError as exc:
        raise _fail(str(exc)) from None
    out.write_bytes(loaded.data)
    _warn_if_unused(out, chunks, sinks)
    if put is not None:
        asyncio.run(put_calibration(put, registry.key_of(loaded.sha256), loaded.data))
    cal = loaded.cal
    ranks = [sum(g.rank for g in p.groups) for p in cal.planes]
    print(f"sha256 {loaded.sha256}")
    print(f"file {out} ({len(loaded.data)} bytes)")
    print(f"basis {cal.basis_bytes()} bytes, components per plane {ranks}")
    print(f"steps {[round(p.step, 6) for p in cal.planes]}")


def _warn_if_few(chunks: Sequence[Chunk], group: int) -> None:
    """PCA over fewer token vectors than a layer group has features fits a basis of fewer
    components than the data has directions: chunks unlike the samples then come back with
    errors far over the target (512 samples for 1024 features: 0.38 against 0.05)."""
    _, layers, _, channels = chunks[0].kv.shape
    features = min(group, layers) * channels
    samples = sum(int(c.kv.shape[2]) for c in chunks)
    if samples < features:
        err.print(
            f"warning: {samples} tokens for {features} features per layer group: the basis "
            "cannot span the data, and chunks unlike these samples will code with errors well "
            f"over the target; give at least {features} tokens (--count x --tokens)",
            markup=False,
            highlight=False,
        )


def _warn_if_unused(path: Path, chunks: Sequence[Chunk], sinks: int) -> None:
    """A calibration fitted looser than kvtc's guard (``serde.kvtc.guard``: a large
    --rel-error, a small --max-basis-mb) sends even its own chunks to cachegen; say so rather
    than ship one that is never used."""
    from gateway.objects import to_object_data
    from gateway.types import MemoryFormat
    from serde.kvtc import guard
    from serde.kvtc.codec import KvtcCodec

    codec = KvtcCodec(calibration=str(path), sinks=sinks)
    unused = 0
    for chunk in chunks:
        data = to_object_data(chunk.kv, fmt=MemoryFormat.KV_2LTD)
        data.position = chunk.position
        unused += codec.encode(data)[1].get("via") == "cachegen"
    if unused:
        err.print(
            f"warning: kvtc codes {unused} of these {len(chunks)} chunks with cachegen: the "
            f"calibration's error on them is over {guard.UNLIKE:g} of their energy (in its "
            "metric), where kvtc takes a chunk for one it does not describe; fit tighter (a "
            "smaller --rel-error, a larger --max-basis-mb)",
            markup=False,
            highlight=False,
        )


def _fail(message: str) -> typer.Exit:
    err.print(message, markup=False, highlight=False)
    return typer.Exit(2)


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate)
