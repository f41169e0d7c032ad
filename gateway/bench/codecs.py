"""``kvgate bench codecs``: ratio, quality and speed of every codec on KV chunks.

Each operating point (a codec and its options) encodes and decodes a sample chunk through the
same path a tier uses: ``codec.encode`` -> ``frame.encode_header`` (payload checksum) ->
``frame.decode_frame`` (checksum verified) -> ``codec.decode`` into a preallocated buffer ->
(keyed codecs such as aesgcm through ``encode_payload``/``decode_payload``, with a key) ->
``objects.to_object``. So the figures are what a store would see, header and checksum included.

Per point it reports the ratio (input bytes / stored frame bytes: "vs fp16" for an fp16 chunk),
bits per element, the relative error of K and of V, the relative error of causal attention
outputs computed with the decoded K and V (what a model would notice), and encode and decode
GB/s (input bytes / wall time, the median of ``repeat`` runs). A memcpy of the same chunk into
a preallocated buffer is measured in the same run: on a noisy shared machine only figures
taken side by side compare. A sample made of several chunks (smollm2: 256-token chunks) has
each chunk encoded as its own object, as a store holds them; a sample with an end-to-end
measure (a model reading on from the decoded K/V) also gets its KL and top-1 agreement.

Codecs are found through the registry, never imported by name, so a codec added by a plugin is
measured too. A point that fails (bad options, a codec bug) becomes an error row: one broken
codec must not hide the others. torch is imported inside the functions, as everywhere in
``gateway``.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.codec import Codec, decode_payload, encode_frame
from gateway.errors import CorruptObject, MissingDependency
from gateway.frame import decode_frame
from gateway.objects import ObjectData, ObjectMeta, to_object, to_object_data
from gateway.registry import codec_class, codec_status, load_codec
from gateway.types import MemoryFormat

if TYPE_CHECKING:
    import torch

    from gateway.bench.kv_samples import KVSample

Tick = Callable[[int], None]
SAMPLES = ("synthetic", "minilm", "smollm2")
DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


@dataclass(frozen=True)
class Point:
    """One operating point: a codec and the options it is built with."""

    codec: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def options_label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.options.items()) or "default"


# Points measured besides every usable codec with its default options. Add a line here to
# add a point to the default sweep.
EXTRA_POINTS: tuple[Point, ...] = (
    Point("kivi", {"bits": 2, "group": 32}),
    Point("kivi", {"bits": 4, "group": 32}),
    Point("kivi", {"bits": 2, "group": 128}),
    Point("cachegen", {"quality": 0.5}),
    Point("cachegen", {"quality": 1.0}),
    Point("cachegen", {"key_bins": 32, "value_bins": 32, "quality": 1.0}),
)


@dataclass
class Row:
    """What one point measured on one sample (numbers are None in an error row)."""

    codec: str
    options: dict[str, Any]
    label: str
    lossless: bool | None = None
    input_bytes: int = 0
    stored_bytes: int | None = None
    ratio: float | None = None
    bits_per_element: float | None = None
    k_rel_error: float | None = None
    v_rel_error: float | None = None
    attention_error: float | None = None
    encode_gbps: float | None = None
    decode_gbps: float | None = None
    exact: bool | None = None  # decoded bytes identical to the input
    # End to end (samples with a model: smollm2): mean KL(exact || decoded) of next-token
    # distributions in nats, and the share of positions with the same most likely token.
    kl: float | None = None
    top1: float | None = None
    error: str | None = None


@dataclass
class SampleResult:
    name: str
    shape: list[int]
    dtype: str
    input_bytes: int
    memcpy_gbps: float
    rows: list[Row] = field(default_factory=list)


@dataclass
class CodecBenchReport:
    samples: list[SampleResult]
    repeat: int
    skipped: dict[str, str] = field(default_factory=dict)  # codec or sample -> why

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` form: samples -> rows, plus the same-run memcpy baseline."""
        return {
            "repeat": self.repeat,
            "memcpy_gbps": self.samples[0].memcpy_gbps if self.samples else None,
            "samples": {s.name: [asdict(r) for r in s.rows] for s in self.samples},
            "sample_info": {
                s.name: {
                    "shape": s.shape,
                    "dtype": s.dtype,
                    "input_bytes": s.input_bytes,
                    "memcpy_gbps": s.memcpy_gbps,
                }
                for s in self.samples
            },
            "skipped": self.skipped,
        }


# -- which points ------------------------------------------------------------------------


