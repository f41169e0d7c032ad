"""fp8 (e4m3) per-channel quantization on a CUDA device (cupy raw kernels).

The same results as ``gpu.reference.fp8``, bit for bit: the finite absmax over tokens per
(plane, layer, channel), ``scale = absmax / 448`` and ``x / scale`` as IEEE float32 divisions
(``__fdiv_rn``: never a reciprocal), round to nearest even into e4m3 in integer arithmetic
(the hardware conversion needs sm_89, these kernels run on any GPU), saturation to ±448 and
NaN -> ``0x7F``. The absmax is reduced over token chunks with ``atomicMax`` on the float bits
(non-negative floats order like their bit patterns), so a tensor with few channels and many
tokens still fills the device.

The encoder writes scales and codes into one device buffer laid out like the codec payload, so
only one copy crosses to the host. Kernels launch on torch's current stream of the tensor's
device; cupy is imported only here, and only when a tensor is on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from gpu.cupy_stream import torch_stream_for_cupy

CUDA_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#define E4M3_MAX 448.0f

__device__ __forceinline__ float bits_f32(u32 u) { return __uint_as_float(u); }
__device__ __forceinline__ u32 f32_bits(float f) { return __float_as_uint(f); }

// kind: 0 float32, 1 bfloat16, 2 float16 (16-bit values as raw bits).
__device__ __forceinline__ float load_value(const void* x, i64 i, int kind) {
    if (kind == 0) return static_cast<const float*>(x)[i];
    u16 h = static_cast<const u16*>(x)[i];
    if (kind == 1) return bits_f32(static_cast<u32>(h) << 16);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ void store_value(void* out, i64 i, float y, int kind) {
    if (kind == 0) {
        static_cast<float*>(out)[i] = y;
        return;
    }
    u16 h;
    if (kind == 1) {
        u32 u = f32_bits(y);
        h = (y != y) ? static_cast<u16>(0x7FC0u)
                     : static_cast<u16>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    } else {
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(y));
    }
    static_cast<u16*>(out)[i] = h;
}

// float32 -> e4m3, round to nearest even, saturating at 448; q is not NaN.
__device__ __forceinline__ u32 to_e4m3(float q) {
    u32 sign = (f32_bits(q) >> 24) & 0x80u;
    float a = fminf(fabsf(q), E4M3_MAX);
    u32 ab = f32_bits(a);
    u32 normal = ((ab + 0x7FFFFu + ((ab >> 20) & 1u)) >> 20) - 0x3C0u;
    // Below 2^-6 the code is subnormal: adding 2^14 rounds a to a multiple of 2^-9.
    u32 sub = f32_bits(__fadd_rn(a, 16384.0f)) - 0x46800000u;
    return sign | (ab < 0x3C800000u ? sub : normal);
}

__device__ __forceinline__ float from_e4m3(u32 c) {
    if ((c & 0x7Fu) == 0x7Fu) return bits_f32(0x7FC00000u);
    u32 sign = (c & 0x80u) << 24;
    u32 e = (c >> 3) & 0xFu;
    u32 m = c & 7u;
    if (e == 0u) return bits_f32(f32_bits(__fmul_rn(static_cast<float>(m), 0.001953125f)) | sign);
    return bits_f32(sign | ((e + 120u) << 23) | (m << 20));
}

// absmax[g * channels + c] (zeroed, float bits) = max |x| over finite values, chunk by chunk.
extern "C" __global__ void fp8_absmax(const void* x, int kind, i64 groups, i64 tokens,
                                      i64 channels, i64 chunk, u32* absmax) {
    const float inf = bits_f32(0x7F800000u);
    i64 nchunks = (tokens + chunk - 1) / chunk;
    i64 total = groups * nchunks * channels;
    i64 stride = static_cast<i64>(gridDim.x) * blockDim.x;
    for (i64 idx = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
         idx += stride) {
        i64 c = idx % channels;
        i64 rest = idx / channels;
        i64 k = rest % nchunks;
        i64 g = rest / nchunks;
        i64 t0 = k * chunk;
        i64 t1 = t0 + chunk < tokens ? t0 + chunk : tokens;
        float m = 0.0f;
        for (i64 t = t0; t < t1; ++t) {
            float a = fabsf(load_value(x, (g * tokens + t) * channels + c, kind));
            if (a < inf) m = fmaxf(m, a);  // NaN and inf are skipped
        }
        if (m > 0.0f) atomicMax(absmax + g * channels + c, f32_bits(m));
    }
}

// In place: absmax bits -> float32 scales.
extern "C" __global__ void fp8_scales(u32* values, i64 n) {
    i64 stride = static_cast<i64>(gridDim.x) * blockDim.x;
    for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        values[i] = f32_bits(__fdiv_rn(bits_f32(values[i]), E4M3_MAX));
    }
}

extern "C" __global__ void fp8_quantize(const void* x, int kind, const float* scales,
                                        i64 tokens, i64 channels, i64 n, u8* codes) {
    i64 stride = static_cast<i64>(gridDim.x) * blockDim.x;
    for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        i64 c = i % channels;
        i64 g = i / (tokens * channels);
        float s = scales[g * channels + c];
        float safe = s > 0.0f ? s : 1.0f;
        float v = load_value(x, i, kind);
        codes[i] = static_cast<u8>(v != v ? 0x7Fu : to_e4m3(__fdiv_rn(v, safe)));
    }
}

extern "C" __global__ void fp8_dequantize(const u8* codes, const float* scales, i64 tokens,
                                          i64 channels, i64 n, int kind, void* out) {
    i64 stride = static_cast<i64>(gridDim.x) * blockDim.x;
    for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        i64 c = i % channels;
        i64 g = i / (tokens * channels);
        float y = __fmul_rn(from_e4m3(codes[i]), scales[g * channels + c]);
        store_value(out, i, y, kind);
    }
}
"""

