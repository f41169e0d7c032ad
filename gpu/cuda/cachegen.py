"""CacheGen on a CUDA device: cupy raw kernels with the reference's results, one rANS stream
per thread.

The spec is ``gpu.reference.cachegen``. The float64 statistics and the histogram are the
reference's own torch code run on the device (reductions torch does well; they are integers
or only need to agree to ~1e-13). Three raw kernels do the rest:

- ``cg_quantize``: one thread per (plane, layer, channel) walks the channel's tokens (threads
  of a warp read consecutive channels: coalesced), reading the stored dtype in place through
  its strides, and writes the channel's symbols, largest ``|u|`` and sum of squares;
- ``cg_encode``: one thread per stream codes its block of channels backwards into its own
  slice of a word buffer (at most one word per symbol, plus the final state); the slices are
  then joined on the device and only the payload's bytes cross to the host;
- ``cg_decode``: one thread per stream decodes and dequantizes into a float32 model view
  (the codec decodes on the host; this kernel is checked against the reference on a GPU).

Every float operation is an explicit round-to-nearest intrinsic (``__fsub_rn``, ``__fmul_rn``,
``__fadd_rn``): NVRTC would otherwise fuse multiply-adds and round differently from the CPU.
The coder is integer arithmetic (64-bit products, the reciprocal of ``gpu.cpu.rans``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from gpu.cpu.cachegen_source import KIND
from gpu.cupy_stream import torch_stream_for_cupy
from gpu.reference import cachegen as ref
from serde.cachegen.tables import CTX_START, NCLS, NCTX, NSYM, PREC, QMAX, THRESHOLDS, Tables

THREADS = 128

CUDA_SOURCE = (
    r"""
typedef signed char i8;
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;
"""
    + f"""
#define QMAX {QMAX}
#define NSYM {NSYM}
#define NCLS {NCLS}
#define NCTX {NCTX}
#define CTX_START {CTX_START}
#define PREC {PREC}
"""
    + r"""
#define RANS_L (1ull << 16)
#define TOTAL (1ull << PREC)

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float load(u64 src, int kind, i64 i) {
    if (kind == 1) return h2f(((const u16*)src)[i]);
    if (kind == 2) return __uint_as_float(((u32)((const u16*)src)[i]) << 16);
    return ((const float*)src)[i];
}

__device__ __forceinline__ int context(int prev, int th1, int th2) {
    int a = prev < 0 ? -prev : prev;
    int m = (a > th1) + (a > th2);
    return CTX_START + ((prev > 0) - (prev < 0)) * m;
}

extern "C" __global__ void cg_quantize(
    u64 src, int kind, i64 off, i64 sp, i64 sl, i64 st, i64 sc,
    const float* cval, const float* icstep, const float* itfac,
    int layers, int tokens, int channels, i64 columns,
    i8* sym, float* maxu, i64* sumsq)
{
    for (i64 id = blockIdx.x * (i64)blockDim.x + threadIdx.x; id < columns;
         id += (i64)gridDim.x * blockDim.x) {
        i64 c = id % channels, pl = id / channels;
        i64 p = pl / layers, lay = pl % layers;
        i64 base = off + p * sp + lay * sl + c * sc;
        float cv = cval[id], ic = icstep[id], mx = 0.0f;
        i64 sq = 0;
        for (int t = 0; t < tokens; ++t) {
            float v = load(src, kind, base + t * st);
            float u = __fmul_rn(__fmul_rn(__fsub_rn(v, cv), ic), itfac[pl * tokens + t]);
            mx = fmaxf(mx, fabsf(u));
            int q = (int)fminf(fmaxf(rintf(u), -(float)QMAX), (float)QMAX);
            sym[id * tokens + t] = (i8)q;
            sq += (i64)q * q;
        }
        maxu[id] = mx;
        sumsq[id] = sq;
    }
}

