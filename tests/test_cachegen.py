"""The ``cachegen`` codec: its rANS coder, its three implementations and its payload checks.

The shared round-trip suite (``tests/test_codecs.py``) covers the codec contract; here: the
coder on its own (skewed, uniform, one-symbol and empty streams), bit-identical payloads and
decodes from the torch reference and the numba kernels, formats, dtypes and odd token counts,
constant and non-finite tensors, corrupt and hostile payloads, that the coded size is close to
the symbols' empirical entropy, and (on a CUDA machine) the cupy kernels against the reference.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from gateway.bench.kv_samples import synthetic_kv
from gateway.errors import ConfigError, CorruptObject
from gateway.frame import FrameInfo, encode_header
from gateway.objects import ObjectData, to_object, to_object_data
from gateway.types import MemoryFormat as F
from gpu.reference import rans as ref_rans
from serde.cachegen import format as fmt
from serde.cachegen.codec import CacheGenCodec, kernels
from serde.cachegen.model import default_block, geometry, plan
from serde.cachegen.tables import (
    NSYM,
    TOTAL,
    build,
    classes_from_sumsq,
    codes_of,
    from_counts,
)
from serde.layout import layout_of

numba = pytest.importorskip("numba")
from gpu.cpu import rans as cpu_rans  # noqa: E402  (needs numba)

BINS = ((32,) * 10 + (16,), (32, 32, 16))


def kv_like(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.5).to(dtype)


def encode(obj: Any, fmt_: int = F.KV_2LTD, **options: Any) -> tuple[bytes, FrameInfo, ObjectData]:
    codec = CacheGenCodec(**options)
    data = to_object_data(obj, fmt=fmt_)
    payload, params = codec.encode(data)
    parts = [payload] if isinstance(payload, bytes | bytearray | memoryview) else list(payload)
    body = b"".join(bytes(memoryview(p)) for p in parts)
    meta = data.meta
    _, info = encode_header(
        codec="cachegen",
        kind=meta.kind,
        dtype=meta.dtype,
        shape=meta.shape,
        raw_len=meta.nbytes,
        payload=body,
        params=params,
        fmt=meta.fmt,
    )
    return body, info, data


def decode(body: bytes, info: FrameInfo, into: bool = True) -> bytes:
    out = memoryview(bytearray(info.raw_len)) if into else None
    return bytes(memoryview(CacheGenCodec().decode(memoryview(body), info, out)))


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    return float(torch.linalg.vector_norm(b64 - a64) / torch.linalg.vector_norm(a64))


@pytest.fixture
def reference(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A context switch: ``with reference(True)`` forces the torch reference kernels."""

    class Switch:
        def __call__(self, on: bool) -> Switch:
            monkeypatch.setenv("KVGATE_KERNELS", "reference" if on else "")
            return self

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            monkeypatch.setenv("KVGATE_KERNELS", "")

    return Switch()


# -- the coder -------------------------------------------------------------------------------


def _tables(rng: np.random.Generator) -> tuple[Any, list[np.ndarray[Any, Any]]]:
    """Three tables: skewed (geometric), uniform over all symbols, a single symbol."""
    skewed = np.zeros(NSYM)
    skewed[100:160] = np.exp(-np.arange(60) / 3.0) * 1e5 + 1
    uniform = np.ones(NSYM)
    single = np.zeros(NSYM)
    single[7] = 5
    ids, los, codes = [], [], []
    for i, counts in enumerate((skewed, uniform, single)):
        nz = np.flatnonzero(counts)
        ids.append(i)
        los.append(nz[0])
        codes.append(codes_of(counts[nz[0] : nz[-1] + 1]))
    tables = build(np.array(ids), np.array(los), codes, 1)
    return tables, [tables.freq[i] / TOTAL for i in range(3)]


