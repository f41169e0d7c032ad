"""The ``kivi`` codec: its numba kernels against the torch reference, its error bound, its axes
in every memory format, and what it refuses (the shared round trips are in test_codecs.py;
the CUDA kernels are compared with the reference in test_kivi_gpu.py)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from gateway.errors import ConfigError, CorruptObject
from gateway.frame import FrameInfo, encode_header
from gateway.objects import to_object, to_object_data
from gateway.registry import load_codec
from gateway.types import Buffer, BufferParts, ParamValue
from gateway.types import MemoryFormat as F
from gpu.reference import kivi as ref
from serde.kivi import KiviCodec
from serde.layout import layout_of

FLOATS = [torch.float16, torch.bfloat16, torch.float32]
# (id, format, shape): every layout, generic shapes, and declared formats that do not fit.
FORMATS = [
    ("2LTD", F.KV_2LTD, (2, 3, 37, 64)),
    ("T2D", F.KV_T2D, (37, 2, 64)),
    ("2TD", F.KV_2TD, (2, 37, 64)),
    ("MLA", F.KV_MLA_FMT, (1, 3, 37, 64)),
    ("generic-2d", F.UNDEFINED, (37, 63)),
    ("generic-1d", F.UNDEFINED, (1000,)),
    ("generic-3d", F.UNDEFINED, (3, 37, 64)),
    ("2LTD-misfit", F.KV_2LTD, (3, 37, 64)),
    ("T2D-misfit", F.KV_T2D, (37, 3, 64)),
]


def kv(shape: tuple[int, ...], dtype: torch.dtype = torch.float16, seed: int = 0) -> torch.Tensor:
    """KV-like data with per-channel offsets and a few outlier channels (keys' structure)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 0.5
    offsets = torch.randn(shape[-1], generator=g) * 0.8
    outliers = torch.where(torch.rand(shape[-1], generator=g) < 0.05, 8.0, 1.0)
    return (x * outliers + offsets).to(dtype)


def encode(src: Any, fmt: int = F.KV_2LTD, **options: Any) -> tuple[bytes, FrameInfo]:
    codec = load_codec("kivi", **options)
    data = to_object_data(src, fmt=fmt)
    payload, params = codec.encode(data)
    body = b"".join(bytes(memoryview(p)) for p in _parts(payload))
    _, header = encode_header(
        codec="kivi",
        kind=data.meta.kind,
        dtype=data.meta.dtype,
        shape=data.meta.shape,
        raw_len=data.meta.nbytes,
        payload=body,
        params=params,
        fmt=fmt,
    )
    return body, header


def _parts(payload: BufferParts) -> list[Buffer]:
    return [payload] if isinstance(payload, bytes | bytearray | memoryview) else list(payload)


def decode(body: bytes, header: FrameInfo) -> bytes:
    out = bytearray(header.raw_len)
    got = KiviCodec().decode(memoryview(body), header, memoryview(out))
    return bytes(memoryview(got))


def as_tensor(raw: bytes, like: torch.Tensor) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=like.dtype).reshape(like.shape)


def both_backends(
    monkeypatch: pytest.MonkeyPatch, src: torch.Tensor, fmt: int, **options: Any
) -> tuple[bytes, FrameInfo]:
    """Encode and decode with numba and with the reference; assert identical bytes."""
    body, header = encode(src, fmt, **options)
    monkeypatch.setenv("KVGATE_KERNELS", "reference")
    ref_body, ref_header = encode(src, fmt, **options)
    ref_raw = decode(body, header)
    monkeypatch.delenv("KVGATE_KERNELS")
    assert ref_header.params == header.params
    assert body == ref_body, f"numba payload differs at {_first_diff(body, ref_body)}"
    assert decode(body, header) == ref_raw
    return body, header


def _first_diff(a: bytes, b: bytes) -> object:
    if len(a) != len(b):
        return f"length {len(a)} != {len(b)}"
    return int(np.flatnonzero(np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8))[0])


