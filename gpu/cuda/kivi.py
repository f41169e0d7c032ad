"""KIVI on a CUDA device: cupy raw kernels that produce the reference's bytes.

The math and the payload layout are ``gpu.reference.kivi``'s. Three kernels, grid-stride loops:

- ``kivi_stats``: one thread per group computes min/max and the float16 (min, scale) pair;
  per-channel planes walk ``group`` tokens of one channel (consecutive threads read
  consecutive channels: coalesced), per-token planes walk ``group`` channels of one token.
- ``kivi_pack``: one thread per output byte quantizes its ``per_byte`` channels and packs them.
- ``kivi_unpack``: one thread per payload byte unpacks and dequantizes into the stored dtype.

Every float operation is an explicit round-to-nearest intrinsic (``__fsub_rn``, ``__fmul_rn``,
``__fadd_rn``, ``__frcp_rn``): NVRTC would otherwise fuse multiply-adds into FMAs and round
differently from the CPU. 16-bit floats are ``unsigned short`` bits converted with PTX ``cvt``
(no CUDA headers needed). The payload is built on the device and only its bytes cross to the
host; NaN/inf input and values beyond float16's range are reported through a device flag so
the codec can store raw instead.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from gpu.cupy_stream import torch_stream_for_cupy
from gpu.reference.kivi import KIND, RECIP, KiviGeometry

CUDA_SOURCE = r"""
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ u16 f2bf(float f) {  // round to nearest even; NaN -> 0x7FC0
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)0x7fc0u;  // as torch (never reached)
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

__device__ __forceinline__ float load(const void* src, int kind, i64 i) {
    if (kind == 0) return h2f(((const u16*)src)[i]);
    if (kind == 1) return __uint_as_float(((u32)((const u16*)src)[i]) << 16);
    return ((const float*)src)[i];
}

__device__ __forceinline__ void store(void* dst, int kind, i64 i, float v) {
    if (kind == 0) {
        v = fminf(fmaxf(v, -65504.0f), 65504.0f);  // saturate, as the reference does
        ((u16*)dst)[i] = f2h(v);
    } else if (kind == 1) {
        ((u16*)dst)[i] = f2bf(v);
    } else {
        ((float*)dst)[i] = v;
    }
}

__device__ __forceinline__ int nonfinite(float v) { return __fsub_rn(v, v) != 0.0f; }

__device__ __forceinline__ int nonfinite16(u32 bits) { return (bits & 0x7c00u) == 0x7c00u; }

// Index of the (min, scale) pair of element (layer, token, channel) of a plane.
__device__ __forceinline__ i64 stat_index(
    int per_channel, i64 layer, i64 t, i64 c, i64 tokens, i64 channels, i64 group) {
    if (per_channel) {
        i64 ngt = (tokens + group - 1) / group;
        return (layer * ngt + t / group) * channels + c;
    }
    i64 ngc = (channels + group - 1) / group;
    return (layer * tokens + t) * ngc + c / group;
}

extern "C" __global__ void kivi_stats(
    const void* src, int kind, i64 base, i64 sl, i64 st, i64 layers, i64 tokens,
    i64 channels, i64 group, float recip, int per_channel, u16* mins, u16* scales,
    int* bad) {
    i64 ngt = (tokens + group - 1) / group;
    i64 ngc = (channels + group - 1) / group;
    i64 n = per_channel ? layers * ngt * channels : layers * tokens * ngc;
    i64 stride = (i64)blockDim.x * gridDim.x;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
        i64 first, step, count;
        if (per_channel) {  // k = (layer, token group, channel)
            i64 c = k % channels, r = k / channels, gi = r % ngt, layer = r / ngt;
            i64 t0 = gi * group;
            count = min(group, tokens - t0);
            first = base + layer * sl + t0 * st + c;
            step = st;
        } else {  // k = (layer, token, channel group)
            i64 gi = k % ngc, r = k / ngc, t = r % tokens, layer = r / tokens;
            i64 c0 = gi * group;
            count = min(group, channels - c0);
            first = base + layer * sl + t * st + c0;
            step = 1;
        }
        float lo = load(src, kind, first), hi = lo;
        int b = nonfinite(lo);
        for (i64 i = 1; i < count; ++i) {
            float v = load(src, kind, first + i * step);
            b |= nonfinite(v);
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        u32 m = f2h(lo);  // round down to float16
        if (h2f((u16)m) > lo) m = (m == 0u) ? 0x8001u : (m >= 0x8000u ? m + 1u : m - 1u);
        if (m == 0x8000u) m = 0u;
        float s32 = __fmul_rn(__fsub_rn(hi, h2f((u16)m)), recip);
        u32 s = f2h(s32);  // round up to float16
        if (h2f((u16)s) < s32) s += 1u;
        if (s == 0x8000u) s = 0u;
        mins[k] = (u16)m;
        scales[k] = (u16)s;
        // NaN/inf input, or beyond float16's range (a max above 65504, a min16 of -inf).
        if (b | nonfinite16(m) | nonfinite16(s) | (hi > 65504.0f)) atomicOr(bad, 1);
    }
}

