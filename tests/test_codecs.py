"""One round-trip suite over every registered codec (lossless ones must be exact)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gateway.errors import ConfigError, CorruptObject
from gateway.frame import decode_frame, encode_header
from gateway.objects import ObjectData, to_object, to_object_data
from gateway.registry import codec_status, load_codec

CODECS = [s.name for s in codec_status() if s.usable]
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


def kv_like(dtype: torch.dtype, shape: tuple[int, ...] = (2, 4, 37, 64)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(shape, generator=g) * 0.5).to(dtype)


def round_trip(name: str, data: ObjectData) -> tuple[object, int]:
    codec = load_codec(name)
    payload, params = codec.encode(data)
    meta = data.meta
    head, _ = encode_header(
        codec=name,
        kind=meta.kind,
        dtype=meta.dtype,
        shape=meta.shape,
        raw_len=meta.nbytes,
        payload=payload,
        params=params,
        fmt=meta.fmt,
    )
    blob = head + b"".join(
        bytes(memoryview(p))
        for p in ([payload] if isinstance(payload, bytes | bytearray | memoryview) else payload)
    )
    header, body = decode_frame(blob)
    out = bytearray(header.raw_len)
    raw = codec.decode(body, header, memoryview(out))
    return to_object(meta, raw), len(blob)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lossless_round_trip_every_dtype(name: str, dtype: torch.dtype) -> None:
    if not load_codec(name).lossless:
        pytest.skip("lossy codecs have their own error bounds")
    src = kv_like(dtype)
    got, _ = round_trip(name, to_object_data(src, fmt=1))
    assert isinstance(got, torch.Tensor)
    assert torch.equal(got.view(torch.uint8), src.view(torch.uint8))


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize(
    "obj", [b"", b"abc" * 1000, np.arange(100, dtype=np.float32)], ids=["empty", "bytes", "ndarray"]
)
def test_round_trip_other_kinds(name: str, obj: object) -> None:
    got, _ = round_trip(name, to_object_data(obj))
    assert type(got) is type(obj)
    assert bytes(memoryview(got)) == bytes(memoryview(obj))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", CODECS)
def test_decode_without_out_buffer(name: str) -> None:
    codec = load_codec(name)
    data = to_object_data(b"hello world" * 100)
    payload, params = codec.encode(data)
    _head, header = encode_header(
        codec=name,
        kind="bytes",
        dtype="uint8",
        shape=[1100],
        raw_len=1100,
        payload=payload,
        params=params,
    )
    assert bytes(codec.decode(memoryview(bytes(memoryview(payload))), header, None)) == (
        b"hello world" * 100
    )


@pytest.mark.parametrize("name", CODECS)
def test_truncated_or_garbage_payload_is_rejected(name: str) -> None:
    codec = load_codec(name)
    data = to_object_data(b"0123456789" * 1000)
    payload, params = codec.encode(data)
    body = bytes(memoryview(payload))
    _, header = encode_header(
        codec=name,
        kind="bytes",
        dtype="uint8",
        shape=[10_000],
        raw_len=10_000,
        payload=body,
        params=params,
    )
    for bad in (body[: len(body) // 2], b"\x00" * 50, body + b"extra"):
        with pytest.raises(CorruptObject):
            codec.decode(memoryview(bad), header, memoryview(bytearray(10_000)))


def test_zstd_shrinks_repetitive_data_and_validates_options() -> None:
    _, size = round_trip("zstd", to_object_data(b"a" * 100_000))
    assert size < 1000
    with pytest.raises(ConfigError):
        load_codec("zstd", level=99)
    with pytest.raises(ConfigError):
        load_codec("zstd", nope=1)
    with pytest.raises(ConfigError):
        load_codec("raw", level=1)