def kernels_match(
    src: torch.Tensor, fmt: int, bits: int = 2, group: int = 32, residual: int = 0
) -> None:
    """The numba kernels against the reference, called directly: also for objects the codec
    stores raw because their payload would not be smaller (one token, 1-D tensors)."""
    from gpu.cpu import kivi as cpu

    layout = layout_of(fmt, tuple(src.shape))
    canon = layout.to_canonical(src)
    g = ref.geometry(layout.canonical_shape, src.dtype, bits, group, residual)
    want, got = ref.encode(canon, g), cpu.encode(canon, g)
    assert want is not None
    assert got is not None
    assert np.array_equal(got, want.numpy())
    out = torch.empty(layout.shape, dtype=src.dtype)
    cpu.decode_into(got, g, layout.to_canonical(out))
    expect = layout.from_canonical(ref.decode(want, g, src.dtype)).contiguous()
    assert torch.equal(out.reshape(-1).view(torch.uint8), expect.reshape(-1).view(torch.uint8))


def check_bound(src: torch.Tensor, got: torch.Tensor, fmt: int, bits: int, group: int) -> None:
    """Every element within half its group's stored scale, plus float32 and output rounding."""
    layout = layout_of(fmt, tuple(src.shape))
    x, y = layout.to_canonical(src).float(), layout.to_canonical(got).float()
    g = ref.geometry(layout.canonical_shape, src.dtype, bits, group, 0)
    half_scale = ref.max_error(layout.to_canonical(src), g)
    out_ulp = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 0.0}[src.dtype]
    tol = half_scale * (1 + 2**-12) + (x.abs() + y.abs()) * (out_ulp + 2**-21) + 2.0**-24
    assert bool(((x - y).abs() <= tol).all()), float(((x - y).abs() - tol).max())


# -- numba == reference, and the element-wise bound ------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize(("fmt", "shape"), [f[1:] for f in FORMATS], ids=[f[0] for f in FORMATS])
def test_numba_matches_reference_in_every_format(
    monkeypatch: pytest.MonkeyPatch, fmt: int, shape: tuple[int, ...], bits: int, dtype: torch.dtype
) -> None:
    src = kv(shape, dtype)
    kernels_match(src, fmt, bits)
    body, header = both_backends(monkeypatch, src, fmt, bits=bits)
    g = ref.geometry(layout_of(fmt, shape).canonical_shape, dtype, bits, 32, 0)
    # generic-1d is one token: its statistics outweigh its codes, so it is stored raw
    assert ("mode" not in header.params) == (g.total < src.numel() * src.element_size())
    check_bound(src, as_tensor(decode(body, header), src), fmt, bits, 32)


@pytest.mark.parametrize("tokens", [1, 2, 31, 32, 33, 37, 100])
@pytest.mark.parametrize("group", [2, 3, 32, 64, 1024])
def test_token_counts_and_group_sizes(
    monkeypatch: pytest.MonkeyPatch, tokens: int, group: int
) -> None:
    src = kv((2, 2, tokens, 40), torch.float16, seed=tokens)
    kernels_match(src, F.KV_2LTD, 2, group)  # the codec stores few tokens raw
    body, header = both_backends(monkeypatch, src, F.KV_2LTD, group=group)
    check_bound(src, as_tensor(decode(body, header), src), F.KV_2LTD, 2, group)
    t2d = kv((tokens, 2, 40), torch.bfloat16, seed=tokens)
    kernels_match(t2d, F.KV_T2D, 4, group)
    body, header = both_backends(monkeypatch, t2d, F.KV_T2D, bits=4, group=group)
    check_bound(t2d, as_tensor(decode(body, header), t2d), F.KV_T2D, 4, group)


def test_realistic_chunk_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.bench.kv_samples import synthetic_kv

    sample = synthetic_kv(layers=2, tokens=256, hidden=512)
    for bits in (2, 4):
        both_backends(monkeypatch, sample.kv, F.KV_2LTD, bits=bits)
        both_backends(monkeypatch, sample.kv.to(torch.bfloat16), F.KV_2LTD, bits=bits)


