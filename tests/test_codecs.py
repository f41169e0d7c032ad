"""One round-trip suite over every registered codec (lossless ones must be exact).

Every test is parametrized over ``codec_status()``, so a new codec joins by registering its
entry point. A codec that is registered but does not import FAILS here (a missing module of
kvgate itself, a syntax error); only a missing optional dependency (``MissingDependency`` for a
third-party module) skips. Lossy codecs (``lossless = False``) must stay within their
``documented_rel_error`` (relative Frobenius error of each plane, keys and values, on
``kv_like`` data) and must store anything they cannot quantize (bytes, integer and fp8
tensors) exactly.

Codec chains (``CHAINS``: a lossless and a lossy codec followed by ``aesgcm``, and ``aesgcm``
followed by a compressor) run the same suite. Keyed codecs (``aesgcm``) get a test key file and
every frame is bound to ``OBJECT_KEY``, as a tier binds it (``keyed_codecs.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from keyed_codecs import OBJECT_KEY, build, reader_codec, tier_codec

from gateway import Store
from gateway.codec import Codec, decode_payload, encode_frame
from gateway.codec_chain import stage_names
from gateway.errors import ConfigError, CorruptObject, MissingDependency
from gateway.frame import FrameInfo, decode_frame
from gateway.objects import ObjectData, to_object, to_object_data
from gateway.registry import codec_class, codec_status, load_codec
from gateway.types import Buffer, MemoryFormat, ParamValue
from serde.layout import layout_of

REGISTERED = [s.name for s in codec_status()]
CODECS = [s.name for s in codec_status() if s.usable]  # for tests of other helpers' files
CHAINS = ["bytesplit+aesgcm", "fp8+aesgcm", "aesgcm+zstd"]
OWN_PACKAGES = ("gateway", "serde", "gpu", "connectors")
FLOATS = [torch.float16, torch.bfloat16, torch.float32]
DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
F = MemoryFormat
# (id, memory format, shape): the KV formats, generic tensors, and formats that do not fit.
FORMATS = [
    ("2LTD", F.KV_2LTD, (2, 3, 37, 64)),
    ("T2D", F.KV_T2D, (37, 2, 64)),
    ("2TD", F.KV_2TD, (2, 37, 64)),
    ("MLA", F.KV_MLA_FMT, (1, 3, 37, 64)),
    ("1d", F.UNDEFINED, (1000,)),
    ("2d", F.UNDEFINED, (37, 64)),
    ("2d-odd-channels", F.UNDEFINED, (37, 63)),
    ("3d", F.UNDEFINED, (3, 37, 64)),
    ("2LTD-misfit", F.KV_2LTD, (3, 37, 64)),
    ("T2D-misfit", F.KV_T2D, (37, 3, 64)),
    ("MLA-misfit", F.KV_MLA_FMT, (2, 3, 37, 64)),
]


def kv_like(dtype: torch.dtype, shape: tuple[int, ...] = (2, 4, 37, 64)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(shape, generator=g) * 0.5).to(dtype)


def _missing_module(exc: BaseException) -> str | None:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ModuleNotFoundError):
            return cause.name
        cause = cause.__cause__ or cause.__context__
    return None


def codec_or_skip(name: str, **options: Any) -> Codec:
    """The codec, or a failure if it is registered but broken; a skip if an extra is missing.

    ``name`` may be a chain (``bytesplit+aesgcm``); keyed stages get the test key file."""
    for stage in stage_names(name):
        try:
            codec_class(stage)
        except MissingDependency as exc:
            missing = _missing_module(exc)
            if missing is not None and missing.partition(".")[0] in OWN_PACKAGES:
                pytest.fail(f"codec {stage!r} is registered but {missing} does not exist: {exc}")
            pytest.skip(str(exc))
        except Exception as exc:
            pytest.fail(f"codec {stage!r} is registered but does not import: {exc!r}")
    return build(name, **options)


@pytest.fixture(params=REGISTERED + CHAINS)
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def encode(codec: Codec, data: ObjectData) -> tuple[bytes, FrameInfo]:
    """The codec's payload (joined) and the frame header a tier would write with it."""
    _, parts, header = encode_frame(codec, data, OBJECT_KEY)
    return b"".join(bytes(p) for p in parts), header


