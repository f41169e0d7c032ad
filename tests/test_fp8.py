"""``fp8``: e4m3 with per-channel scales; the numba and CUDA kernels against the torch reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from gateway.codec import encode_frame
from gateway.errors import ConfigError, CorruptObject
from gateway.frame import FrameInfo, encode_header
from gateway.objects import ObjectData, to_object, to_object_data
from gateway.registry import load_codec
from gateway.types import MemoryFormat, ParamValue
from gpu.dispatch import has_cupy
from gpu.reference import fp8 as ref
from serde.fp8 import MIN_SCALE, Fp8Codec, payload_size
from serde.layout import layout_of

cpu = pytest.importorskip("gpu.cpu.fp8")

F = MemoryFormat
FLOATS = [torch.bfloat16, torch.float16, torch.float32]
FORMATS = [
    ("2LTD", F.KV_2LTD, (2, 3, 37, 64)),
    ("T2D", F.KV_T2D, (37, 2, 64)),
    ("2TD", F.KV_2TD, (2, 37, 64)),
    ("MLA", F.KV_MLA_FMT, (1, 3, 37, 64)),
    ("1d", F.UNDEFINED, (1000,)),
    ("3d-odd", F.UNDEFINED, (3, 37, 63)),
    ("2LTD-misfit", F.KV_2LTD, (3, 37, 64)),
    ("scalar", F.UNDEFINED, ()),
    ("one-token", F.KV_2LTD, (2, 2, 1, 8)),
]
# Relative precision of the final cast to the stored dtype, and its smallest subnormal step / 2.
OUT_EPS = {torch.bfloat16: 2.0**-9, torch.float16: 2.0**-11, torch.float32: 0.0}
OUT_TINY = {torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25, torch.float32: 2.0**-150}


def encode(data: ObjectData) -> tuple[bytes, FrameInfo]:
    _, parts, header = encode_frame(Fp8Codec(), data)
    return b"".join(bytes(p) for p in parts), header


def header(info: FrameInfo, **changes: Any) -> FrameInfo:
    fields: dict[str, Any] = {
        "codec": "fp8",
        "kind": info.kind,
        "dtype": info.dtype,
        "shape": info.shape,
        "raw_len": info.raw_len,
        "params": info.params,
        "fmt": info.fmt,
    }
    fields.update(changes)
    return encode_header(payload=b"", **fields)[1]


def round_trip(src: Any, fmt: int = F.UNDEFINED, out: bool = True) -> tuple[Any, int]:
    data = to_object_data(src, fmt=fmt)
    body, info = encode(data)
    target = memoryview(bytearray(info.raw_len)) if out else None
    raw = Fp8Codec().decode(memoryview(body), info, target)
    assert memoryview(raw).nbytes == info.raw_len
    return to_object(data.meta, raw), len(body)


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Channels of very different magnitudes (10**-6 .. 10**4): per-channel scales matter."""
    g = torch.Generator().manual_seed(seed)
    channels = shape[-1] if shape else 1
    magnitude = (
        torch.logspace(-6, 4, channels)
        if dtype != torch.float16
        else torch.logspace(-3, 3, channels)
    )
    return (torch.randn(shape, generator=g) * magnitude).to(dtype)


