"""``lz4`` and ``bytesplit``: exact round trips, block tables, hostile payloads, options."""

from __future__ import annotations

import struct
import threading
from typing import Any

import numpy as np
import pytest
import torch

from gateway.codec import Codec, encode_frame
from gateway.errors import ConfigError, CorruptObject
from gateway.frame import FrameInfo, decode_frame, encode_header
from gateway.objects import ObjectData, to_object, to_object_data
from gateway.registry import load_codec
from gateway.types import ParamValue
from serde.blocks import run_blocks

NAMES = ["lz4", "bytesplit"]
SMALL = 4096  # the smallest block size: many blocks from small objects
DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.uint16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
]


def encode(codec: Codec, data: ObjectData) -> tuple[bytes, FrameInfo]:
    """The codec's payload (joined) and the frame header a tier would write with it."""
    _, parts, header = encode_frame(codec, data)
    return b"".join(bytes(p) for p in parts), header


def round_trip(codec: Codec, obj: object) -> tuple[object, int]:
    """Through a whole frame, as a tier does: the decoded object and the payload size."""
    data = to_object_data(obj)
    head, parts, _ = encode_frame(codec, data)
    body = b"".join(bytes(p) for p in parts)
    info, payload = decode_frame(head + body)
    out = bytearray(info.raw_len)
    raw = codec.decode(payload, info, memoryview(out))
    assert memoryview(raw).nbytes == info.raw_len
    return to_object(data.meta, raw), len(body)


def with_params(info: FrameInfo, **params: ParamValue) -> FrameInfo:
    _, header = encode_header(
        codec=info.codec,
        kind=info.kind,
        dtype=info.dtype,
        shape=info.shape,
        raw_len=info.raw_len,
        payload=b"",
        params={**info.params, **params},
        fmt=info.fmt,
    )
    return header


def with_raw_len(info: FrameInfo, raw_len: int) -> FrameInfo:
    _, header = encode_header(
        codec=info.codec,
        kind="bytes",
        dtype="uint8",
        shape=[raw_len],
        raw_len=raw_len,
        payload=b"",
        params=info.params,
    )
    return header


@pytest.fixture(
    params=[(n, b) for n in NAMES for b in (None, SMALL)], ids=lambda p: f"{p[0]}-{p[1]}"
)
def codec(request: pytest.FixtureRequest) -> Codec:
    name, block = request.param
    return load_codec(name) if block is None else load_codec(name, block_size=block)


def tensor_of(dtype: torch.dtype, shape: tuple[int, ...] = (2, 3, 37, 129)) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.3
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 0.5).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_exactly(codec: Codec, dtype: torch.dtype) -> None:
    src = tensor_of(dtype)
    got, _ = round_trip(codec, src)
    assert isinstance(got, torch.Tensor)
    assert (got.dtype, got.shape) == (dtype, src.shape)
    assert torch.equal(got.view(torch.uint8), src.view(torch.uint8))


@pytest.mark.parametrize("dtype", [np.float16, np.int16, np.uint16, np.float32, np.int64])
def test_ndarrays_round_trip_exactly(codec: Codec, dtype: Any) -> None:
    src = (np.random.default_rng(2).standard_normal((37, 33)) * 100).astype(dtype)
    got, _ = round_trip(codec, src)
    assert isinstance(got, np.ndarray)
    assert got.dtype == src.dtype
    assert got.tobytes() == src.tobytes()


@pytest.mark.parametrize("size", [0, 1, 2, 3, 4095, 4096, 4097, 3 * 4096 + 7, 100_001])
def test_bytes_of_any_length(codec: Codec, size: int) -> None:
    rng = np.random.default_rng(size)
    src = bytes(rng.integers(0, 4, size, dtype=np.uint8))  # compressible, odd lengths
    got, _ = round_trip(codec, src)
    assert got == src


def test_empty_tensor(codec: Codec) -> None:
    src = torch.empty((2, 0, 5), dtype=torch.bfloat16)
    got, size = round_trip(codec, src)
    assert isinstance(got, torch.Tensor)
    assert (got.shape, size) == (src.shape, 0)