def parse_points(text: str) -> list[Point]:
    """``[{"codec": "kivi", "options": {"bits": 4}}, ...]`` -> points; ValueError if malformed."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(value, list) or not value:
        raise ValueError('expected a non-empty list of {"codec": NAME, "options": {...}}')
    points = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("codec"), str):
            raise ValueError(f"each point needs a codec name: {item!r}")
        options = item.get("options", {})
        if not isinstance(options, dict) or set(item) - {"codec", "options"}:
            raise ValueError(f'a point is {{"codec": NAME, "options": {{...}}}}: {item!r}')
        points.append(Point(item["codec"], options))
    return points


def select_points(
    points: Sequence[Point] | None = None, codecs: Sequence[str] | None = None
) -> tuple[list[Point], dict[str, str]]:
    """The points to measure and the codecs skipped (not usable here, with the reason).

    Without ``points``: every usable codec with default options plus ``EXTRA_POINTS``.
    ``codecs`` keeps only those codecs; naming one that is registered but not usable keeps it,
    so its problem shows as an error row instead of silently vanishing.
    """
    status = {s.name: s for s in codec_status()}
    wanted = {c.lower() for c in codecs} if codecs else None
    if wanted is not None and (unknown := wanted - set(status)):
        raise ValueError(
            f"unknown codec {', '.join(sorted(unknown))} (registered: {', '.join(sorted(status))})"
        )
    usable = {n for n, s in status.items() if s.usable}
    skipped: dict[str, str] = {}
    if points is None:
        names = sorted(usable if wanted is None else wanted)
        if wanted is None:
            skipped = {n: s.problem for n, s in sorted(status.items()) if n not in usable}
        # Each codec's default point, then its extra points: rows of one codec stay together.
        points = [q for n in names for q in (Point(n), *(p for p in EXTRA_POINTS if p.codec == n))]
        points = [p for p in points if p.codec in usable or not p.options]
    chosen = [p for p in points if wanted is None or p.codec.lower() in wanted]
    return _dedupe(chosen), skipped


def _dedupe(points: Sequence[Point]) -> list[Point]:
    """Drop points that build the same codec as an earlier one (an extra point that equals
    a codec's defaults), comparing options with the constructor's defaults filled in."""
    seen: list[tuple[str, dict[str, Any]]] = []
    out = []
    for p in points:
        key = (p.codec.lower(), {**codec_defaults(p.codec), **p.options})
        if key not in seen:
            seen.append(key)
            out.append(p)
    return out


def codec_defaults(name: str) -> dict[str, Any]:
    """The keyword defaults of a codec's constructor: what ``load_codec(name)`` builds."""
    try:
        params = inspect.signature(codec_class(name)).parameters.values()
    except Exception:  # not importable or no signature: reported when it is measured
        return {}
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: p.default for p in params if p.kind in named and p.default is not p.empty}


def default_label(point: Point, points: Sequence[Point]) -> str:
    """The options column: ``bits=4 group=32``, or for a default point ``default``, naming
    the default values of the options the codec's other points vary (``default (bits=2
    group=32)``) so that a reader can place it among them."""
    if point.options:
        return point.options_label
    varied = {k for p in points if p.codec == point.codec for k in p.options}
    defaults = codec_defaults(point.codec)
    # Only scalar defaults: a per-layer list (cachegen's bins) would swamp the table and plot.
    shown = " ".join(
        f"{k}={defaults[k]}"
        for k in sorted(varied)
        if k in defaults and isinstance(defaults[k], int | float | str | bool)
    )
    return f"default ({shown})" if shown else "default"


# -- samples -----------------------------------------------------------------------------