extern "C" __global__ void cg_encode(
    const i8* sym, const u8* cls, const int* th, const u32* ent,
    int layers, int channels, int tokens, int block, int streams,
    u16* buf, i64 cap, i64* lengths)
{
    int nblocks = (channels + block - 1) / block;
    for (int s = blockIdx.x * blockDim.x + threadIdx.x; s < streams;
         s += gridDim.x * blockDim.x) {
        int pl = s / nblocks, b = s % nblocks, p = pl / layers;
        u16* out = buf + (i64)s * cap;
        i64 pos = cap;
        u64 x = RANS_L;
        for (int c = min(channels, (b + 1) * block) - 1; c >= b * block; --c) {
            int k = cls[(i64)pl * channels + c];
            int base = (p * NCLS + k) * NCTX;
            const i8* row = sym + ((i64)pl * channels + c) * tokens;
            for (int t = tokens - 1; t >= 0; --t) {
                int prev = t > 0 ? (int)row[t - 1] : 0;
                int ctx = context(prev, th[2 * k], th[2 * k + 1]);
                const u32* e = ent + ((i64)(base + ctx) * NSYM + (int)row[t] + QMAX) * 4;
                u64 cm = e[3];
                if (x >= ((TOTAL - cm) << (32 - PREC))) {
                    out[--pos] = (u16)(x & 0xffffu);
                    x >>= 16;
                }
                u64 q = (((x * (u64)e[0]) >> 32) + x) >> e[1];
                x = x + e[2] + q * cm;
            }
        }
        out[pos - 1] = (u16)(x & 0xffffu);
        out[pos - 2] = (u16)(x >> 16);
        lengths[s] = cap - pos + 2;
    }
}