def test_incompressible_data_is_stored_raw(codec: Codec) -> None:
    src = np.random.default_rng(3).integers(0, 256, 300_001, dtype=np.uint8).tobytes()
    got, size = round_trip(codec, src)
    assert got == src
    blocks = -(-len(src) // codec.block_size)  # type: ignore[attr-defined]
    assert size == len(src) + 4 * blocks  # the block table and the raw bytes, nothing more


def test_compressible_data_shrinks(codec: Codec) -> None:
    src = b"kvgate " * 50_000
    got, size = round_trip(codec, src)
    assert got == src
    assert size < len(src) // 20


def test_decode_without_out_buffer(codec: Codec) -> None:
    src = tensor_of(torch.float32, (5, 1001))
    body, info = encode(codec, to_object_data(src))
    raw = codec.decode(memoryview(body), info, None)
    assert bytes(raw) == src.numpy().tobytes()


def test_bytesplit_planes_follow_the_item_size() -> None:
    codec = load_codec("bytesplit")
    for obj, planes in [
        (torch.zeros(8, dtype=torch.bfloat16), 2),
        (torch.zeros(8, dtype=torch.int16), 2),
        (torch.zeros(8, dtype=torch.float32), 4),
        (torch.zeros(8, dtype=torch.int64), 8),
        (torch.zeros(8, dtype=torch.uint8), 1),
        (torch.zeros(8, dtype=torch.float8_e4m3fn), 1),
        (b"12345678", 1),
    ]:
        _, params = codec.encode(to_object_data(obj))
        assert params == {"block": 4 << 20, "planes": planes}


def test_bytesplit_stores_high_bytes_first() -> None:
    # High bytes all 0x3F (compressible), low bytes random (stored raw, as the last piece).
    low = np.random.default_rng(4).integers(0, 256, 10_000, dtype=np.uint16)
    src = (np.uint16(0x3F00) | low).astype(np.uint16)
    body, _ = encode(load_codec("bytesplit"), to_object_data(src))
    sizes = struct.unpack_from("<2I", body)
    assert sizes[0] < 100
    assert sizes[1] == 10_000
    assert body[8 + sizes[0] :] == src.astype("<u2").view(np.uint8)[0::2].tobytes()


def test_bytesplit_beats_zstd_on_bf16_kv() -> None:
    from gateway.bench.kv_samples import synthetic_kv

    kv = synthetic_kv(layers=4, dtype=torch.bfloat16).kv
    got, split = round_trip(load_codec("bytesplit"), kv)
    assert isinstance(got, torch.Tensor)
    assert torch.equal(got, kv)
    _, plain = round_trip(load_codec("zstd"), kv)
    assert kv.nbytes / split >= 1.4 > kv.nbytes / plain


def test_concurrent_encodes_and_decodes(codec: Codec) -> None:
    objects = [tensor_of(torch.bfloat16, (3, 37, 100 + i)) for i in range(6)]
    results: list[bool] = []

    def work(src: torch.Tensor) -> None:
        for _ in range(3):
            got, _ = round_trip(codec, src)
            results.append(isinstance(got, torch.Tensor) and torch.equal(got, src))

    threads = [threading.Thread(target=work, args=(o,)) for o in objects]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 18


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_objects_above_256_mib(name: str) -> None:
    n = (256 << 20) + 12_345
    src = np.zeros(n, dtype=np.uint8)
    src[::4097] = np.arange(src[::4097].size, dtype=np.uint64).astype(np.uint8)
    codec = load_codec(name)
    body, info = encode(codec, to_object_data(src))
    assert len(body) < n // 100
    out = np.empty(n, dtype=np.uint8)
    codec.decode(memoryview(body), info, out.data)
    assert np.array_equal(out, src)


# --- malformed payloads: always CorruptObject, never a crash or an oversized allocation ---


def _sample(codec: Codec) -> tuple[bytes, FrameInfo]:
    words = [b"keys ", b"values ", b"layer ", b"token ", b"chunk ", b"cache ", b"hash "]
    picks = np.random.default_rng(5).integers(0, len(words), 3 * SMALL)
    src = b"".join(words[i] for i in picks)[: 3 * SMALL + 100]
    return encode(codec, to_object_data(src))


def test_truncated_garbage_and_trailing_payloads(codec: Codec) -> None:
    body, info = _sample(codec)
    out = memoryview(bytearray(info.raw_len))
    for bad in (body[:-1], body[: len(body) // 2], body[:3], b"", b"\x00" * 50, body + b"\x00"):
        with pytest.raises(CorruptObject):
            codec.decode(memoryview(bad), info, out)


def _pieces(info: FrameInfo) -> int:
    block = info.params["block"]
    assert isinstance(block, int)
    return -(-info.raw_len // block)


def test_damaged_compressed_piece(codec: Codec) -> None:
    body, info = _sample(codec)
    table_len = 4 * _pieces(info)
    first = struct.unpack_from("<I", body)[0]
    block = info.params["block"]
    assert isinstance(block, int)
    assert first < 0.8 * min(block, info.raw_len)  # compressed, not raw
    damaged = body[:table_len] + b"\x00" * first + body[table_len + first :]
    with pytest.raises(CorruptObject):
        codec.decode(memoryview(damaged), info, None)


def test_hostile_block_tables(codec: Codec) -> None:
    body, info = _sample(codec)
    n = _pieces(info)
    sizes = list(struct.unpack_from(f"<{n}I", body))
    rest = body[4 * n :]
    raw_first = min(int(info.params["block"]), info.raw_len)  # type: ignore[arg-type]
    # A piece that claims more than its block, with the payload grown to match the claim.
    table = struct.pack(f"<{n}I", raw_first + 1, *sizes[1:])
    grown = table + rest + bytes(raw_first + 1 - sizes[0])
    with pytest.raises(CorruptObject, match="larger than its block"):
        codec.decode(memoryview(grown), info, None)
    # A claim of 4 GiB, and sizes that do not add up to the payload.
    for first in (0xFFFFFFFF, sizes[0] - 1, sizes[0] + 1):
        table = struct.pack(f"<{n}I", first, *sizes[1:])
        with pytest.raises(CorruptObject):
            codec.decode(memoryview(table + rest), info, None)


def test_hostile_frame_params(codec: Codec) -> None:
    body, info = _sample(codec)
    bad_params: list[dict[str, ParamValue]] = [
        {"block": 100},
        {"block": None},
        {"block": 1 << 31},
        {"block": True},
        {"planes": 3},
        {"planes": 0},
        {"planes": 64},
    ]
    for params in bad_params:
        with pytest.raises(CorruptObject):
            codec.decode(memoryview(body), with_params(info, **params), None)
    # Planes that do not divide the object, and a block size other than the writer's.
    with pytest.raises(CorruptObject):
        codec.decode(memoryview(body), with_raw_len(with_params(info, planes=2), 12_289), None)
    with pytest.raises(CorruptObject):
        codec.decode(memoryview(body), with_params(info, block=2 * SMALL + 4096), None)


def test_huge_claimed_size_is_rejected_before_allocating(codec: Codec) -> None:
    body, info = _sample(codec)
    huge = with_raw_len(info, 1 << 50)  # a petabyte: allocating it would fail loudly
    with pytest.raises(CorruptObject):
        codec.decode(memoryview(body), huge, None)


def _claim(codec: str, raw_len: int, block: int, pieces: list[bytes]) -> tuple[bytes, FrameInfo]:
    """A crafted payload: ``pieces`` (block table first) for a ``raw_len``-byte object."""
    table = struct.pack(f"<{len(pieces)}I", *(len(p) for p in pieces))
    _, info = encode_header(
        codec=codec,
        kind="bytes",
        dtype="uint8",
        shape=[raw_len],
        raw_len=raw_len,
        payload=b"",
        params={"block": block} if codec == "lz4" else {"block": block, "planes": 1},
    )
    return table + b"".join(pieces), info


@pytest.mark.parametrize("name", NAMES)
def test_a_small_payload_cannot_claim_a_huge_object(name: str) -> None:
    """5 KiB claiming a terabyte: refused from the pieces' sizes before allocating anything
    (it used to raise MemoryError from the output allocation)."""
    block = 1 << 30
    body, info = _claim(name, 1 << 40, block, [b"\x00"] * 1024)
    with pytest.raises(CorruptObject, match="expand"):
        load_codec(name).decode(memoryview(body), info, None)


def test_lz4_pieces_may_expand_255_times() -> None:
    codec = load_codec("lz4", block_size=1 << 20)
    src = bytes(1 << 20)  # zeros: lz4's best case, 254.4x
    body, info = encode(codec, to_object_data(src))
    assert bytes(memoryview(codec.decode(memoryview(body), info, None))) == src
    stored = struct.unpack_from("<I", body)[0]
    assert 254 * stored < len(src) <= 255 * stored
    # The same piece claimed for a bigger object is refused before decompressing.
    bigger = with_raw_len(info, 255 * stored + 1)
    grown = with_params(bigger, block=255 * stored + 1)
    with pytest.raises(CorruptObject, match="expand"):
        codec.decode(memoryview(body), grown, None)


def test_zstd_pieces_must_declare_their_size_before_allocating() -> None:
    import zstandard

    plain = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(8192))
    declares = zstandard.ZstdCompressor().compress(bytes(8192))
    codec = load_codec("bytesplit")
    for pieces, match in (
        ([plain], "declares -1 bytes"),
        ([declares], "declares 8192 bytes, not 16384"),
        ([b"\x00" * 64], "not a zstd frame"),
    ):
        body, info = _claim("bytesplit", 16384, 16384, pieces)
        with pytest.raises(CorruptObject, match=match):
            codec.decode(memoryview(body), info, None)


def test_an_allocation_that_fails_is_corrupt() -> None:
    """Pieces whose headers allow a terabyte (zstd expands up to 32768x) get as far as the
    output allocation: a MemoryError there is the frame's fault, not the caller's."""
    import zstandard

    block = 1 << 30
    # Each piece: a zstd frame header declaring 1 GiB (single segment, 8-byte size), padded to
    # the 32 KiB that 32768x needs. 32 MiB of payload for a 1 TiB object.
    piece = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", block)
    piece += bytes(block // 32768 - len(piece))
    assert zstandard.get_frame_parameters(piece).content_size == block
    body, info = _claim("bytesplit", 1 << 40, block, [piece] * 1024)
    # Refused at the allocation here (MemoryError before the fix); where the OS grants 1 TiB
    # of address space, the first piece fails to decompress instead.
    with pytest.raises(CorruptObject):
        load_codec("bytesplit").decode(memoryview(body), info, None)


def test_piece_declaring_another_size(codec: Codec) -> None:
    body, info = _sample(codec)
    # The same payload read as a shorter object: its pieces decompress to more than allowed.
    shorter = with_raw_len(info, info.raw_len - 50)
    with pytest.raises(CorruptObject):
        codec.decode(memoryview(body), shorter, None)


# --- options ---


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("lz4", {"acceleration": 0}),
        ("lz4", {"acceleration": 70_000}),
        ("lz4", {"acceleration": True}),
        ("lz4", {"acceleration": "fast"}),
        ("lz4", {"level": 3}),
        ("lz4", {"block_size": 100}),
        ("lz4", {"block_size": 1 << 31}),
        ("lz4", {"block_size": 4096.5}),
        ("bytesplit", {"level": 99}),
        ("bytesplit", {"level": "1"}),
        ("bytesplit", {"hash_log": 3}),
        ("bytesplit", {"block_size": 1}),
        ("bytesplit", {"acceleration": 1}),
        ("lz4", {"acceleration": 2.0}),
        ("lz4", {"acceleration": np.int64(2)}),
        ("lz4", {"block_size": 8192.0}),
        ("lz4", {"block_size": np.int64(8192)}),
        ("lz4", {"block_size": True}),
        ("bytesplit", {"level": 1.0}),
        ("bytesplit", {"level": np.int32(3)}),
        ("bytesplit", {"level": True}),
        ("bytesplit", {"hash_log": 8.0}),
        ("bytesplit", {"hash_log": np.int64(8)}),
        ("bytesplit", {"block_size": 8192.0}),
        ("bytesplit", {"block_size": np.uint32(8192)}),
        ("fp8", {"mode": "e4m3"}),
        ("zstd", {"threads": 100_000}),  # an HTTP client may name options: no thread storms
        ("zstd", {"threads": -2}),
        ("zstd", {"threads": 1.5}),
        ("zstd", {"level": "3"}),
    ],
)
def test_bad_options_are_config_errors(name: str, options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        load_codec(name, **options)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("lz4", {"acceleration": 8, "block_size": 8192}),
        ("bytesplit", {"level": 3, "hash_log": None}),
        ("bytesplit", {"level": -3, "hash_log": 12, "block_size": 1 << 20}),
        ("zstd", {"level": 19, "threads": 1}),
        ("zstd", {"level": 1, "threads": -1}),
    ],
)
def test_good_options(name: str, options: dict[str, Any]) -> None:
    src = b"abc" * 10_000
    codec = load_codec(name, **options)
    got, _ = round_trip(codec, src)
    assert got == src
    for option in options:
        value = getattr(codec, option)
        assert value is None or type(value) is int  # plain ints reach the frame's params


def test_run_blocks_waits_for_every_worker_and_raises_the_error() -> None:
    done: list[int] = []

    def work(i: int) -> int:
        if i == 3:
            raise CorruptObject("piece 3")
        done.append(i)
        return i

    assert run_blocks(lambda i: i * i, 10) == [i * i for i in range(10)]
    with pytest.raises(CorruptObject, match="piece 3"):
        run_blocks(work, 50)
    assert 3 not in done


def test_bytesplit_keeps_a_few_compression_contexts_whatever_the_settings() -> None:
    """Settings come from HTTP clients too: each one's zstd context is not kept for ever."""
    from serde import bytesplit

    data = to_object_data(np.arange(1 << 16, dtype=np.float16))
    for level in range(1, 10):
        bytesplit.BytesplitCodec(level=level).encode(data)
    assert len(bytesplit._local.cctx) <= bytesplit.KEPT_COMPRESSORS