def load_samples(
    which: str,
    *,
    layers: int,
    tokens: int,
    hidden: int,
    dtype: str,
    texts: int = 2,
    model_dir: Path | None = None,
) -> tuple[list[KVSample], dict[str, str]]:
    """The samples asked for, and those skipped with the reason (the bench extra or the
    SmolLM2 model missing). ``texts`` and ``model_dir``: the smollm2 sample's."""
    import torch

    from gateway.bench import kv_samples, smollm2_sample

    tdtype = getattr(torch, DTYPES.get(dtype, dtype))
    names = SAMPLES if which == "all" else (which,)
    samples, skipped = [], {}
    for name in names:
        if name == "synthetic":
            # Heads only matter to the attention error; any split of hidden will do.
            heads = next(h for h in (8, 4, 2, 1) if hidden % h == 0)
            samples.append(
                kv_samples.synthetic_kv(layers, tokens, hidden, heads=heads, dtype=tdtype)
            )
        elif name == "minilm":
            try:
                samples.append(kv_samples.minilm_kv(tokens, dtype=tdtype))
            except MissingDependency as exc:
                skipped["minilm"] = str(exc)
            except ValueError as exc:  # too many tokens: an error only when asked for by name
                if which != "all":
                    raise
                skipped["minilm"] = str(exc)
        elif name == "smollm2":
            try:
                samples.append(smollm2_sample.smollm2_kv(texts, dtype=tdtype, model_dir=model_dir))
            except MissingDependency as exc:
                skipped["smollm2"] = str(exc)
        else:
            raise ValueError(f"unknown sample {name!r} (expected {', '.join(SAMPLES)} or all)")
    return samples, skipped


# -- measuring ---------------------------------------------------------------------------


def memcpy_gbps(t: torch.Tensor, repeat: int) -> float:
    """Copying the chunk into a preallocated (already faulted-in) buffer: the ceiling."""
    src = t.contiguous().reshape(-1).view(_torch().uint8).numpy()
    dst = np.zeros_like(src)
    np.copyto(dst, src)  # fault the pages in, as a pool buffer would be
    times = []
    for _ in range(max(repeat, 3)):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return src.nbytes / statistics.median(times) / 1e9