extern "C" __global__ void cg_decode(
    const u16* words, const i64* offsets, const u8* cls, const u8* used,
    const u32* dent, const u16* lut, int layers, int channels, int tokens, int block,
    int streams, const float* cval, const float* cstep, const float* tfac,
    float* out, u8* ok)
{
    int nblocks = (channels + block - 1) / block;
    for (int s = blockIdx.x * blockDim.x + threadIdx.x; s < streams;
         s += gridDim.x * blockDim.x) {
        int pl = s / nblocks, b = s % nblocks, p = pl / layers;
        i64 pos = offsets[s], end = offsets[s + 1];
        bool good = end - pos >= 2;
        i64 last = end - 1 > pos ? end - 1 : pos;
        u64 x = ((u64)words[min(pos, last)] << 16) | words[min(pos + 1, last)];
        pos += 2;
        for (int c = b * block; c < min(channels, (b + 1) * block); ++c) {
            i64 col = (i64)pl * channels + c;
            int base = (p * NCLS + cls[col]) * NCTX;
            float cv = cval[col], cs = cstep[col];
            int d = base + CTX_START;
            for (int t = 0; t < tokens; ++t) {
                good = good && used[d];
                u64 slot = x & (TOTAL - 1);
                u32 v = lut[((i64)d << PREC) | slot];  // symbol | next context << 8
                int i = v & 0xff;
                u64 e = dent[(i64)d * NSYM + i];  // freq | start << 16
                x = (e & 0xffffu) * (x >> PREC) + slot - (e >> 16);
                if (x < RANS_L) {
                    good = good && pos < end;
                    x = (x << 16) | words[min(pos, last)];
                    ++pos;
                }
                float step = __fmul_rn(cs, tfac[(i64)pl * tokens + t]);
                out[((i64)pl * tokens + t) * channels + c] =
                    __fadd_rn(cv, __fmul_rn((float)(i - QMAX), step));
                d = base + (int)(v >> 8);
            }
        }
        ok[s] = good && x == RANS_L && pos == end;
    }
}
"""
)


@functools.cache
def _module() -> Any:
    import cupy

    return cupy.RawModule(code=CUDA_SOURCE, options=("--std=c++17",))


def _stream(device: torch.device) -> Any:
    return torch_stream_for_cupy(device)


def _launch(name: str, device: torch.device, n: int, args: tuple[Any, ...]) -> None:
    import cupy

    blocks = max(1, min(65535, -(-n // THREADS)))
    with cupy.cuda.Device(device.index), _stream(device):
        _module().get_function(name)((blocks,), (THREADS,), args)


def _cupy(t: torch.Tensor) -> Any:
    import cupy

    return cupy.asarray(t.contiguous())


stats = ref.stats
histogram = ref.histogram


def quantize(
    x: torch.Tensor, cval: torch.Tensor, icstep: torch.Tensor, itfac: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    planes, layers, tokens, channels = x.shape
    dev = x.device
    sym = torch.empty((planes, layers, channels, tokens), dtype=torch.int8, device=dev)
    maxu = torch.empty((planes, layers, channels), dtype=torch.float32, device=dev)
    sumsq = torch.empty((planes, layers, channels), dtype=torch.int64, device=dev)
    sp, sl, st, sc = (np.int64(s) for s in x.stride())
    ptr = np.uint64(x.data_ptr() - x.storage_offset() * x.element_size())
    columns = planes * layers * channels
    args = (
        ptr,
        np.int32(KIND[x.dtype]),
        np.int64(x.storage_offset()),
        sp,
        sl,
        st,
        sc,
        _cupy(cval),
        _cupy(icstep),
        _cupy(itfac),
        np.int32(layers),
        np.int32(tokens),
        np.int32(channels),
        np.int64(columns),
        _cupy(sym),
        _cupy(maxu),
        _cupy(sumsq),
    )
    _launch("cg_quantize", dev, columns, args)
    return sym, maxu, sumsq


def _entries(tables: Tables, planes: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    from gpu.cpu import rans  # numpy helpers (importing it needs numba, like the CPU path)

    freq, cum = rans.by_id(tables, planes)
    to = functools.partial(torch.as_tensor, device=dev)
    return (
        to(rans.encoder_table(tables, planes).view(np.int32)),
        to(rans.decoder_entries(freq, cum).view(np.int32)),
        to(rans.context_lut(tables, planes).view(np.int16)),
        to((tables.tmap >= 0).astype(np.uint8)),
    )


def encode(
    sym: torch.Tensor, cls: torch.Tensor, tables: Tables, block: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    planes, layers, channels, tokens = sym.shape
    dev = sym.device
    streams = planes * layers * (-(-channels // block))
    cap = block * tokens + 2
    buf = torch.empty((streams, cap), dtype=torch.int16, device=dev)
    lengths = torch.empty(streams, dtype=torch.int64, device=dev)
    ent = _entries(tables, planes, dev)[0]
    th = torch.as_tensor(THRESHOLDS.reshape(-1), device=dev)
    args = (
        _cupy(sym),
        _cupy(cls),
        _cupy(th),
        _cupy(ent),
        np.int32(layers),
        np.int32(channels),
        np.int32(tokens),
        np.int32(block),
        np.int32(streams),
        _cupy(buf),
        np.int64(cap),
        _cupy(lengths),
    )
    _launch("cg_encode", dev, streams, args)
    keep = torch.arange(cap, device=dev)[None, :] >= (cap - lengths)[:, None]
    words = buf[keep].cpu().numpy().view(np.uint16)
    return words, lengths.cpu().numpy()


def decode(
    words: np.ndarray[Any, Any],
    offsets: np.ndarray[Any, Any],
    cls: np.ndarray[Any, Any],
    tables: Tables,
    block: int,
    cval: np.ndarray[Any, Any],
    cstep: np.ndarray[Any, Any],
    tfac: np.ndarray[Any, Any],
    device: Any = "cuda",
) -> tuple[torch.Tensor, bool]:
    """The reference's contract, computed on ``device``: ``(x_hat [P, L, T, D], clean)``."""
    dev = torch.device(device)
    planes, layers, tokens = tfac.shape
    channels = cls.shape[2]
    streams = planes * layers * (-(-channels // block))
    _, dent, lut, used = _entries(tables, planes, dev)
    to = functools.partial(torch.as_tensor, device=dev)
    out = torch.empty((planes, layers, tokens, channels), dtype=torch.float32, device=dev)
    ok = torch.zeros(streams, dtype=torch.uint8, device=dev)
    args = (
        _cupy(to(words.view(np.int16))),
        _cupy(to(offsets.astype(np.int64))),
        _cupy(to(cls)),
        _cupy(used),
        _cupy(dent),
        _cupy(lut),
        np.int32(layers),
        np.int32(channels),
        np.int32(tokens),
        np.int32(block),
        np.int32(streams),
        _cupy(to(cval)),
        _cupy(to(cstep)),
        _cupy(to(tfac)),
        _cupy(out),
        _cupy(ok),
    )
    _launch("cg_decode", dev, streams, args)
    return out, bool(ok.all())