def test_strided_input_is_encoded_like_its_contiguous_copy() -> None:
    src = kv((2, 3, 64, 37)).transpose(2, 3)  # [2, 3, 37, 64], not contiguous
    assert encode(src)[0] == encode(src.contiguous())[0]


# -- axes: keys per channel, values per token, in every format --------------------------------


@pytest.mark.parametrize(("fmt", "shape"), [f[1:] for f in FORMATS], ids=[f[0] for f in FORMATS])
def test_keys_per_channel_values_per_token(fmt: int, shape: tuple[int, ...]) -> None:
    """Keys constant along tokens and values constant along channels are exact only if keys
    are grouped along tokens and values along channels."""
    layout = layout_of(fmt, shape)
    canon = torch.empty(layout.canonical_shape, dtype=torch.float32)
    channel = torch.linspace(-3, 5, layout.channels).to(torch.float16).float()
    token = torch.linspace(-2, 4, layout.tokens).to(torch.float16).float()
    canon[0] = channel.view(1, 1, -1)  # keys: one value per channel
    if layout.planes == 2:
        canon[1] = token.view(1, -1, 1)  # values: one value per token
    src = layout.from_canonical(canon.to(torch.float16))
    got = as_tensor(decode(*encode(src, fmt)), src)
    assert torch.equal(got, src)


# -- the payload format, byte for byte --------------------------------------------------------


def test_pack_order_is_the_documented_one() -> None:
    codes = torch.tensor([[0, 1, 2, 3, 1]], dtype=torch.uint8)  # 5 channels, 2 bits: 2 bytes
    packed = ref.pack(codes, 2)
    # byte j holds channels j, j + 2, j + 4 at bits 0, 2, 4
    assert packed.tolist() == [[0 | 2 << 2 | 1 << 4, 1 | 3 << 2]]
    assert torch.equal(ref.unpack(packed, 2, 5), codes)
    assert ref.pack(torch.tensor([[5, 9, 15]], dtype=torch.uint8), 4).tolist() == [[5 | 15 << 4, 9]]


def test_payload_sections_and_stats_are_the_documented_ones() -> None:
    # values [2, 1, 1, 4]: one value group per token with group 4; keys one 1-token group each.
    src = torch.tensor([[[[0.0, 1.0, 2.0, 3.0]]], [[[-1.0, -1.0, 5.0, 3.0]]]], dtype=torch.float16)
    g = ref.geometry((2, 1, 1, 4), torch.float16, 2, 4, 0)
    payload = ref.encode(src, g)
    assert payload is not None
    body = payload.numpy().tobytes()
    assert len(body) == g.total == 4 * 2 * 2 + 1 * 2 * 2 + 2 * 1  # key stats, value stats, codes
    stats = np.frombuffer(body[: g.codes_offset(0)], dtype=np.float16)
    assert stats[:4].tolist() == [0.0, 1.0, 2.0, 3.0]  # key mins (constant groups: exact)
    assert stats[4:8].tolist() == [0.0] * 4  # key scales
    assert stats[8:].tolist() == [-1.0, 2.0]  # value min, value scale = (5 - -1) / 3
    assert body[g.codes_offset(0)] == 0  # all key codes 0
    assert body[g.codes_offset(1)] == 0 | 0 << 2 | 3 << 4 | 2 << 6  # -1 -1 5 3 -> 0 0 3 2
    assert torch.equal(ref.decode(payload, g, torch.float16), src)
    kernels_match(src, F.KV_2LTD, 2, 4)
    # 26 payload bytes for a 16-byte object: the codec stores it raw instead
    _, header = encode(src, group=4)
    assert header.params == {"mode": "raw"}


