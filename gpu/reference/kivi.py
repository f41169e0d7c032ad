"""KIVI quantization in plain torch: the executable spec of the ``kivi`` payload.

The numba (``gpu.cpu.kivi``) and CUDA (``gpu.cuda.kivi``) kernels produce byte-identical
payloads and decode byte-identical tensors; this module says what those bytes are. It runs on
any device (a CUDA tensor is encoded on its GPU).

Input is the canonical view ``[planes, layers, tokens, channels]`` (``serde.layout``). Plane 0
(keys, and any one-plane layout) is quantized per channel: a group is ``group`` consecutive
tokens of one (layer, channel). Plane 1 (values) is quantized per token: a group is ``group``
consecutive channels of one (layer, token). The last group of a row or column may be partial.
The latest ``residual`` tokens of every (plane, layer) are kept verbatim.

Per group, all arithmetic in float32 with one IEEE rounding per operation (so every
implementation gets the same bits; CUDA code must not fuse into FMAs)::

    lo    = min(x)                      hi = max(x)
    min16 = largest float16 <= lo       (float16 round-down; -0 stored as +0)
    s32   = (hi - f32(min16)) * RECIP   RECIP = float32(1 / levels), levels = 2**bits - 1
    sc16  = smallest float16 >= s32     (float16 round-up; -0 stored as +0)
    inv   = 1 / f32(sc16)  (0 when sc16 == 0, i.e. a constant group)
    code  = min(floor((x - f32(min16)) * inv + 0.5), levels)
    x_hat = code * f32(sc16) + f32(min16), rounded to nearest-even in the stored dtype
            (float16 output saturates at +-65504 instead of overflowing to inf)

Rounding ``min16`` down and ``sc16`` up makes ``[min16, min16 + levels * sc16]`` cover the
group, so ``|x - x_hat| <= sc16 / 2`` up to float32 rounding (a few ulp of the operands), plus
the rounding of ``x_hat`` to the stored dtype. Any NaN/inf or any ``|x| > 65504`` (beyond
float16's range: bfloat16 and float32 input) in the quantized tokens makes ``encode`` return
``None``: the codec then stores the object verbatim. (A minimum below -65504 would make
``min16`` -inf; a maximum above 65504 would still give finite statistics, but its group's error
would grow with its distance from the float16 range, so it is refused too. Within the range
``min16`` and ``sc16`` are always finite.)

Payload (little-endian), every size derived from the frame's dtype, shape, format and params::

    residual   [planes, layers, residual, channels]  stored dtype (the latest tokens, verbatim)
    for each plane p:  mins[p], scales[p]            float16 bits, same order
        keys (per channel):  [layers, ceil(q / group), channels]
        values (per token):  [layers, q, ceil(channels / group)]     q = tokens - residual
    for each plane p:  codes[p]                      [layers, q, row_bytes] uint8

A row of ``channels`` codes is packed into ``row_bytes = ceil(channels / per_byte)`` bytes
(``per_byte`` = 4 for 2 bits, 2 for 4 bits): the code of channel ``c`` sits in byte
``c % row_bytes`` at bit ``bits * (c // row_bytes)``; unused slots of the last byte column are
zero. Slicing a row into ``per_byte`` contiguous stripes keeps every pack and unpack loop
contiguous over channels (it vectorizes on CPU and coalesces on GPU), and rows stay byte
aligned; for every real hidden size (a multiple of 4) no bit is wasted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LEVELS = {2: 3, 4: 15}
# float32(1/3) and float32(1/15): a multiplication by a constant is one IEEE rounding everywhere.
RECIP = {2: 0.3333333432674408, 4: 0.06666667014360428}
FP16_MAX = 65504.0
F16_NONFINITE = 0x7C00  # exponent bits of an inf or NaN float16
KIND = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


@dataclass(frozen=True, slots=True)
class KiviGeometry:
    """Every size and offset of a payload, from what the frame records."""

    planes: int
    layers: int
    tokens: int
    channels: int
    bits: int
    group: int
    residual: int  # the number of latest tokens kept verbatim (<= tokens)
    itemsize: int  # of the stored dtype

    @property
    def quant_tokens(self) -> int:
        return self.tokens - self.residual

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    @property
    def row_bytes(self) -> int:
        return -(-self.channels // self.per_byte)

    @property
    def key_groups(self) -> int:
        """Token groups per (layer, channel) of a per-channel plane."""
        return -(-self.quant_tokens // self.group)

    @property
    def value_groups(self) -> int:
        """Channel groups per (layer, token) of a per-token plane."""
        return -(-self.channels // self.group)

    @staticmethod
    def per_channel(plane: int) -> bool:
        return plane == 0

    def stats_count(self, plane: int) -> int:
        if self.per_channel(plane):
            return self.layers * self.key_groups * self.channels
        return self.layers * self.quant_tokens * self.value_groups

    @property
    def residual_bytes(self) -> int:
        return self.planes * self.layers * self.residual * self.channels * self.itemsize

    def stats_offset(self, plane: int) -> int:
        """Byte offset of ``mins[plane]`` (``scales[plane]`` follows it)."""
        return self.residual_bytes + sum(4 * self.stats_count(p) for p in range(plane))

    @property
    def plane_code_bytes(self) -> int:
        return self.layers * self.quant_tokens * self.row_bytes

    def codes_offset(self, plane: int) -> int:
        return self.stats_offset(self.planes) + plane * self.plane_code_bytes

    @property
    def total(self) -> int:
        return self.codes_offset(self.planes)

    @property
    def numel(self) -> int:
        return self.planes * self.layers * self.tokens * self.channels


def geometry(
    shape: tuple[int, int, int, int], dtype: torch.dtype, bits: int, group: int, residual: int
) -> KiviGeometry:
    planes, layers, tokens, channels = shape
    itemsize = torch.empty((), dtype=dtype).element_size()
    res = min(residual, tokens)
    return KiviGeometry(planes, layers, tokens, channels, bits, group, res, itemsize)


# --- float16 helpers (bits as int32 tensors in 0..65535) ---------------------------------------


def f16_bits(h: torch.Tensor) -> torch.Tensor:
    return h.view(torch.int16).to(torch.int32) & 0xFFFF


def f16_int16(bits: torch.Tensor) -> torch.Tensor:
    """float16 bit patterns (int32 in 0..65535) as an int16 tensor (wrapped explicitly)."""
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)


def f16_value(bits: torch.Tensor) -> torch.Tensor:
    """float32 values of float16 bit patterns (int32 tensor)."""
    return f16_int16(bits).view(torch.float16).float()


def round_down_f16(v: torch.Tensor) -> torch.Tensor:
    """Bits of the largest float16 <= v (float32 tensor), with -0 canonicalized to +0."""
    b = f16_bits(v.half())
    above = f16_value(b) > v
    step = torch.where(b == 0, 0x8001, torch.where(b >= 0x8000, b + 1, b - 1))
    b = torch.where(above, step, b)
    return torch.where(b == 0x8000, 0, b)


def round_up_f16(v: torch.Tensor) -> torch.Tensor:
    """Bits of the smallest float16 >= v for v >= 0 (float32 tensor); -0 becomes +0."""
    b = f16_bits(v.half())
    b = torch.where(f16_value(b) < v, b + 1, b)
    return torch.where(b == 0x8000, 0, b)


def group_stats(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min16, sc16) bit patterns for groups with float32 minima ``lo`` and maxima ``hi``."""
    mins = round_down_f16(lo)
    recip = torch.tensor(RECIP[bits], dtype=torch.float32, device=lo.device)
    scales = round_up_f16((hi - f16_value(mins)) * recip)
    return mins, scales