extern "C" __global__ void kivi_pack(
    const void* src, int kind, i64 base, i64 sl, i64 st, i64 layers, i64 tokens,
    i64 channels, i64 group, int bits, int per_channel, const u16* mins,
    const u16* scales, u8* codes) {
    int per_byte = 8 / bits;
    int levels = (1 << bits) - 1;
    i64 rb = (channels + per_byte - 1) / per_byte;
    i64 n = layers * tokens * rb;
    i64 stride = (i64)blockDim.x * gridDim.x;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
        i64 j = k % rb, row = k / rb, t = row % tokens, layer = row / tokens;
        u32 byte = 0;
        for (int s = 0; s < per_byte; ++s) {
            i64 c = s * rb + j;
            if (c >= channels) break;
            i64 si = stat_index(per_channel, layer, t, c, tokens, channels, group);
            float mn = h2f(mins[si]);
            float sc = h2f(scales[si]);
            float inv = sc > 0.0f ? __frcp_rn(sc) : 0.0f;
            float x = load(src, kind, base + layer * sl + t * st + c);
            float y = __fadd_rn(__fmul_rn(__fsub_rn(x, mn), inv), 0.5f);
            int code = min((int)y, levels);  // y >= 0.5: truncation is floor
            byte |= ((u32)code) << (bits * s);
        }
        codes[k] = (u8)byte;
    }
}

