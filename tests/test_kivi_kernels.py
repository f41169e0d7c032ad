"""KIVI's kernels below the codec: the numba float16/bfloat16 conversions against torch, and
the CUDA kernels against the torch reference (marked ``gpu``; skipped without a CUDA device)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from test_kivi import encode, kv

from gateway.types import MemoryFormat as F
from gpu.reference import kivi as ref
from serde.kivi import KiviCodec
from serde.layout import layout_of

# -- float16 / bfloat16 conversions of the numba kernels --------------------------------------


def _fp16_grid() -> np.ndarray[Any, Any]:
    """float32 inputs that exercise float16 rounding: every float16 value, every tie between
    neighbours and the float32 values just beside it, subnormals, overflow, random values."""
    values = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float64)
    finite = np.sort(values[np.isfinite(values)])
    mids = (finite[:-1] + finite[1:]) / 2  # exact in float32
    ties = mids.astype(np.float32)
    beside = np.concatenate([np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, -np.inf)])
    rng = np.random.default_rng(0)
    rand = np.concatenate([rng.standard_normal(1 << 16) * s for s in (1e-7, 1e-4, 1, 3e4)])
    edge = [65504, 65519.99, 65520, 65536, 1e9, -65520, 2.0**-25, 2.0**-24 * 1.5, 0.0, -0.0]
    parts: list[np.ndarray[Any, Any]] = [finite, ties, beside, rand, np.array(edge)]
    parts.append(np.array([np.inf, -np.inf]))
    return np.concatenate([p.astype(np.float32) for p in parts])


@pytest.mark.parametrize("soft", [False, True], ids=["hardware", "bit-arithmetic"])
def test_float16_conversions_match_torch(soft: bool) -> None:
    from numba import njit

    from gpu.cpu import half as H

    @njit(cache=False)
    def widen(bits: Any, out: Any, soft: bool) -> None:
        for i in range(bits.size):
            out[i] = H.h2f_soft(bits[i]) if soft else H.h2f(bits[i])

    @njit(cache=False)
    def narrow(values: Any, out: Any, soft: bool) -> None:
        for i in range(values.size):
            out[i] = H.f2h_soft(values[i]) if soft else H.f2h(values[i])

    bits = np.arange(1 << 16, dtype=np.uint16)
    wide = np.empty(bits.size, np.float32)
    widen(bits, wide, soft)
    expected = torch.from_numpy(bits.view(np.int16).copy()).view(torch.float16).float().numpy()
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(wide), nan)
    assert np.array_equal(wide[~nan].view(np.uint32), expected[~nan].view(np.uint32))

    grid = _fp16_grid()
    half = np.empty(grid.size, np.uint16)
    narrow(grid, half, soft)
    want = torch.from_numpy(grid).half().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(half, want)


def test_bfloat16_conversions_match_torch() -> None:
    from numba import njit

    from gpu.cpu import half as H

    @njit(cache=False)
    def narrow(values: Any, out: Any) -> None:
        for i in range(values.size):
            out[i] = H.f2bf(values[i])

    rng = np.random.default_rng(1)
    rand = (rng.standard_normal(1 << 18) * 100).astype(np.float32)
    ties = rand.view(np.uint32) & np.uint32(0xFFFF0000) | np.uint32(0x8000)
    # Specials: every NaN stays a NaN (0x7FFFFFFF once rounded to -0.0 and 0xFFFFFFFF to +0.0),
    # infinities stay, the largest finite values round to infinity.
    specials = np.array(
        [0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF,
         0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000001],
        np.uint32,
    ).view(np.float32)  # fmt: skip
    grid = np.concatenate(
        [rand, ties.view(np.float32), np.array([0.0, -0.0], np.float32), specials]
    )
    out = np.empty(grid.size, np.uint16)
    narrow(grid, out)
    want = torch.from_numpy(grid).bfloat16().view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(grid)
    assert np.array_equal(out[~nan], want[~nan])
    # NaN bit patterns differ within torch itself (0x7FC0 scalar, 0xFFFF vectorized)
    assert nan.sum() == 7
    assert np.all(out[nan] == 0x7FC0)


# -- CUDA kernels against the reference --------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CASES = [
    ("2LTD", F.KV_2LTD, (2, 3, 37, 64), torch.float16, 2, 32, 0),
    ("2LTD-4bit-residual", F.KV_2LTD, (2, 3, 37, 64), torch.bfloat16, 4, 32, 5),
    ("T2D", F.KV_T2D, (33, 2, 40), torch.float32, 2, 16, 0),
    ("2TD-odd", F.KV_2TD, (2, 31, 63), torch.float16, 4, 3, 2),
    ("MLA", F.KV_MLA_FMT, (1, 2, 1, 64), torch.bfloat16, 2, 32, 0),
    ("generic", F.UNDEFINED, (37, 63), torch.float32, 2, 1024, 0),
    ("chunk", F.KV_2LTD, (2, 4, 256, 1024), torch.float16, 2, 32, 0),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("fmt", "shape", "dtype", "bits", "group", "residual"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_cuda_kernels_match_the_reference(
    fmt: int, shape: tuple[int, ...], dtype: torch.dtype, bits: int, group: int, residual: int
) -> None:
    pytest.importorskip("cupy")
    from gpu.cuda import kivi as cuda

    layout = layout_of(fmt, shape)
    g = ref.geometry(layout.canonical_shape, dtype, bits, group, residual)
    src = kv(shape, dtype)
    expected = ref.encode(layout.to_canonical(src), g)
    assert expected is not None
    dev = src.cuda()
    on_gpu = cuda.encode_device(layout.to_canonical(dev), g)
    assert on_gpu is not None
    assert on_gpu.device.type == "cuda"
    assert torch.equal(on_gpu.cpu(), expected)
    by_reference = ref.encode(layout.to_canonical(dev), g)  # the torch spec on the GPU too
    assert by_reference is not None
    assert torch.equal(by_reference.cpu(), expected)

    want = ref.decode(expected, g, dtype)
    got = cuda.decode(expected.cuda(), g, dtype)
    assert got.device.type == "cuda"
    assert torch.equal(_bits(got.cpu()), _bits(want))
    assert torch.equal(_bits(ref.decode(expected.cuda(), g, dtype).cpu()), _bits(want))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_codec_encodes_a_cuda_tensor_to_the_same_host_bytes(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    pytest.importorskip("cupy")
    from gpu import dispatch
    from gpu.cuda import kivi as cuda

    if not dispatch.has_cupy():
        pytest.skip("cupy sees no CUDA device")
    calls = []
    real = cuda.encode

    def spy(canon: torch.Tensor, g: ref.KiviGeometry) -> Any:
        calls.append(canon.device.type)
        return real(canon, g)

    monkeypatch.setattr(cuda, "encode", spy)
    src = kv((2, 4, 37, 64), dtype)
    for fmt, tensor in ((F.KV_2LTD, src), (F.KV_T2D, src[:, 0].permute(1, 0, 2).contiguous())):
        host_body, host_header = encode(tensor, fmt, bits=4, residual=3)
        gpu_body, gpu_header = encode(tensor.cuda(), fmt, bits=4, residual=3)
        assert gpu_body == host_body
        assert gpu_header.params == host_header.params
    assert calls == ["cuda", "cuda"]


@pytest.mark.gpu
@needs_cuda
def test_cuda_non_finite_input_is_stored_raw() -> None:
    pytest.importorskip("cupy")
    src = kv((2, 2, 37, 64))
    src[0, 1, 2, 3] = float("nan")
    body, header = encode(src.cuda())
    assert header.params == {"mode": "raw"}
    assert body == src.view(torch.int16).numpy().tobytes()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("value", [70000.0, -70000.0, 1e6])
def test_cuda_values_beyond_float16_range_are_stored_raw(value: float) -> None:
    pytest.importorskip("cupy")
    src = kv((2, 2, 37, 64), torch.float32)
    src[1, 0, 2, 3] = value
    body, header = encode(src.cuda())
    assert header.params == {"mode": "raw"}
    assert body == src.view(torch.int32).numpy().tobytes()


def test_one_compiled_specialization_per_kernel() -> None:
    """Every dtype, format and option set runs the same two compiled kernels (numba compiles
    once per process, not once per dtype or array flavour)."""
    from gpu.cpu import kivi_kernels as K

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for fmt, shape in ((F.KV_2LTD, (2, 2, 37, 64)), (F.KV_T2D, (37, 2, 64))):
            body, header = encode(kv(shape, dtype), fmt, bits=4, residual=3)
            for payload in (body, bytearray(body)):
                KiviCodec().decode(memoryview(payload), header, None)
    assert len(K.encode_plane.signatures) == 1
    assert len(K.decode_plane.signatures) == 1