def _with_bench_key(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """A keyed codec's options, with a throwaway key file when they name no key source: the
    bench measures the cipher, and a random key is as fast as any."""
    if "key_file" in options or "key_env" in options:
        return options
    if not getattr(codec_class(name), "keyed", False):
        return options
    return {**options, "key_file": _bench_key_file()}


@functools.cache
def _bench_key_file() -> str:
    fd, path = tempfile.mkstemp(prefix="kvgate-bench-key-")  # mode 0600
    with os.fdopen(fd, "w") as file:
        file.write(secrets.token_hex(32) + "\n")
    atexit.register(os.unlink, path)
    return path


def _torch() -> Any:
    import torch

    return torch


# Frames are bound to a key as a tier binds them: a keyed codec (aesgcm) needs one.
BENCH_KEY = "kvgate-bench/chunk"


def _encode(codec: Codec, obj: ObjectData) -> tuple[bytes, list[memoryview]]:
    head, parts, _ = encode_frame(codec, obj, BENCH_KEY)
    return head, parts


def _decode(codec: Codec, blob: bytes, out: memoryview) -> object:
    header, payload = decode_frame(blob, key=BENCH_KEY)
    raw = decode_payload(codec, payload, header, out, BENCH_KEY)
    if memoryview(raw).nbytes != header.raw_len:
        raise CorruptObject(f"codec {header.codec} returned the wrong length")
    meta = ObjectMeta(header.kind, header.dtype, tuple(header.shape), header.raw_len, header.fmt)
    return to_object(meta, raw)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def measure(
    sample: KVSample, point: Point, repeat: int, label: str = "", tick: Tick | None = None
) -> Row:
    """One point on one sample; any exception becomes an error row. Each of the sample's
    chunks is its own object (encoded, framed and decoded on its own), as in a store; sizes
    and times are summed over the chunks."""
    tick = tick or (lambda _n: None)
    row = Row(point.codec, dict(point.options), label or point.options_label)
    chunks = [c.contiguous() for c in sample.chunks()]
    row.input_bytes = sum(c.numel() * c.element_size() for c in chunks)
    try:
        codec = load_codec(point.codec, **_with_bench_key(point.codec, point.options))
        row.lossless = bool(codec.lossless)
        # A small slice of the same dtype first: compiles numba kernels outside the timings.
        warm = chunks[0][:, :1, : min(chunks[0].shape[2], 64)].contiguous()
        _round_trip(codec, warm)
        tick(1)
        objs = [to_object_data(c, MemoryFormat.KV_2LTD) for c in chunks]
        if sample.positions is not None:
            for obj, position in zip(objs, sample.positions, strict=True):
                obj.position = position
        outs = [np.zeros(c.numel() * c.element_size(), dtype=np.uint8) for c in chunks]
        enc, dec = [], []
        for _ in range(repeat):
            seconds, framed = _timed(functools.partial(_encode_all, codec, objs))
            enc.append(seconds)
            tick(1)
            # Joined outside the timing: a tier writes the header and parts as they are.
            blobs = [b"".join([head, *parts]) for head, parts in framed]
            seconds, got = _timed(functools.partial(_decode_all, codec, blobs, outs))
            dec.append(seconds)
            tick(1)
        kv_hat = _joined(got, chunks)
        _fill_quality(row, sample, sample.kv, kv_hat, sum(map(len, blobs)))
        row.encode_gbps = row.input_bytes / statistics.median(enc) / 1e9
        row.decode_gbps = row.input_bytes / statistics.median(dec) / 1e9
        _fill_end_to_end(row, sample, kv_hat)
        tick(1)
    except Exception as exc:  # a broken codec is a row, not a crashed bench
        row.error = f"{type(exc).__name__}: {exc}"
    return row


def _encode_all(codec: Codec, objs: Sequence[ObjectData]) -> list[tuple[bytes, list[memoryview]]]:
    return [_encode(codec, obj) for obj in objs]


def _decode_all(codec: Codec, blobs: Sequence[bytes], outs: Sequence[np.ndarray]) -> list[object]:
    return [_decode(codec, blob, out.data) for blob, out in zip(blobs, outs, strict=True)]


def _joined(got: Sequence[object], chunks: Sequence[torch.Tensor]) -> object:
    """The decoded chunks as one tensor of the sample's shape (or the odd object, which
    ``_fill_quality`` refuses)."""
    torch = _torch()
    tensors = [g for g in got if isinstance(g, torch.Tensor)]
    if len(got) == 1 or len(tensors) != len(got):
        return got[0]
    shapes_match = all(g.shape == c.shape for g, c in zip(tensors, chunks, strict=True))
    return torch.cat(tensors, dim=2) if shapes_match else got[0]


def _fill_end_to_end(row: Row, sample: KVSample, kv_hat: object) -> None:
    """KL and top-1 of the model reading on from the decoded K/V. Bit-identical K/V make the
    reference run itself (KL 0, top-1 1): the model is not run again for them."""
    if sample.end_to_end is None:
        return
    if row.exact:
        row.kl, row.top1 = 0.0, 1.0
        return
    assert isinstance(kv_hat, _torch().Tensor)  # _fill_quality checked it
    row.kl, row.top1 = sample.end_to_end.measure(kv_hat)


def _round_trip(codec: Codec, t: torch.Tensor) -> None:
    head, parts = _encode(codec, to_object_data(t, MemoryFormat.KV_2LTD))
    out = np.zeros(t.numel() * t.element_size(), dtype=np.uint8)
    _decode(codec, b"".join([head, *parts]), out.data)


def _fill_quality(row: Row, sample: KVSample, kv: torch.Tensor, got: object, stored: int) -> None:
    from gateway.bench.kv_samples import attention_error, relative_error

    torch = _torch()
    if not isinstance(got, torch.Tensor) or got.shape != kv.shape or got.dtype != kv.dtype:
        raise CorruptObject(f"decoded {type(got).__name__} is not the input's shape and dtype")
    row.stored_bytes = stored
    row.ratio = row.input_bytes / stored
    row.bits_per_element = stored * 8 / kv.numel()
    row.exact = bool(torch.equal(got.view(torch.uint8), kv.view(torch.uint8)))
    if row.exact:
        row.k_rel_error = row.v_rel_error = row.attention_error = 0.0
        return
    row.k_rel_error = relative_error(kv[0], got[0])
    row.v_rel_error = relative_error(kv[1], got[1])
    row.attention_error = attention_error(sample, got)
    if row.lossless:
        raise CorruptObject("a lossless codec did not reproduce its input")


def run_codec_bench(
    samples: Sequence[KVSample],
    points: Sequence[Point],
    *,
    repeat: int = 3,
    tick: Tick | None = None,
) -> list[SampleResult]:
    """Every point on every sample (``tick`` advances by one per step, see ``steps``)."""
    results = []
    for sample in samples:
        kv = sample.kv
        result = SampleResult(
            sample.name,
            list(kv.shape),
            str(kv.dtype).removeprefix("torch."),
            kv.numel() * kv.element_size(),
            memcpy_gbps(kv, repeat),
        )
        for point in points:
            label = default_label(point, points)
            result.rows.append(measure(sample, point, repeat, label, tick))
        results.append(result)
    return results


def steps(samples: int, points: int, repeat: int) -> int:
    """How many ticks ``run_codec_bench`` makes at most (for a progress bar)."""
    return samples * points * (2 + 2 * repeat)