THREADS = 256
MAX_BLOCKS = 1 << 16  # grid-stride loops cover the rest
TOKEN_CHUNK = 64
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.cache
def _module() -> Any:
    import cupy

    return cupy.RawModule(code=CUDA_SOURCE, options=("--std=c++17",))


@contextlib.contextmanager
def _on(device: torch.device) -> Iterator[None]:
    """Run cupy launches on ``device`` and on torch's current stream there."""
    import cupy

    with cupy.cuda.Device(device.index), torch_stream_for_cupy(device):
        yield


def _launch(name: str, n: int, args: tuple[Any, ...]) -> None:
    blocks = max(1, min(-(-n // THREADS), MAX_BLOCKS))
    _module().get_function(name)((blocks,), (THREADS,), args)


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def encode_payload(c: torch.Tensor) -> torch.Tensor:
    """uint8 device buffer: float32 scales ``[P, L, C]`` then codes ``[P, L, T, C]``."""
    planes, layers, tokens, channels = c.shape
    groups, n = planes * layers, c.numel()
    x = c.contiguous()
    buf = torch.empty(4 * groups * channels + n, dtype=torch.uint8, device=c.device)
    head = buf[: 4 * groups * channels]
    head.zero_()
    codes = buf[4 * groups * channels :]
    kind = np.int32(_KIND[c.dtype])
    nchunks = -(-tokens // TOKEN_CHUNK)
    with _on(c.device):
        _launch(
            "fp8_absmax",
            groups * nchunks * channels,
            (
                _ptr(x),
                kind,
                np.int64(groups),
                np.int64(tokens),
                np.int64(channels),
                np.int64(TOKEN_CHUNK),
                _ptr(head),
            ),
        )
        _launch("fp8_scales", groups * channels, (_ptr(head), np.int64(groups * channels)))
        _launch(
            "fp8_quantize",
            n,
            (
                _ptr(x),
                kind,
                _ptr(head),
                np.int64(tokens),
                np.int64(channels),
                np.int64(n),
                _ptr(codes),
            ),
        )
    return buf


def encode(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, codes)`` on ``c``'s device, as ``gpu.reference.fp8.encode``."""
    planes, layers, tokens, channels = c.shape
    buf = encode_payload(c)
    head = 4 * planes * layers * channels
    scales = buf[:head].view(torch.float32).reshape(planes, layers, channels)
    return scales, buf[head:].reshape(planes, layers, tokens, channels)


def decode(
    scales: torch.Tensor, codes: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The canonical ``[P, L, T, C]`` tensor of ``dtype`` on the codes' device."""
    tokens, channels = codes.shape[2], codes.shape[3]
    n = codes.numel()
    if out is None:
        out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    src = codes.contiguous()
    s = scales.to(device=codes.device, dtype=torch.float32).contiguous()
    with _on(codes.device):
        _launch(
            "fp8_dequantize",
            n,
            (
                _ptr(src),
                _ptr(s),
                np.int64(tokens),
                np.int64(channels),
                np.int64(n),
                np.int32(_KIND[dtype]),
                _ptr(out),
            ),
        )
    return out
