"""fp8 (e4m3) quantization with per-channel scales, in torch: the executable spec.

Input is a canonical ``[planes, layers, tokens, channels]`` tensor (``serde.layout``) of
float16, bfloat16 or float32, on any device. For every (plane, layer, channel):

- ``absmax`` = the largest ``|x|`` over tokens among finite values (NaN and ±inf ignored);
- ``scale = absmax / 448`` in float32 (448 is e4m3's largest finite value), a true IEEE
  division (a tensor divisor: torch multiplies by a rounded reciprocal for scalar divisors on
  CUDA, which would differ from the CPU in the last bit);
- ``code = e4m3(x / scale)``: float32 division (by 1 where the scale is 0, so a zero channel
  codes to zeros), clamped to ±448, rounded to nearest even by torch's float8 cast;
  NaN gives the code ``0x7F`` whatever its sign, ±inf saturates to ±448.

Decoding is ``float32(code) * scale`` (float32, rounded once) cast to the stored dtype (round
to nearest even). Every other implementation (``gpu.cpu.fp8``, ``gpu.cuda.fp8``) produces the
same scales and codes, bit for bit, and the same decoded values (NaN payloads aside).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
NAN_CODE = 0x7F


def channel_scales(c: torch.Tensor) -> torch.Tensor:
    """float32 ``[planes, layers, channels]``: the finite absmax over tokens / 448."""
    x = c.float()
    finite = torch.where(
        torch.isfinite(x), x.abs(), torch.zeros((), dtype=x.dtype, device=x.device)
    )
    absmax = finite.amax(dim=2)
    return absmax / torch.full_like(absmax, E4M3_MAX)


def encode(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, codes)``: float32 ``[P, L, C]`` and uint8 ``[P, L, T, C]`` (contiguous)."""
    scales = channel_scales(c)
    x = c.float()
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(2)
    q = (x / safe).clamp(-E4M3_MAX, E4M3_MAX)
    codes = q.to(torch.float8_e4m3fn).view(torch.uint8)
    codes = torch.where(torch.isnan(x), torch.full_like(codes, NAN_CODE), codes)
    return scales.contiguous(), codes.contiguous()


def decode(scales: torch.Tensor, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``[P, L, T, C]`` tensor of ``dtype`` that ``(scales, codes)`` stand for."""
    values = codes.view(torch.float8_e4m3fn).float() * scales.unsqueeze(2)
    return values.to(dtype)