def decode(codec: Codec, body: bytes, header: FrameInfo, out: memoryview | None) -> Buffer:
    """``codec.decode``, given the key the frame was bound to (keyed codecs need it)."""
    return decode_payload(codec, memoryview(body), header, out, OBJECT_KEY)


def round_trip(name: str | Codec, data: ObjectData, **options: Any) -> tuple[object, int]:
    """Through the whole frame, as a tier does: the decoded object and the blob size."""
    codec = build(name, **options) if isinstance(name, str) else name
    head, parts, _ = encode_frame(codec, data, OBJECT_KEY)
    meta = data.meta
    blob = head + b"".join(bytes(p) for p in parts)
    header, body = decode_frame(blob, key=OBJECT_KEY)
    out = bytearray(header.raw_len)
    raw = decode_payload(codec, body, header, memoryview(out), OBJECT_KEY)
    assert memoryview(raw).nbytes == header.raw_len
    return to_object(meta, raw), len(blob)


def plane_errors(src: torch.Tensor, got: torch.Tensor, fmt: int) -> list[float]:
    """Relative Frobenius error of each canonical plane (keys, values) of ``got``."""
    layout = layout_of(fmt, tuple(src.shape))
    a = layout.to_canonical(src).float()
    b = layout.to_canonical(got).float()
    return [
        float(torch.linalg.vector_norm(b[p] - a[p]) / torch.linalg.vector_norm(a[p]))
        for p in range(layout.planes)
    ]


def check_tensor(codec: Codec, src: torch.Tensor, fmt: int = F.KV_2LTD) -> None:
    """Exact for lossless codecs and for what cannot be quantized; else within the bound."""
    got, _ = round_trip(codec, to_object_data(src, fmt=fmt))
    assert isinstance(got, torch.Tensor)
    assert got.dtype == src.dtype
    assert got.shape == src.shape
    if codec.lossless or src.dtype not in FLOATS:
        assert torch.equal(got.view(torch.uint8), src.view(torch.uint8))
        return
    bound = codec.documented_rel_error  # type: ignore[attr-defined]
    errors = plane_errors(src, got, fmt)
    assert max(errors) <= bound, f"plane errors {errors} over the documented {bound}"


# -- the codec itself ------------------------------------------------------------------


def test_registered_codec_is_usable_and_well_formed(name: str) -> None:
    codec = codec_or_skip(name)
    assert isinstance(codec, Codec)
    assert codec.name == name
    assert isinstance(codec.lossless, bool)
    if not codec.lossless:
        bound = getattr(codec, "documented_rel_error", None)
        assert isinstance(bound, float), bound
        assert 0 < bound < 1, bound
    with pytest.raises(ConfigError, match="nope"):
        build(name, nope=1)