extern "C" __global__ void kivi_unpack(
    const u8* codes, const u16* mins, const u16* scales, void* dst, int kind, i64 base,
    i64 sl, i64 st, i64 layers, i64 tokens, i64 channels, i64 group, int bits,
    int per_channel) {
    int per_byte = 8 / bits;
    u32 mask = (1u << bits) - 1u;
    i64 rb = (channels + per_byte - 1) / per_byte;
    i64 n = layers * tokens * rb;
    i64 stride = (i64)blockDim.x * gridDim.x;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
        i64 j = k % rb, row = k / rb, t = row % tokens, layer = row / tokens;
        u32 byte = codes[k];
        for (int s = 0; s < per_byte; ++s) {
            i64 c = s * rb + j;
            if (c >= channels) break;
            i64 si = stat_index(per_channel, layer, t, c, tokens, channels, group);
            float code = (float)((byte >> (bits * s)) & mask);
            float v = __fadd_rn(__fmul_rn(code, h2f(scales[si])), h2f(mins[si]));
            store(dst, kind, base + layer * sl + t * st + c, v);
        }
    }
}
"""

THREADS = 256
MAX_BLOCKS = 65535


@functools.cache
def _module() -> Any:
    import cupy

    return cupy.RawModule(code=CUDA_SOURCE, options=("--std=c++17",))


def _launch(name: str, n: int, args: tuple[Any, ...]) -> None:
    if n <= 0:
        return
    blocks = min(MAX_BLOCKS, -(-n // THREADS))
    _module().get_function(name)((blocks,), (THREADS,), args)


def _cupy(t: torch.Tensor) -> Any:
    """A zero-copy cupy view of a CUDA tensor (bfloat16 seen as its int16 bits)."""
    import cupy

    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return cupy.asarray(t)


def _flat(t: torch.Tensor) -> torch.Tensor:
    size = t.untyped_storage().nbytes() // t.element_size()
    return t.as_strided((size,), (1,), 0)


def _stats_views(payload: torch.Tensor, g: KiviGeometry, plane: int) -> tuple[Any, Any, Any]:
    n = g.stats_count(plane)
    start = g.stats_offset(plane)
    stats = _cupy(payload[start : start + 4 * n].view(torch.int16))
    code_start = g.codes_offset(plane)
    return stats[:n], stats[n:], _cupy(payload[code_start : code_start + g.plane_code_bytes])


def _stream(device: torch.device) -> Any:
    return torch_stream_for_cupy(device)


def encode_device(canon: torch.Tensor, g: KiviGeometry) -> torch.Tensor | None:
    """The payload as a uint8 CUDA tensor, or ``None`` when the tensor must be stored raw."""
    import cupy

    if canon.shape[-1] > 1 and canon.stride(-1) != 1:
        canon = canon.contiguous()
    q = g.quant_tokens
    payload = torch.empty(g.total, dtype=torch.uint8, device=canon.device)
    if g.residual_bytes:
        res = payload[: g.residual_bytes].view(canon.dtype)
        res.view(g.planes, g.layers, g.residual, g.channels).copy_(canon[:, :, q:, :])
    if q == 0:
        return payload
    src = _cupy(_flat(canon))
    bad = torch.zeros(1, dtype=torch.int32, device=canon.device)
    kind = np.int32(KIND[canon.dtype])
    off = canon.storage_offset()
    sp, sl, st, _ = canon.stride()
    i64 = np.int64
    with cupy.cuda.Device(canon.device.index), _stream(canon.device):
        for plane in range(g.planes):
            mins, scales, codes = _stats_views(payload, g, plane)
            pc = np.int32(g.per_channel(plane))
            base = i64(off + plane * sp)
            shape = (i64(sl), i64(st), i64(g.layers), i64(q), i64(g.channels), i64(g.group))
            _launch(
                "kivi_stats",
                g.stats_count(plane),
                (src, kind, base, *shape, np.float32(RECIP[g.bits]), pc, mins, scales,
                 _cupy(bad)),
            )  # fmt: skip
            _launch(
                "kivi_pack",
                g.plane_code_bytes,
                (src, kind, base, *shape, np.int32(g.bits), pc, mins, scales, codes),
            )
    if int(bad.item()):
        return None
    return payload


def encode(canon: torch.Tensor, g: KiviGeometry) -> memoryview | None:
    """The payload on the host (only the payload bytes cross from the GPU)."""
    payload = encode_device(canon, g)
    if payload is None:
        return None
    return payload.cpu().numpy().data.cast("B")


def decode(payload: torch.Tensor, g: KiviGeometry, dtype: torch.dtype) -> torch.Tensor:
    """The canonical tensor of ``dtype`` on ``payload``'s device (a uint8 CUDA tensor of
    exactly ``g.total`` bytes)."""
    import cupy

    if payload.numel() != g.total:
        raise ValueError(f"kivi payload is {payload.numel()} bytes, expected {g.total}")
    q = g.quant_tokens
    shape4 = (g.planes, g.layers, g.tokens, g.channels)
    out = torch.empty(shape4, dtype=dtype, device=payload.device)
    if g.residual_bytes:
        res = payload[: g.residual_bytes].view(dtype)
        out[:, :, q:, :] = res.view(g.planes, g.layers, g.residual, g.channels)
    if q == 0:
        return out
    dst = _cupy(out)
    kind = np.int32(KIND[dtype])
    sp, sl, st, _ = out.stride()
    i64 = np.int64
    with cupy.cuda.Device(payload.device.index), _stream(payload.device):
        for plane in range(g.planes):
            mins, scales, codes = _stats_views(payload, g, plane)
            shape = (i64(sl), i64(st), i64(g.layers), i64(q), i64(g.channels), i64(g.group))
            _launch(
                "kivi_unpack",
                g.plane_code_bytes,
                (codes, mins, scales, dst, kind, i64(plane * sp), *shape, np.int32(g.bits),
                 np.int32(g.per_channel(plane))),
            )  # fmt: skip
    return out