def expected(src: torch.Tensor, fmt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(decoded, scale broadcast to each element) in the stored shape, from the reference."""
    layout = layout_of(fmt, tuple(src.shape))
    canonical = layout.to_canonical(src)
    scales, codes = ref.encode(canonical)
    decoded = layout.from_canonical(ref.decode(scales, codes, src.dtype))
    per_element = layout.from_canonical(scales.unsqueeze(2).expand(canonical.shape))
    return decoded, per_element


def assert_within_bound(src: torch.Tensor, got: torch.Tensor, scale: torch.Tensor) -> None:
    x, y = src.double(), got.double()
    eps, tiny = OUT_EPS[src.dtype], OUT_TINY[src.dtype]
    # e4m3 rounding (2**-4 relative, 2**-10 * scale below the normal range), float32 rounding
    # of the division and the product, then the cast to the stored dtype.
    bound = (2.0**-4 + 2.0**-20) * x.abs() + 2.0**-10 * scale.double() * (1 + 2.0**-20)
    bound = bound + eps * y.abs() + tiny
    assert bool(((x - y).abs() <= bound).all()), float(((x - y).abs() - bound).max())


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(("fmt", "shape"), [f[1:] for f in FORMATS], ids=[f[0] for f in FORMATS])
def test_round_trip_every_format(dtype: torch.dtype, fmt: int, shape: tuple[int, ...]) -> None:
    src = sample(dtype, shape)
    got, size = round_trip(src, fmt)
    assert isinstance(got, torch.Tensor)
    assert (got.dtype, got.shape) == (dtype, src.shape)
    layout = layout_of(fmt, shape)
    if payload_size(layout) >= src.numel() * src.element_size():  # one token: stored raw
        assert torch.equal(got, src)
        assert size == src.numel() * src.element_size()
        return
    decoded, scale = expected(src, fmt)
    assert torch.equal(got, decoded)  # the codec's kernels are the reference, exactly
    assert_within_bound(src, got, scale)
    assert size == layout.numel + 4 * layout.planes * layout.layers * layout.channels


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_decode_without_out_and_strided_input(dtype: torch.dtype) -> None:
    src = sample(dtype, (2, 3, 64, 37)).transpose(2, 3)  # [2, 3, 37, 64], not contiguous
    got, _ = round_trip(src, F.KV_2LTD, out=False)
    assert torch.equal(got, expected(src.contiguous(), F.KV_2LTD)[0])


def test_ndarray_input() -> None:
    src = np.random.default_rng(0).standard_normal((37, 16)).astype(np.float32)
    got, size = round_trip(src)
    assert isinstance(got, np.ndarray)
    assert got.dtype == np.float32
    assert size == src.size + 4 * 16
    assert np.abs(got - src).max() <= np.abs(src).max() / 16


def test_rel_error_is_within_the_documented_bound() -> None:
    g = torch.Generator().manual_seed(0)
    for dtype in FLOATS:
        kv = (torch.randn((2, 4, 37, 64), generator=g) * 0.5).to(dtype)
        got, _ = round_trip(kv, F.KV_2LTD)
        for plane in range(2):
            err = (got[plane].double() - kv[plane].double()).norm() / kv[plane].double().norm()
            assert 0.005 < float(err) < Fp8Codec.documented_rel_error


def test_zero_channels_decode_to_zero() -> None:
    src = sample(torch.bfloat16, (2, 2, 37, 16))
    src[:, :, :, 3] = 0
    src[1, 0, :, 7] = 0
    got, _ = round_trip(src, F.KV_2LTD)
    assert bool((got[:, :, :, 3] == 0).all())
    assert bool((got[1, 0, :, 7] == 0).all())
    scales, _ = ref.encode(src)
    assert bool((scales[:, :, 3] == 0).all())
    assert torch.equal(cpu.encode(src)[0], scales)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_nan_is_kept_and_inf_saturates(dtype: torch.dtype) -> None:
    src = sample(dtype, (2, 1, 37, 8))
    src[0, 0, 3, 1] = float("nan")
    src[0, 0, 4, 1] = float("inf")
    src[0, 0, 5, 1] = -float("inf")
    src[1, 0, :, 2] = float("inf")  # a channel without finite values
    src[1, 0, :, 3] = float("nan")
    got, _ = round_trip(src, F.KV_2LTD)
    finite = src[0, 0, :, 1][torch.isfinite(src[0, 0, :, 1])]
    top = (finite.abs().max().float() / 448 * 448).to(dtype)  # the code 0x7E times the scale
    assert bool(torch.isnan(got[0, 0, 3, 1]))
    assert got[0, 0, 4, 1] == top
    assert got[0, 0, 5, 1] == -top
    assert bool((got[1, 0, :, 2] == 0).all())
    assert bool(torch.isnan(got[1, 0, :, 3]).all())
    # The other values of the channels with NaN/inf keep their precision.
    keep = torch.isfinite(src)
    keep[1, 0, :, 2] = False
    assert_within_bound(src[keep], got[keep], expected(src, F.KV_2LTD)[1][keep])


@pytest.mark.parametrize(
    "obj",
    [
        b"\x01\x02\x03",
        torch.arange(100, dtype=torch.int32),
        torch.randn(4, 8).to(torch.float8_e4m3fn),
        torch.randn(4, 8, dtype=torch.float64),
        torch.empty((2, 0, 4), dtype=torch.bfloat16),
        np.arange(10, dtype=np.int16),
    ],
    ids=["bytes", "int32", "fp8", "float64", "empty", "int16-array"],
)
def test_non_float_objects_are_stored_raw(obj: Any) -> None:
    data = to_object_data(obj)
    _, params = Fp8Codec().encode(data)
    assert params == {"mode": "raw"}
    got, _ = round_trip(obj)
    assert bytes(memoryview(to_object_data(got).host())) == bytes(data.host())


@pytest.mark.parametrize(
    ("shape", "fmt", "dtype"),
    [
        ((4096,), F.UNDEFINED, torch.float16),  # one token of 4096 channels
        ((1, 4096), F.UNDEFINED, torch.float16),
        ((2, 32, 1, 1024), F.KV_2LTD, torch.float16),
        ((2, 32, 4, 1024), F.KV_2LTD, torch.float16),  # as large as the object: no gain
        ((2, 4, 1, 64), F.KV_2LTD, torch.float32),
        ((2, 4, 1, 64), F.KV_2LTD, torch.bfloat16),
    ],
    ids=["1d", "1-row", "T=1", "T=4-f16", "T=1-f32", "T=1-bf16"],
)
def test_a_payload_not_smaller_than_the_object_is_stored_raw(
    shape: tuple[int, ...], fmt: int, dtype: torch.dtype
) -> None:
    src = sample(dtype, shape)
    body, info = encode(to_object_data(src, fmt=fmt))
    assert info.params == {"mode": "raw"}
    assert len(body) == info.raw_len
    got, _ = round_trip(src, fmt)
    assert torch.equal(got, src)


def test_a_payload_smaller_than_the_object_is_quantized() -> None:
    src = sample(torch.float16, (2, 32, 5, 1024))  # 5 tokens: codes and scales beat float16
    body, info = encode(to_object_data(src, fmt=F.KV_2LTD))
    assert info.params == {"mode": "e4m3"}
    assert len(body) < info.raw_len


@pytest.mark.parametrize(
    ("dtype", "magnitude"),
    [
        (torch.float32, 1e-42),
        (torch.float32, 1e-44),  # absmax / 448 underflows to 0: the channel would decode as 0
        (torch.float32, 1e-45),
        (torch.float32, 1e-33),
        (torch.bfloat16, 1e-39),
    ],
    ids=str,
)
def test_channels_too_small_for_a_float32_scale_are_stored_raw(
    dtype: torch.dtype, magnitude: float
) -> None:
    src = sample(dtype, (2, 2, 37, 16))
    src[1, 0, :, 5] = (torch.randn(37) * magnitude).to(dtype)  # one tiny channel is enough
    assert bool((src[1, 0, :, 5] != 0).any())
    _body, info = encode(to_object_data(src, fmt=F.KV_2LTD))
    assert info.params == {"mode": "raw"}
    got, _ = round_trip(src, F.KV_2LTD)
    assert torch.equal(got, src)


def test_channels_just_above_the_smallest_scale_are_quantized() -> None:
    src = torch.randn((2, 2, 37, 16), generator=torch.Generator().manual_seed(2))
    src[0, 1, :, 3] = src[0, 1, :, 3] / src[0, 1, :, 3].abs().max() * (448 * MIN_SCALE * 1.01)
    src[1, 1, :, 4] = 0.0  # a zero channel (scale 0) is exact, not a reason to store raw
    src[1, 0, :, 2] = float("inf")  # nor is a channel without finite values
    got, _ = round_trip(src, F.KV_2LTD)
    _, info = encode(to_object_data(src, fmt=F.KV_2LTD))
    assert info.params == {"mode": "e4m3"}
    for plane in range(2):
        x = src[plane].double()
        keep = torch.isfinite(x)
        err = (got[plane].double() - x)[keep].norm() / x[keep].norm()
        assert float(err) < Fp8Codec.documented_rel_error
    # the tiny channel on its own keeps the bound too: every intermediate is a normal float
    x, y = src[0, 1, :, 3].double(), got[0, 1, :, 3].double()
    assert float((x - y).norm() / x.norm()) < Fp8Codec.documented_rel_error


class _OtherDevice:
    """A tensor on a device with no kernels (mps, xpu): only ``.cpu()`` can be used."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.device = torch.device("meta")  # any device type other than cpu and cuda

    def cpu(self) -> torch.Tensor:
        return self.tensor


def test_tensors_on_other_devices_are_encoded_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    import serde.fp8

    src = sample(torch.bfloat16, (2, 3, 37, 64))
    want, _ = encode(to_object_data(src, fmt=F.KV_2LTD))
    monkeypatch.setattr(serde.fp8, "float_tensor", lambda obj: _OtherDevice(src))
    got, info = encode(to_object_data(src, fmt=F.KV_2LTD))
    assert info.params == {"mode": "e4m3"}
    assert got == want


# --- the numba kernels against the reference ---


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 37, 50), (1, 1, 1, 1), (1, 1, 5000, 3), (2, 1, 1, 4099)])
def test_cpu_kernels_match_the_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    src = sample(dtype, shape, seed=3)
    flat = src.view(-1)
    flat[:: max(1, flat.numel() // 7)] = float("nan")
    flat[1 :: max(2, flat.numel() // 5)] = float("inf")
    flat[2 :: max(3, flat.numel() // 5)] = -0.0
    ref_scales, ref_codes = ref.encode(src)
    scales, codes = cpu.encode(src)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes, ref_codes)
    want = ref.decode(ref_scales, ref_codes, dtype)
    got = cpu.decode(ref_scales.numpy(), ref_codes.numpy(), dtype)
    assert_same_values(got, want)


def assert_same_values(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-identical, except that NaN payloads may differ (torch's own casts vary)."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    bits = torch.int32 if want.dtype == torch.float32 else torch.int16
    zero = torch.zeros((), dtype=want.dtype)
    assert torch.equal(
        torch.where(nan, zero, got).view(bits), torch.where(nan, zero, want).view(bits)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cpu_kernels_on_every_16_bit_pattern(dtype: torch.dtype) -> None:
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    for shape in [(1, 1, 1, 65536), (2, 2, 16384, 1), (1, 1, 256, 256)]:
        src = values.reshape(shape)
        ref_scales, ref_codes = ref.encode(src)
        scales, codes = cpu.encode(src)
        assert torch.equal(scales, ref_scales)
        assert torch.equal(codes, ref_codes)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_cpu_decode_of_every_code_and_many_scales(dtype: torch.dtype) -> None:
    codes = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 256, 1).expand(1, 1, 256, 64)
    codes = codes.contiguous()
    scales = torch.logspace(-30, 30, 64, dtype=torch.float64).float().reshape(1, 1, 64)
    scales[0, 0, 0] = 0
    assert_same_values(
        cpu.decode(scales.numpy(), codes.numpy(), dtype), ref.decode(scales, codes, dtype)
    )


def test_e4m3_rounding_of_every_float32_stride() -> None:
    """Scale 1: the kernel's rounding against torch's float8 cast over a sweep of bit patterns."""
    bits = torch.arange(0, 1 << 32, 4099, dtype=torch.int64).to(torch.int32)
    src = bits.view(torch.float32).reshape(1, 1, -1, 1)
    src = torch.cat([src, torch.full((1, 1, 1, 1), 448.0)], dim=2)  # absmax 448: scale exactly 1
    src = torch.where(src.abs() > 448, torch.zeros((), dtype=src.dtype), src)
    src = torch.where(torch.isnan(src), torch.zeros((), dtype=src.dtype), src)
    ref_scales, ref_codes = ref.encode(src)
    assert float(ref_scales) == 1.0
    assert torch.equal(cpu.encode(src)[1], ref_codes)


def test_reference_backend_gives_the_same_payload(monkeypatch: pytest.MonkeyPatch) -> None:
    src = sample(torch.bfloat16, (2, 3, 37, 64))
    body, info = encode(to_object_data(src, fmt=F.KV_2LTD))
    monkeypatch.setenv("KVGATE_KERNELS", "reference")
    ref_body, _ = encode(to_object_data(src, fmt=F.KV_2LTD))
    assert ref_body == body
    out = bytearray(info.raw_len)
    Fp8Codec().decode(memoryview(body), info, memoryview(out))
    monkeypatch.delenv("KVGATE_KERNELS")
    out2 = bytearray(info.raw_len)
    Fp8Codec().decode(memoryview(body), info, memoryview(out2))
    assert out == out2


# --- malformed payloads and options ---


def _valid() -> tuple[bytes, FrameInfo]:
    return encode(to_object_data(sample(torch.bfloat16, (2, 2, 37, 16)), fmt=F.KV_2LTD))


def test_truncated_garbage_and_trailing_payloads() -> None:
    body, info = _valid()
    for bad in (body[:-1], body[:100], b"", b"\x00" * 50, body + b"\x00"):
        with pytest.raises(CorruptObject):
            Fp8Codec().decode(memoryview(bad), info, memoryview(bytearray(info.raw_len)))


@pytest.mark.parametrize("scale", [-1.0, float("nan"), float("inf")])
def test_bad_scales_are_corrupt(scale: float) -> None:
    body, info = _valid()
    bad = np.array([scale], dtype="<f4").tobytes() + body[4:]
    with pytest.raises(CorruptObject):
        Fp8Codec().decode(memoryview(bad), info, None)


@pytest.mark.parametrize(
    "changes",
    [
        {"params": {"mode": "e5m2"}},
        {"params": {}},
        {"dtype": "int16"},
        {"dtype": "float32"},
        {"raw_len": 2 * 2 * 37 * 16 * 2 + 2},
        {"shape": [2, 2, 38, 16]},
        {"fmt": int(F.KV_2TD)},
    ],
    ids=["mode", "no-mode", "int-dtype", "other-dtype", "raw-len", "shape", "fmt"],
)
def test_mismatched_frames_are_corrupt(changes: dict[str, ParamValue]) -> None:
    body, info = _valid()
    with pytest.raises(CorruptObject):
        Fp8Codec().decode(memoryview(body), header(info, **changes), None)


def test_options_are_rejected() -> None:
    with pytest.raises(ConfigError):
        load_codec("fp8", scale="f16")
    assert isinstance(load_codec("fp8"), Fp8Codec)


# --- CUDA kernels against the reference (need a GPU and cupy) ---

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not has_cupy(), reason="needs a CUDA device and cupy"
)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(
    "shape", [(2, 3, 37, 50), (1, 1, 1, 1), (1, 1, 5000, 3), (2, 4, 256, 1024)]
)
def test_cuda_kernels_match_the_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    from gpu.cuda import fp8 as cuda

    src = sample(dtype, shape, seed=5)
    flat = src.view(-1)
    flat[:: max(1, flat.numel() // 7)] = float("nan")
    flat[1 :: max(2, flat.numel() // 5)] = float("inf")
    ref_scales, ref_codes = ref.encode(src)
    scales, codes = cuda.encode(src.cuda())
    assert torch.equal(scales.cpu(), ref_scales)
    assert torch.equal(codes.cpu(), ref_codes)
    gpu_ref_scales, gpu_ref_codes = ref.encode(src.cuda())  # the reference runs on CUDA too
    assert torch.equal(gpu_ref_scales.cpu(), ref_scales)
    assert torch.equal(gpu_ref_codes.cpu(), ref_codes)
    got = cuda.decode(ref_scales.cuda(), ref_codes.cuda(), dtype)
    assert_same_values(got.cpu(), ref.decode(ref_scales, ref_codes, dtype))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_cuda_decode_of_every_code(dtype: torch.dtype) -> None:
    from gpu.cuda import fp8 as cuda

    codes = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 256, 1).expand(1, 1, 256, 64)
    codes = codes.contiguous()
    scales = torch.logspace(-30, 30, 64, dtype=torch.float64).float().reshape(1, 1, 64)
    got = cuda.decode(scales.cuda(), codes.cuda(), dtype).cpu()
    assert_same_values(got, ref.decode(scales, codes, dtype))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("fmt", "shape"), [f[1:] for f in FORMATS], ids=[f[0] for f in FORMATS])
def test_codec_encodes_a_gpu_tensor_on_the_gpu(fmt: int, shape: tuple[int, ...]) -> None:
    src = sample(torch.bfloat16, shape)
    host_body, _ = encode(to_object_data(src, fmt=fmt))
    gpu_body, info = encode(to_object_data(src.cuda(), fmt=fmt))
    assert gpu_body == host_body
    got = Fp8Codec().decode(memoryview(gpu_body), info, None)
    assert bytes(got) == bytes(Fp8Codec().decode(memoryview(host_body), info, None))
    if info.params.get("mode") != "raw":
        assert bytes(got) == bytes(to_object_data(expected(src, fmt)[0]).host())