def _streams(seed: int, streams: int, width: int) -> tuple[Any, ...]:
    rng = np.random.default_rng(seed)
    tables, probs = _tables(rng)
    tbl = rng.integers(0, 3, (streams, width))
    sym = np.zeros((streams, width), np.int64)
    for t, p in enumerate(probs):
        mask = tbl == t
        sym[mask] = rng.choice(NSYM, int(mask.sum()), p=p)
    count = rng.integers(0, width + 1, streams)
    count[:2] = (0, width)  # an empty stream and a full one
    return tables, sym, tbl, count


def _ref_encode(sym: Any, tbl: Any, count: Any, tables: Any) -> tuple[np.ndarray[Any, Any], ...]:
    words, lengths = ref_rans.encode(
        torch.from_numpy(sym),
        torch.from_numpy(tbl),
        torch.from_numpy(count),
        torch.from_numpy(tables.freq),
        torch.from_numpy(tables.cum),
    )
    return words.numpy().astype(np.uint16), lengths.numpy()


@pytest.mark.parametrize("seed", [0, 1])
def test_rans_round_trip_reference_and_numba_agree(seed: int) -> None:
    tables, sym, tbl, count = _streams(seed, streams=40, width=300)
    words, lengths = _ref_encode(sym, tbl, count, tables)
    words2, lengths2 = cpu_rans.encode_streams(sym, tbl, count, tables.freq, tables.cum)
    assert np.array_equal(words, words2)
    assert np.array_equal(lengths, lengths2)
    assert lengths[0] == 2  # an empty stream is its final state
    offsets = np.r_[0, np.cumsum(lengths)]
    lut = tables.lut()
    got, ok = cpu_rans.decode_streams(words, offsets, tbl, count, tables.freq, tables.cum, lut)
    got_ref, ok_ref = ref_rans.decode(
        torch.from_numpy(words.astype(np.int64)),
        torch.from_numpy(offsets),
        torch.from_numpy(tbl),
        torch.from_numpy(count),
        torch.from_numpy(tables.freq),
        torch.from_numpy(tables.cum),
        torch.from_numpy(lut),
    )
    mask = np.arange(sym.shape[1])[None, :] < count[:, None]
    assert ok.all()
    assert bool(ok_ref.all())
    assert np.array_equal(got[mask], sym[mask])
    assert np.array_equal(got_ref.numpy()[mask], sym[mask])


def test_rans_costs_the_entropy_of_its_tables() -> None:
    tables, sym, tbl, count = _streams(2, streams=20, width=4000)
    words, lengths = cpu_rans.encode_streams(sym, tbl, count, tables.freq, tables.cum)
    mask = np.arange(sym.shape[1])[None, :] < count[:, None]
    ideal = -np.log2(tables.freq[tbl[mask], sym[mask]] / TOTAL).sum()
    assert words.size * 16 <= ideal * 1.005 + 32 * len(lengths)
    # a one-symbol table costs nothing: a stream of it is only its final state
    one = np.full((1, 1000), 7)
    _, n = cpu_rans.encode_streams(
        one, np.full((1, 1000), 2), np.array([1000]), tables.freq, tables.cum
    )
    assert n[0] == 2


def test_rans_rejects_damaged_streams() -> None:
    tables, sym, tbl, count = _streams(3, streams=30, width=200)
    count[:] = 200
    words, lengths = cpu_rans.encode_streams(sym, tbl, count, tables.freq, tables.cum)
    offsets = np.r_[0, np.cumsum(lengths)]
    lut = tables.lut()
    bad = words.copy()
    bad[offsets[5] + 3] ^= 0x0101
    _, ok = cpu_rans.decode_streams(bad, offsets, tbl, count, tables.freq, tables.cum, lut)
    assert not ok[5]
    assert ok[np.arange(30) != 5].all()
    short = offsets.copy()
    short[8:] -= 1  # stream 7 one word short, stream 8 starts a word early
    _, ok = cpu_rans.decode_streams(words, short, tbl, count, tables.freq, tables.cum, lut)
    assert not ok[7]