def finite_f16(bits: torch.Tensor) -> bool:
    return not bool(((bits & F16_NONFINITE) == F16_NONFINITE).any())


def _expand(t: torch.Tensor, dim: int, group: int, size: int) -> torch.Tensor:
    return t.repeat_interleave(group, dim=dim).narrow(dim, 0, size)


def _group_reduce(x: torch.Tensor, dim: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of consecutive ``group``-long slices along ``dim`` (last one partial)."""
    size = x.shape[dim]
    pad = -size % group
    if pad:  # repeat the last slice: it changes neither the min nor the max of its group
        fill = list(x.shape)
        fill[dim] = pad
        x = torch.cat([x, x.narrow(dim, size - 1, 1).expand(fill)], dim)
    shape = list(x.shape)
    shape[dim : dim + 1] = [shape[dim] // group, group]
    x = x.reshape(shape)
    return x.amin(dim=dim + 1), x.amax(dim=dim + 1)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., channels]`` codes (uint8) -> ``[..., row_bytes]`` (see the module docstring)."""
    per_byte = 8 // bits
    channels = codes.shape[-1]
    rb = -(-channels // per_byte)
    padded = torch.nn.functional.pad(codes, (0, per_byte * rb - channels))
    stripes = padded.reshape(*codes.shape[:-1], per_byte, rb).to(torch.int32)
    out = torch.zeros_like(stripes[..., 0, :])
    for s in range(per_byte):
        out |= stripes[..., s, :] << (bits * s)
    return out.to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, channels: int) -> torch.Tensor:
    """``[..., row_bytes]`` -> ``[..., channels]`` codes (uint8)."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    p = packed.to(torch.int32)
    stripes = [(p >> (bits * s)) & mask for s in range(per_byte)]
    return torch.cat(stripes, dim=-1)[..., :channels].to(torch.uint8)


def _plane_stats(x: torch.Tensor, g: KiviGeometry, plane: int) -> tuple[torch.Tensor, ...]:
    """(mins bits, scales bits, per-element min, per-element inverse scale) of one plane."""
    per_channel = g.per_channel(plane)
    dim = 1 if per_channel else 2
    lo, hi = _group_reduce(x, dim, g.group)
    mins, scales = group_stats(lo, hi, g.bits)
    size = x.shape[dim]
    mn = _expand(f16_value(mins), dim, g.group, size)
    sc = f16_value(scales)
    inv = torch.where(sc > 0, torch.reciprocal(sc), torch.zeros_like(sc))
    return mins, scales, mn, _expand(inv, dim, g.group, size)


def encode(canon: torch.Tensor, g: KiviGeometry) -> torch.Tensor | None:
    """The payload (uint8, on ``canon``'s device) of a canonical tensor, or ``None`` when it
    holds NaN/inf or values beyond float16's range (store it verbatim)."""
    q = g.quant_tokens
    parts = [canon[:, :, q:, :].contiguous().reshape(-1).view(torch.uint8)]
    codes = []
    for plane in range(g.planes):
        x = canon[plane, :, :q, :].float()
        if x.numel() == 0:
            continue
        if not bool(torch.isfinite(x).all()) or bool((x.abs() > FP16_MAX).any()):
            return None
        mins, scales, mn, inv = _plane_stats(x, g, plane)
        if not (finite_f16(mins) and finite_f16(scales)):
            return None
        for stat in (mins, scales):
            parts.append(f16_int16(stat).reshape(-1).view(torch.uint8))
        code = torch.floor((x - mn) * inv + 0.5).clamp_(max=LEVELS[g.bits]).to(torch.uint8)
        codes.append(pack(code, g.bits).reshape(-1))
    return torch.cat(parts + codes)


def decode(payload: torch.Tensor, g: KiviGeometry, dtype: torch.dtype) -> torch.Tensor:
    """The canonical ``[planes, layers, tokens, channels]`` tensor of ``dtype`` (on
    ``payload``'s device) from a payload of exactly ``g.total`` bytes (uint8 tensor)."""
    if payload.numel() != g.total:
        raise ValueError(f"kivi payload is {payload.numel()} bytes, expected {g.total}")
    q = g.quant_tokens
    out = torch.empty(g.planes, g.layers, g.tokens, g.channels, dtype=dtype, device=payload.device)
    res = payload[: g.residual_bytes].view(dtype)
    out[:, :, q:, :] = res.reshape(g.planes, g.layers, g.residual, g.channels)
    if q == 0:
        return out
    for plane in range(g.planes):
        n = g.stats_count(plane)
        start = g.stats_offset(plane)
        stats = payload[start : start + 4 * n].view(torch.int16).to(torch.int32) & 0xFFFF
        mins, scales = f16_value(stats[:n]), f16_value(stats[n:])
        if g.per_channel(plane):
            shape, dim = (g.layers, g.key_groups, g.channels), 1
        else:
            shape, dim = (g.layers, q, g.value_groups), 2
        size = q if dim == 1 else g.channels
        mn = _expand(mins.reshape(shape), dim, g.group, size)
        sc = _expand(scales.reshape(shape), dim, g.group, size)
        start = g.codes_offset(plane)
        packed = payload[start : start + g.plane_code_bytes].reshape(g.layers, q, g.row_bytes)
        x = unpack(packed, g.bits, g.channels).float() * sc + mn
        if dtype == torch.float16:
            x = x.clamp_(-FP16_MAX, FP16_MAX)
        out[plane, :, :q, :] = x.to(dtype)
    return out


def max_error(canon: torch.Tensor, g: KiviGeometry) -> torch.Tensor:
    """Per-element error bound ``sc16 / 2`` of each quantized element (float32, canonical
    shape; 0 for residual tokens), before rounding to the stored dtype."""
    bound = torch.zeros(canon.shape, dtype=torch.float32, device=canon.device)
    q = g.quant_tokens
    for plane in range(g.planes):
        x = canon[plane, :, :q, :].float()
        if x.numel() == 0:
            continue
        per_channel = g.per_channel(plane)
        dim = 1 if per_channel else 2
        lo, hi = _group_reduce(x, dim, g.group)
        _, scales = group_stats(lo, hi, g.bits)
        bound[plane, :, :q, :] = _expand(f16_value(scales), dim, g.group, x.shape[dim]) / 2
    return bound