# -- floating-point KV data ------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype(name: str, dtype: torch.dtype) -> None:
    """Lossless codecs exact; lossy ones within their bound on float16, bfloat16 and float32
    and exact on every other dtype (stored verbatim)."""
    check_tensor(codec_or_skip(name), kv_like(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("fmt", "shape"), [f[1:] for f in FORMATS], ids=[f[0] for f in FORMATS])
def test_every_memory_format(
    name: str, fmt: int, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    codec = codec_or_skip(name)
    check_tensor(codec, kv_like(dtype, shape), fmt)


@pytest.mark.parametrize("tokens", [1, 37, 161])
def test_token_counts_not_a_multiple_of_the_group(name: str, tokens: int) -> None:
    codec = codec_or_skip(name)
    check_tensor(codec, kv_like(torch.float16, (2, 2, tokens, 64)))
    check_tensor(codec, kv_like(torch.float32, (tokens, 2, 64)), F.KV_T2D)


def test_float_ndarray(name: str) -> None:
    codec = codec_or_skip(name)
    src = kv_like(torch.float32, (2, 2, 37, 64)).numpy()
    got, _ = round_trip(codec, to_object_data(src, fmt=F.KV_2LTD))
    assert isinstance(got, np.ndarray)
    assert got.dtype == src.dtype
    assert got.shape == src.shape
    if codec.lossless:
        np.testing.assert_array_equal(got, src)
    else:
        errors = plane_errors(torch.from_numpy(src), torch.from_numpy(got.copy()), F.KV_2LTD)
        assert max(errors) <= codec.documented_rel_error  # type: ignore[attr-defined]


# -- what a lossy codec must store verbatim --------------------------------------------


def _int_kv(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(-100, 100, (2, 2, 37, 64), generator=g).to(dtype)


NON_FLOAT: list[tuple[str, object]] = [
    ("bytes", b"abc" * 1000),
    ("bytearray", bytearray(b"xyz" * 333)),
    ("memoryview", memoryview(b"0123456789" * 10)),
    ("int8", _int_kv(torch.int8)),
    ("uint8", _int_kv(torch.int16).to(torch.uint8)),
    ("int32", _int_kv(torch.int32)),
    ("int64", _int_kv(torch.int64)),
    ("bool", _int_kv(torch.int8) > 0),
    ("fp8-e4m3", kv_like(torch.float8_e4m3fn)),
    ("fp8-e5m2", kv_like(torch.float8_e5m2)),
    ("float64", kv_like(torch.float64)),
    ("ndarray-int32", np.arange(2 * 37 * 64, dtype=np.int32).reshape(2, 37, 64)),
    ("ndarray-float64", np.linspace(-1, 1, 1000)),
]


@pytest.mark.parametrize("obj", [o for _, o in NON_FLOAT], ids=[i for i, _ in NON_FLOAT])
@pytest.mark.parametrize("fmt", [F.UNDEFINED, F.KV_2LTD], ids=["generic", "2LTD"])
def test_non_float_objects_are_exact(name: str, obj: object, fmt: int) -> None:
    codec = codec_or_skip(name)
    got, _ = round_trip(codec, to_object_data(obj, fmt=fmt))
    assert type(got) is type(obj)
    if isinstance(obj, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert got.dtype == obj.dtype
        assert torch.equal(got.view(torch.uint8), obj.view(torch.uint8))
    elif isinstance(obj, np.ndarray):
        assert isinstance(got, np.ndarray)
        assert got.dtype == obj.dtype
        np.testing.assert_array_equal(got, obj)
    else:
        assert bytes(memoryview(got)) == bytes(memoryview(obj))  # type: ignore[arg-type]


EMPTY: list[tuple[str, object, int]] = [
    ("bytes", b"", F.UNDEFINED),
    ("fp16", torch.empty(0, dtype=torch.float16), F.UNDEFINED),
    ("bf16-2LTD", torch.empty((2, 3, 0, 64), dtype=torch.bfloat16), F.KV_2LTD),
    ("fp32-no-channels", torch.empty((2, 3, 5, 0), dtype=torch.float32), F.KV_2LTD),
    ("ndarray", np.empty((0, 8), dtype=np.float32), F.UNDEFINED),
]


@pytest.mark.parametrize(("obj", "fmt"), [e[1:] for e in EMPTY], ids=[e[0] for e in EMPTY])
def test_empty_objects(name: str, obj: object, fmt: int) -> None:
    codec = codec_or_skip(name)
    got, _ = round_trip(codec, to_object_data(obj, fmt=fmt))
    assert type(got) is type(obj)
    if isinstance(obj, torch.Tensor | np.ndarray):
        assert isinstance(got, torch.Tensor | np.ndarray)
        assert got.shape == obj.shape
        assert got.dtype == obj.dtype
    else:
        assert got == obj


# -- the decode contract ---------------------------------------------------------------

SAMPLES: list[tuple[str, object]] = [
    ("bytes", b"0123456789" * 1000),
    ("fp16-kv", kv_like(torch.float16)),
    ("bf16-kv", kv_like(torch.bfloat16)),
]


@pytest.mark.parametrize("obj", [o for _, o in SAMPLES], ids=[i for i, _ in SAMPLES])
def test_decode_without_out_buffer(name: str, obj: object) -> None:
    codec = codec_or_skip(name)
    body, header = encode(codec, to_object_data(obj, fmt=F.KV_2LTD))
    into = bytearray(header.raw_len)
    with_out = decode(codec, body, header, memoryview(into))
    without = decode(codec, body, header, None)
    assert memoryview(without).nbytes == header.raw_len
    assert bytes(memoryview(without)) == bytes(memoryview(with_out))


@pytest.mark.parametrize("obj", [o for _, o in SAMPLES], ids=[i for i, _ in SAMPLES])
def test_truncated_garbage_or_trailing_payload_is_rejected(name: str, obj: object) -> None:
    codec = codec_or_skip(name)
    body, header = encode(codec, to_object_data(obj, fmt=F.KV_2LTD))
    rng = np.random.default_rng(0)
    bad_payloads = {
        "half": body[: len(body) // 2],
        "one byte short": body[:-1],
        "empty": b"",
        "zeros": b"\x00" * 50,
        "random": rng.bytes(57),
        "trailing": body + b"extra",
        "one trailing zero": body + b"\x00",
    }
    for what, bad in bad_payloads.items():
        try:
            decode(codec, bad, header, memoryview(bytearray(header.raw_len)))
        except CorruptObject:
            continue
        pytest.fail(f"a {what} payload was accepted")


def _decodes_safely(codec: Codec, body: bytes, header: FrameInfo) -> None:
    """A hostile payload or header: CorruptObject, or exactly ``raw_len`` bytes back."""
    try:
        raw = decode(codec, body, header, memoryview(bytearray(header.raw_len)))
    except CorruptObject:
        return
    assert memoryview(raw).nbytes == header.raw_len


@pytest.mark.parametrize("obj", [o for _, o in SAMPLES], ids=[i for i, _ in SAMPLES])
def test_same_length_garbage_never_crashes(name: str, obj: object) -> None:
    codec = codec_or_skip(name)
    body, header = encode(codec, to_object_data(obj, fmt=F.KV_2LTD))
    rng = np.random.default_rng(1)
    for garbage in (rng.bytes(len(body)), b"\xff" * len(body), b"\x00" * len(body)):
        _decodes_safely(codec, garbage, header)


HOSTILE: list[ParamValue] = [None, -1, 0, 2**31 + 7, 2**62, "x", 1.5, True, [1, 2]]


def test_hostile_params_never_crash(name: str) -> None:
    codec = codec_or_skip(name)
    body, header = encode(codec, to_object_data(kv_like(torch.float16), fmt=F.KV_2LTD))
    variants: list[dict[str, ParamValue]] = [{}, {"mode": "raw"}, {**header.params, "x": 1}]
    for key in header.params:
        variants.append({k: v for k, v in header.params.items() if k != key})
        variants += [{**header.params, key: value} for value in HOSTILE]
    for params in variants:
        _decodes_safely(codec, body, _replace(header, params=params))


def test_hostile_header_never_crashes(name: str) -> None:
    codec = codec_or_skip(name)
    src = kv_like(torch.float16)
    body, header = encode(codec, to_object_data(src, fmt=F.KV_2LTD))
    n = src.numel()
    for dtype, shape, fmt in [
        ("int32", [n // 2], F.UNDEFINED),  # a lossy frame claiming a non-float dtype
        ("float32", [n // 2], F.UNDEFINED),  # the same bytes, another float dtype
        ("float16", [2, 4, 38, 64], F.KV_2LTD),  # one token more than encoded
        ("float16", [2, 4, 36, 64], F.KV_2LTD),
        ("float16", [4 * 37, 2, 64], F.KV_T2D),  # the same numel in another layout
        ("float16", [n], F.UNDEFINED),
    ]:
        itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        raw_len = int(np.prod(shape)) * itemsize
        hostile = _replace(header, dtype=dtype, shape=shape, fmt=fmt, raw_len=raw_len)
        _decodes_safely(codec, body, hostile)


def _replace(header: FrameInfo, **changes: Any) -> FrameInfo:
    return msgspec.structs.replace(header, **changes)


# -- through a Store ---------------------------------------------------------------------


def _store_config(root: Path, codec: dict[str, Any]) -> dict[str, Any]:
    return {"tiers": [{"url": f"file://{root}", **codec}], "staging": 8 << 20}


STORED: list[tuple[str, object, int]] = [
    ("kv", kv_like(torch.float16, (2, 3, 40, 64)), F.KV_2LTD),
    ("kv-t2d-bf16", kv_like(torch.bfloat16, (40, 2, 64)), F.KV_T2D),
    ("bytes", b"hello" * 500, F.UNDEFINED),
    ("int32", _int_kv(torch.int32), F.KV_2LTD),
    ("ndarray", kv_like(torch.float32, (20, 30)).numpy(), F.UNDEFINED),
]


def _check_stored(writer: str, got: object, obj: object, fmt: int) -> None:
    assert type(got) is type(obj)
    if not isinstance(obj, torch.Tensor | np.ndarray):
        assert got == obj
        return
    src = obj if isinstance(obj, torch.Tensor) else torch.from_numpy(obj)
    out = got if isinstance(got, torch.Tensor) else torch.from_numpy(np.array(got))
    assert out.dtype == src.dtype
    assert out.shape == src.shape
    codec = build(writer)
    if codec.lossless or src.dtype not in FLOATS:
        assert torch.equal(out.view(torch.uint8), src.view(torch.uint8))
    else:
        bound = codec.documented_rel_error  # type: ignore[attr-defined]
        assert max(plane_errors(src, out, fmt)) <= bound


async def test_store_reads_what_another_codec_wrote(name: str, tmp_path: Path) -> None:
    """A tier configured with codec A writes; a Store whose tier uses codec B reads it back:
    the frame names the codec, so a store reads every object whatever codec wrote it."""
    codec_or_skip(name)
    root = tmp_path / "disk"
    async with Store(_store_config(root, tier_codec(name))) as store:
        for key, obj, fmt in STORED:
            await store.put(key, obj, fmt=fmt)
    async with Store(_store_config(root, reader_codec(name))) as store:
        for key, obj, fmt in STORED:
            _check_stored(name, await store.get(key), obj, fmt)


async def test_one_store_reads_objects_of_every_codec(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    usable = [n for n in REGISTERED + CHAINS if all(s in CODECS for s in stage_names(n))]
    for writer in usable:
        async with Store(_store_config(root, tier_codec(writer))) as store:
            await store.put(f"{writer}/kv", STORED[0][1], fmt=STORED[0][2])
    # zstd with aesgcm's keys: reads every frame (a configured stage decrypts them all)
    reader = reader_codec("aesgcm") if "aesgcm" in CODECS else {"codec": "zstd"}
    async with Store(_store_config(root, reader)) as store:
        for writer in usable:
            _check_stored(writer, await store.get(f"{writer}/kv"), STORED[0][1], STORED[0][2])


def test_zstd_shrinks_repetitive_data_and_validates_options() -> None:
    _, size = round_trip("zstd", to_object_data(b"a" * 100_000))
    assert size < 1000
    with pytest.raises(ConfigError):
        load_codec("zstd", level=99)
    with pytest.raises(ConfigError):
        load_codec("zstd", nope=1)
    with pytest.raises(ConfigError):
        load_codec("raw", level=1)