@pytest.mark.parametrize(("bits", "ratio"), [(2, 16 / 3), (4, 16 / 5)])
def test_ratio_against_fp16(bits: int, ratio: float) -> None:
    src = kv((2, 4, 256, 128))
    body, _ = encode(src, bits=bits)
    assert src.numel() * 2 / len(body) == pytest.approx(ratio)


# -- residual, constant groups, dtypes ----------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_residual_tokens_are_verbatim(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    src = kv((2, 3, 37, 64), dtype)
    body, header = both_backends(monkeypatch, src, F.KV_2LTD, residual=5)
    assert header.params["residual"] == 5
    got = as_tensor(decode(body, header), src)
    assert torch.equal(got[:, :, -5:], src[:, :, -5:])
    assert not torch.equal(got[:, :, :-5], src[:, :, :-5])
    t2d = kv((37, 2, 64), dtype)
    body, header = both_backends(monkeypatch, t2d, F.KV_T2D, residual=7)
    assert torch.equal(as_tensor(decode(body, header), t2d)[-7:], t2d[-7:])


@pytest.mark.parametrize("residual", [37, 38, 10**9])
def test_residual_beyond_the_tokens_stores_everything(residual: int) -> None:
    src = kv((2, 3, 37, 64))
    body, header = encode(src, residual=residual)
    assert header.params == {"mode": "raw"}  # the payload would be the object itself
    assert len(body) == src.numel() * 2
    assert decode(body, header) == src.numpy().tobytes()


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("value", [0.0, -0.0, 1.5, -7.25, 65280.0, -65280.0, 6e-8])
def test_constant_groups_are_exact(dtype: torch.dtype, value: float) -> None:
    src = torch.full((2, 2, 37, 40), value, dtype=torch.float16).to(dtype)
    body, header = encode(src)
    assert "mode" not in header.params
    got = as_tensor(decode(body, header), src)
    assert torch.equal(got, src)  # -0.0 == 0.0: zeros may come back as +0


def test_float_ndarray_and_decode_without_out() -> None:
    src = kv((2, 2, 37, 64), torch.float32).numpy()
    body, header = encode(src)
    raw = KiviCodec().decode(memoryview(body), header, None)
    got = to_object(to_object_data(src).meta, raw)
    assert isinstance(got, np.ndarray)
    assert got.shape == src.shape
    assert bytes(memoryview(raw)) == decode(body, header)


def test_misaligned_output_buffer() -> None:
    body, header = encode(kv((2, 2, 37, 64), torch.float32))
    backing = bytearray(header.raw_len + 1)
    out = memoryview(backing)[1:]
    got = KiviCodec().decode(memoryview(body), header, out)
    assert bytes(memoryview(got)) == decode(body, header)
    assert bytes(backing[1:]) == decode(body, header)