# -- implementations agree -------------------------------------------------------------------

SHAPES = [
    ("2LTD-fp16", F.KV_2LTD, (2, 4, 37, 64), torch.float16),
    ("2LTD-bf16-odd", F.KV_2LTD, (2, 3, 161, 100), torch.bfloat16),
    ("T2D-fp32", F.KV_T2D, (37, 2, 63), torch.float32),
    ("T2D-few-tokens", F.KV_T2D, (5, 2, 64), torch.float16),
    ("2TD", F.KV_2TD, (2, 37, 64), torch.bfloat16),
    ("MLA", F.KV_MLA_FMT, (1, 3, 37, 64), torch.float32),
    ("1d", F.UNDEFINED, (1000,), torch.float16),
    ("one-token", F.KV_2LTD, (2, 2, 1, 64), torch.float32),
]


@pytest.mark.parametrize(
    ("fmt_", "shape", "dtype"), [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES]
)
def test_reference_and_numba_write_and_read_the_same_bytes(
    reference: Any, fmt_: int, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    src = kv_like(dtype, shape, seed=3)
    with reference(True):
        body_ref, info, data = encode(src, fmt_, quality=1.0)
        raw_ref = decode(body_ref, info)
    body_cpu, info_cpu, _ = encode(src, fmt_, quality=1.0)
    assert info_cpu.params == info.params
    assert body_cpu == body_ref
    assert decode(body_ref, info) == raw_ref
    assert decode(body_ref, info, into=False) == raw_ref
    got = to_object(data.meta, raw_ref)
    assert isinstance(got, torch.Tensor)
    assert got.dtype == dtype
    assert got.shape == src.shape
    assert rel_error(src, got) < 0.12


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens", [1, 2, 7, 8, 37])
def test_formats_dtypes_and_token_counts(dtype: torch.dtype, tokens: int) -> None:
    for fmt_, shape in (
        (F.KV_2LTD, (2, 3, tokens, 64)),
        (F.KV_T2D, (tokens, 2, 64)),
        (F.KV_2TD, (2, tokens, 48)),
        (F.KV_MLA_FMT, (1, 2, tokens, 32)),
    ):
        src = kv_like(dtype, shape, seed=tokens)
        body, info, data = encode(src, fmt_)
        got = to_object(data.meta, decode(body, info))
        assert isinstance(got, torch.Tensor)
        layout = layout_of(fmt_, shape)
        a, b = layout.to_canonical(src), layout.to_canonical(got)
        for p in range(layout.planes):
            assert rel_error(a[p], b[p]) <= CacheGenCodec.documented_rel_error


def test_quality_trades_size_for_error() -> None:
    src = kv_like(torch.float16, (2, 4, 64, 64))
    sizes, errors = [], []
    for quality in (0.5, 1.0, 2.0, 4.0):
        body, info, data = encode(src, quality=quality)
        sizes.append(len(body))
        errors.append(rel_error(src, to_object(data.meta, decode(body, info))))  # type: ignore[arg-type]
    assert sizes == sorted(sizes)
    assert errors == sorted(errors, reverse=True)
    assert errors[2] < 0.6 * errors[1]
    assert errors[1] < 0.6 * errors[0]


def test_options_are_validated() -> None:
    bad: dict[str, Any]
    for bad in (
        {"quality": 0},
        {"quality": -1.0},
        {"quality": float("nan")},
        {"quality": "high"},
        {"quality": True},
        {"key_bins": []},
        {"key_bins": [32, 1]},
        {"value_bins": "16"},
        {"value_bins": [16.5]},
        {"bins": 8},
    ):
        with pytest.raises(ConfigError):
            CacheGenCodec(**bad)
    codec = CacheGenCodec(quality=3, key_bins=64, value_bins=(64, 32))
    assert codec.bins == ((64,), (64, 32))


# -- special values ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0, 0.3, -1234.5])
def test_constant_tensors_come_back_exactly(value: float) -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        src = torch.full((2, 2, 40, 64), value, dtype=dtype)
        body, info, data = encode(src)
        assert info.params.get("mode") != "raw"
        assert len(body) < src.numel() * src.element_size() // 20
        got = to_object(data.meta, decode(body, info))
        assert isinstance(got, torch.Tensor)
        tol = abs(value) * 2.0**-14
        assert float((got.float() - src.float()).abs().max()) <= tol


def test_channel_constant_and_outlier_channels() -> None:
    src = kv_like(torch.float32, (2, 2, 64, 32))
    src[:, :, :, 3] = 7.25  # a constant channel with a large offset
    src[0, :, :, 5] *= 1000.0  # an outlier channel (coarser step, still within the alphabet)
    src[1, 1, 9, :] *= 50.0  # one loud token in the values
    body, info, data = encode(src)
    got = to_object(data.meta, decode(body, info))
    assert isinstance(got, torch.Tensor)
    assert float((got[0, :, :, 3] - 7.25).abs().max()) < 0.02
    assert float((got[1, 0, :, 3] - 7.25).abs().max()) < 0.02
    assert rel_error(src[0, :, :, 5], got[0, :, :, 5]) < 0.01
    normal = [c for c in range(32) if c not in (3, 5)]
    assert rel_error(src[..., normal], got[..., normal]) < 0.06
    assert rel_error(src[1, 1, 9], got[1, 1, 9]) < 0.06


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_tensors_are_stored_verbatim(bad: float) -> None:
    """NaN and infinity have no step to quantize with: the whole object is kept exactly."""
    src = kv_like(torch.float16, (2, 2, 37, 64))
    src[1, 0, 3, 5] = bad
    body, info, _ = encode(src)
    assert info.params == {"mode": "raw"}
    assert decode(body, info) == src.view(torch.uint8).numpy().tobytes()


def test_values_beyond_the_step_range_are_stored_verbatim() -> None:
    src = kv_like(torch.float32, (2, 2, 37, 64)) * 1e30
    body, info, _ = encode(src)
    assert info.params == {"mode": "raw"}
    big = kv_like(torch.float32, (2, 2, 37, 64)) * 1e20  # large, but within range
    body, info, data = encode(big)
    assert info.params.get("mode") != "raw"
    got = to_object(data.meta, decode(body, info))
    assert isinstance(got, torch.Tensor)
    assert rel_error(big, got) < CacheGenCodec.documented_rel_error


def test_tiny_tensors_are_stored_verbatim() -> None:
    src = kv_like(torch.float16, (1, 2, 8))
    body, info, _ = encode(src, F.KV_T2D)
    assert info.params == {"mode": "raw"}
    assert len(body) == src.numel() * 2


# -- corrupt and hostile payloads ----------------------------------------------------------


@pytest.fixture(scope="module")
def sample() -> tuple[bytes, FrameInfo]:
    body, info, _ = encode(kv_like(torch.float16, (2, 3, 40, 64)))
    return body, info


def _rejected(body: bytes, info: FrameInfo) -> None:
    with pytest.raises(CorruptObject):
        decode(body, info)


def test_truncated_trailing_and_damaged_payloads_are_rejected(
    sample: tuple[bytes, FrameInfo],
) -> None:
    body, info = sample
    zlen = int.from_bytes(body[:4], "little")
    for bad in (
        body[:-2],
        body[:-1],
        body + b"\x00\x00",
        body[: 4 + zlen],
        body[:3],
        b"",
        b"\xff" * len(body),
        body[:4] + b"\x00" * zlen + body[4 + zlen :],
    ):
        _rejected(bad, info)
    words = bytearray(body)
    for pos in range(4 + zlen + 1, len(body), max(1, (len(body) - zlen) // 25)):
        damaged = bytearray(words)
        damaged[pos] ^= 0x5A
        _rejected(bytes(damaged), info)


def _with_side(body: bytes, info: FrameInfo, edit: Any) -> bytes:
    """The payload with its side section decompressed, edited and recompressed."""
    import zstandard

    zlen = int.from_bytes(body[:4], "little")
    side = bytearray(zstandard.ZstdDecompressor().decompress(body[4 : 4 + zlen]))
    edit(side)
    section = zstandard.ZstdCompressor().compress(bytes(side))
    return len(section).to_bytes(4, "little") + section + body[4 + zlen :]


def test_hostile_side_information_is_rejected(sample: tuple[bytes, FrameInfo]) -> None:
    body, info = sample
    layout = layout_of(info.fmt, info.shape)
    g = geometry(layout, int(info.params["block"]))  # type: ignore[arg-type]
    pl, pld = g.planes * g.layers, g.planes * g.layers * g.channels
    cls_at = 4 * pl + pld + 4 * pld + g.layers * g.tokens
    lengths_at = cls_at + pld

    def put(at: int, raw: bytes) -> Any:
        return lambda side: side.__setitem__(slice(at, at + len(raw)), raw)

    edits = [
        put(0, np.float32(np.nan).tobytes()),  # a layer step
        put(0, np.float32(-1.0).tobytes()),
        put(0, np.float32(1e30).tobytes()),
        lambda side: (put(0, np.float32(2.0**89).tobytes())(side), put(4 * pl, bytes([127]))(side)),
        put(4 * pl + pld, np.int32(2**30).tobytes()),  # a centre
        put(4 * pl + 5 * pld, bytes([100])),  # a token factor
        put(cls_at, bytes([200])),  # a class
        put(lengths_at, np.uint32(1).tobytes()),  # a stream length
        put(lengths_at, np.uint32(10**9).tobytes()),
        lambda side: side.__delitem__(slice(len(side) - 1, None)),  # a table cut short
        lambda side: side.extend(b"\x00"),  # trailing bytes after the tables
        lambda side: side.__setitem__(
            slice(lengths_at + 4 * g.streams, lengths_at + 4 * g.streams + 2), b"\xff\xff"
        ),
    ]
    for i, edit in enumerate(edits):
        try:
            decode(_with_side(body, info, edit), info)
        except CorruptObject:
            continue
        pytest.fail(f"side edit {i} was accepted")
    assert decode(_with_side(body, info, lambda side: None), info) == decode(body, info)


def test_hostile_params_and_headers_are_rejected(sample: tuple[bytes, FrameInfo]) -> None:
    body, info = sample
    for params in (
        {},
        {"v": 2, "block": info.params["block"]},
        {"v": 1},
        {"v": 1, "block": 0},
        {"v": 1, "block": 65},
        {"v": 1, "block": 3},
        {"v": 1, "block": "8"},
    ):
        _rejected(body, msgspec.structs.replace(info, params=params))
    for shape in ([2, 3, 41, 64], [2, 3, 40, 32], [2, 6, 40, 32]):
        raw_len = int(np.prod(shape)) * 2
        _rejected(body, msgspec.structs.replace(info, shape=shape, raw_len=raw_len))
    _rejected(body, msgspec.structs.replace(info, raw_len=info.raw_len + 2))
    _rejected(body, msgspec.structs.replace(info, dtype="int16"))


# -- size: close to the entropy --------------------------------------------------------------


def test_payload_is_close_to_the_empirical_entropy_of_its_symbols() -> None:
    """The coder wastes < 1 % over the entropy of the symbols under the codec's own context
    partition; tables and side information stay a small fraction of the payload."""
    sample = synthetic_kv(layers=4, tokens=256, hidden=256)
    kv = sample.kv
    body, _, _ = encode(kv)
    layout = layout_of(F.KV_2LTD, tuple(kv.shape))
    g = geometry(layout, default_block(layout))
    cpu = kernels("cpu")
    view = layout.to_canonical(kv).reshape(g.shape)
    mean, var, tms = (a.numpy() for a in cpu.stats(view))
    side = plan(g, mean, var, tms, BINS, CacheGenCodec().quality)
    sym, _, sumsq = cpu.quantize(view, *(torch.from_numpy(a) for a in side.steps(g).quantizer()))
    cls = classes_from_sumsq(sumsq.numpy(), g.tokens)
    counts = cpu.histogram(sym, torch.from_numpy(cls)).numpy()
    nz = counts[counts > 0]
    totals = np.repeat(counts.sum(axis=1), (counts > 0).sum(axis=1))
    entropy_bits = float(-(nz * np.log2(nz / totals)).sum())
    parsed = fmt.unpack(g, memoryview(body))
    words_bits = parsed.words.size * 16
    assert words_bits <= entropy_bits * 1.01 + 32 * g.streams
    side_bytes = len(body) - 2 * parsed.words.size  # zstd'd side information and tables
    assert side_bytes < 0.04 * len(body)
    assert from_counts(counts, g.planes).nbytes() < 0.025 * len(body)  # ~7 kB, whatever the size
    assert kv.numel() * 2 / len(body) > 3.0


# -- GPU --------------------------------------------------------------------------------------


def _cuda_or_skip() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from gpu import dispatch

    if not dispatch.has_cupy():
        pytest.skip("cupy is not installed")


@pytest.mark.gpu
def test_cuda_kernels_match_the_reference() -> None:
    _cuda_or_skip()
    cuda, ref = kernels("cuda"), kernels("reference")
    src = kv_like(torch.bfloat16, (40, 2, 64)).cuda()  # KV_T2D: a strided view
    layout = layout_of(F.KV_T2D, tuple(src.shape))
    g = geometry(layout, default_block(layout))
    view = layout.to_canonical(src).reshape(g.shape)
    mean, var, tms = (a.cpu().numpy() for a in ref.stats(view))
    side = plan(g, mean, var, tms, BINS, 1.0)
    steps = [torch.from_numpy(a).cuda() for a in side.steps(g).quantizer()]
    got = cuda.quantize(view, *steps)
    want = ref.quantize(view, *steps)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.cpu(), b.cpu())
    sym, _, sumsq = want
    side.cls = classes_from_sumsq(sumsq.cpu().numpy(), g.tokens)
    cls = torch.from_numpy(side.cls).cuda()
    tables = from_counts(ref.histogram(sym, cls).cpu().numpy(), g.planes)
    words, lengths = cuda.encode(sym, cls, tables, g.block)
    words_ref, lengths_ref = ref.encode(sym.cpu(), cls.cpu(), tables, g.block)
    assert np.array_equal(words, words_ref)
    assert np.array_equal(lengths, lengths_ref)
    offsets = np.r_[0, np.cumsum(lengths)]
    steps_d = side.steps(g).dequantizer()
    x_gpu, ok_gpu = cuda.decode(words, offsets, side.cls, tables, g.block, *steps_d)
    x_ref, ok_ref = ref.decode(words, offsets, side.cls, tables, g.block, *steps_d)
    assert ok_gpu
    assert ok_ref
    assert torch.equal(x_gpu.cpu(), x_ref.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt_", [F.KV_2LTD, F.KV_T2D])
def test_a_cuda_tensor_encodes_to_the_same_bytes_as_on_the_cpu(fmt_: int) -> None:
    _cuda_or_skip()
    shape = (2, 3, 37, 64) if fmt_ == F.KV_2LTD else (37, 2, 64)
    src = kv_like(torch.float16, shape)
    body_cpu, info, _ = encode(src, fmt_)
    body_gpu, info_gpu, _ = encode(src.cuda(), fmt_)
    assert info_gpu.params == info.params
    assert body_gpu == body_cpu