# -- what is stored raw ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_stored_raw(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, bad: float
) -> None:
    src = kv((2, 2, 37, 64), dtype)
    src[1, 1, 3, 7] = bad
    for forced in (False, True):
        if forced:
            monkeypatch.setenv("KVGATE_KERNELS", "reference")
        body, header = encode(src)
        assert header.params == {"mode": "raw"}
        assert decode(body, header) == src.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("forced", [False, True], ids=["numba", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    ("plane", "value"), [(0, -1e6), (0, 1e6), (1, 70000.0), (1, -70000.0), (0, 65536.0)]
)
def test_values_beyond_float16_range_are_stored_raw(
    monkeypatch: pytest.MonkeyPatch, forced: bool, dtype: torch.dtype, plane: int, value: float
) -> None:
    if forced:
        monkeypatch.setenv("KVGATE_KERNELS", "reference")
    src = kv((2, 2, 37, 64), torch.float32)
    src[plane, 1, 5, 9] = value
    body, header = encode(src.to(dtype))
    assert header.params == {"mode": "raw"}
    assert decode(body, header) == src.to(dtype).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_large_positive_values_are_stored_raw_not_quantized_from_65504(dtype: torch.dtype) -> None:
    """Every value above 65504 used to be quantized from a minimum clamped to 65504 (max error
    22528 on this tensor, against a documented promise to store it raw)."""
    g = torch.Generator().manual_seed(0)
    src = (torch.rand((2, 1, 64, 32), generator=g) * 130000 + 70000).to(dtype)
    body, header = encode(src)
    assert header.params == {"mode": "raw"}
    assert decode(body, header) == src.view(torch.uint8).numpy().tobytes()


def test_values_at_the_float16_limit_are_quantized() -> None:
    src = kv((2, 2, 37, 64), torch.float32)
    src[0, 1, 5, 9] = 65504.0
    src[1, 0, 2, 3] = -65504.0
    body, header = encode(src)
    assert "mode" not in header.params
    check_bound(src, as_tensor(decode(body, header), src), F.KV_2LTD, 2, 32)


@pytest.mark.parametrize(
    ("shape", "fmt", "dtype", "bits"),
    [
        ((4096,), F.UNDEFINED, torch.float16, 2),
        ((1, 4096), F.UNDEFINED, torch.float16, 4),
        ((2, 32, 1, 1024), F.KV_2LTD, torch.float16, 2),
        ((2, 32, 1, 1024), F.KV_2LTD, torch.bfloat16, 4),
        ((1, 64), F.UNDEFINED, torch.float32, 2),  # 4-byte values: 272 bytes for 256
    ],
    ids=["1d", "1-row-4bit", "T=1", "T=1-4bit", "1-row-f32"],
)
def test_a_payload_not_smaller_than_the_object_is_stored_raw(
    shape: tuple[int, ...], fmt: int, dtype: torch.dtype, bits: int
) -> None:
    src = kv(shape, dtype)
    body, header = encode(src, fmt, bits=bits)
    assert header.params == {"mode": "raw"}
    assert len(body) == header.raw_len
    assert decode(body, header) == src.view(torch.uint8).numpy().tobytes()
    bigger, header = encode(kv((2, 32, 4, 1024), dtype), F.KV_2LTD, bits=bits)
    assert "mode" not in header.params
    assert len(bigger) < header.raw_len


def test_non_finite_residual_tokens_are_kept_exactly() -> None:
    src = kv((2, 2, 37, 64))
    src[0, 1, -1, 5] = float("nan")
    body, header = encode(src, residual=1)
    assert "mode" not in header.params
    got = as_tensor(decode(body, header), src)
    assert torch.equal(got[:, :, -1].view(torch.int16), src[:, :, -1].view(torch.int16))


# -- options and hostile frames ----------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{"bits": 3}, {"bits": 8}, {"bits": True}, {"bits": "2"}, {"group": 1}, {"group": 0},
     {"group": 1025}, {"group": 32.0}, {"residual": -1}, {"residual": None}, {"size": 2},
     {"bits": 2.0}, {"bits": 4.0}, {"bits": np.int64(2)}, {"bits": np.int32(4)},
     {"group": np.int64(32)}, {"group": True}, {"residual": 0.0}, {"residual": np.int64(1)},
     {"residual": False}],
)  # fmt: skip
def test_bad_options_are_config_errors(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        load_codec("kivi", **options)


def test_options_and_defaults() -> None:
    codec = load_codec("kivi", bits=4, group=128, residual=16)
    assert isinstance(codec, KiviCodec)
    assert (codec.bits, codec.group, codec.residual) == (4, 128, 16)
    assert all(type(v) is int for v in (codec.bits, codec.group, codec.residual))
    default = KiviCodec()
    assert (default.bits, default.group, default.residual) == (2, 32, 0)
    assert not default.lossless
    assert default.documented_rel_error == 0.45


def _replace(header: FrameInfo, **changes: Any) -> FrameInfo:
    return msgspec.structs.replace(header, **changes)


HOSTILE: list[dict[str, ParamValue]] = [
    {"bits": 3},
    {"bits": 1},
    {"bits": 8},
    {"bits": True},
    {"bits": 2.0},
    {"group": 0},
    {"group": 1},
    {"group": 1025},
    {"group": -32},
    {"residual": -1},
    {"residual": 38},
    {"residual": 2**62},
    {"residual": None},
    {"mode": "quantized"},
]


@pytest.mark.parametrize("change", HOSTILE, ids=str)
def test_hostile_params_are_corrupt(change: dict[str, ParamValue]) -> None:
    body, header = encode(kv((2, 4, 37, 64)))
    with pytest.raises(CorruptObject):
        decode(body, _replace(header, params={**header.params, **change}))
    for key in ("bits", "group", "residual"):
        params = {k: v for k, v in header.params.items() if k != key}
        with pytest.raises(CorruptObject):
            decode(body, _replace(header, params=params))


def test_corrupt_truncated_or_trailing_payload() -> None:
    body, header = encode(kv((2, 4, 37, 64)), residual=3)
    for bad in (body[:-1], body[:10], b"", body + b"\x00", body + body):
        with pytest.raises(CorruptObject):
            decode(bad, header)
    for changes in (
        {"raw_len": header.raw_len + 2},
        {"shape": [2, 4, 38, 64]},
        {"shape": [2, 4, 37, 64, 1]},
        {"dtype": "int16"},
        {"dtype": "float32"},
        {"kind": "bytes"},
        {"fmt": F.KV_T2D},
    ):
        with pytest.raises(CorruptObject):
            decode(body, _replace(header, **changes))


def test_garbage_payload_of_the_right_length_never_crashes() -> None:
    body, header = encode(kv((2, 4, 37, 64)))
    g = ref.geometry((2, 4, 37, 64), torch.float16, 2, 32, 0)
    rng = np.random.default_rng(3)
    garbage = np.frombuffer(rng.bytes(len(body)), np.uint8).copy()
    stats = garbage[g.stats_offset(0) : g.stats_offset(2)].view("<u2")
    stats &= 0xBFFF  # finite float16 statistics: anything else is refused (below)
    for finite in (garbage.tobytes(), b"\x00" * len(body), b"\x3b" * len(body)):
        assert len(decode(finite, header)) == header.raw_len
    for bad in (rng.bytes(len(body)), b"\xff" * len(body), b"\x7c" * len(body)):
        with pytest.raises(CorruptObject, match="non-finite"):
            decode(bad, header)


@pytest.mark.parametrize("forced", [False, True], ids=["numba", "reference"])
@pytest.mark.parametrize(
    ("plane", "which", "bits"),
    [(0, 1, 0x7FFF), (0, 0, 0x7C00), (1, 1, 0xFC00), (1, 0, 0xFE01), (0, 1, 0x7C00)],
    ids=["key-scale-nan", "key-min-inf", "value-scale-neg-inf", "value-min-nan", "one-inf"],
)
def test_non_finite_statistics_are_corrupt(
    monkeypatch: pytest.MonkeyPatch, forced: bool, plane: int, which: int, bits: int
) -> None:
    """The encoder never writes inf/NaN statistics; decoded they gave NaN keys with the
    reference and -0.0 with numba's bfloat16 rounding."""
    if forced:
        monkeypatch.setenv("KVGATE_KERNELS", "reference")
    src = kv((2, 1, 32, 8), torch.bfloat16)
    body, header = encode(src)
    g = ref.geometry((2, 1, 32, 8), torch.bfloat16, 2, 32, 0)
    n = g.stats_count(plane)
    stats = np.frombuffer(body, np.uint8, 4 * n, g.stats_offset(plane)).view("<u2").copy()
    if bits == 0x7C00 and which == 1 and plane == 0:  # just one statistic of one group
        stats[n + 3] = bits
    else:
        stats[which * n : (which + 1) * n] = bits
    start = g.stats_offset(plane)
    bad = body[:start] + stats.tobytes() + body[start + 4 * n :]
    assert len(bad) == len(body)
    with pytest.raises(CorruptObject, match="non-finite"):
        decode(bad, header)
