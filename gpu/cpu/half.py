"""float16 / bfloat16 <-> float32 conversions for numba CPU kernels.

numba has no float16 type on the CPU, so 16-bit floats travel as ``uint16`` bits. With the
F16C instructions (every x86-64 CPU since 2012) or on ARM64, LLVM's ``half`` type converts in
hardware: ``h2f`` and ``f2h`` are intrinsics that bitcast to ``half`` and extend or truncate,
which LLVM vectorizes (``vcvtph2ps`` / ``vcvtps2ph``, round-to-nearest-even like torch). On an
x86 CPU without F16C that would become a runtime-library call numba may not link, so the same
functions are then bit arithmetic (exact too, slower).

bfloat16 is the top half of a float32: ``bf2f`` shifts, ``f2bf`` rounds to nearest-even by
hand (every NaN becomes the quiet NaN 0x7FC0).
"""

from __future__ import annotations

import platform
from typing import Any

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


def _hardware_half() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True  # ARM64 and others convert natively
    try:
        return bool(llvm.get_host_cpu_features().get("f16c", False))
    except Exception:  # pragma: no cover - feature query unavailable: be safe
        return False


HARDWARE_HALF = _hardware_half()


@intrinsic
def _f32_bits(typingctx: Any, f: Any) -> Any:
    """The bits of a float32 as uint32 (a plain bitcast)."""
    sig = types.uint32(types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def _bits_f32(typingctx: Any, u: Any) -> Any:
    """The float32 with bits ``u`` (uint32)."""
    sig = types.float32(types.uint32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def _h2f_hw(typingctx: Any, h: Any) -> Any:
    sig = types.float32(types.uint16)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def _f2h_hw(typingctx: Any, f: Any) -> Any:
    sig = types.uint16(types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


# Typed as Any: mypy cannot see through numba's intrinsic decorator (calls are compiled).
f32_bits: Any = _f32_bits
bits_f32: Any = _bits_f32
_h2f: Any = _h2f_hw
_f2h: Any = _f2h_hw

_F16_EXP = np.int64(0x7C00 << 13)
_MAGIC = np.uint32(113 << 23)  # 2**-14 as float32 bits
_DENORM = np.uint32(126 << 23)  # 0.5 as float32 bits: aligns a float16 subnormal's ulp


@njit(nogil=True, cache=False, inline="always")
def h2f_soft(h: Any) -> Any:
    """float16 bits -> float32 without F16C (Fabian Giesen's half_to_float)."""
    o: Any = (np.int64(h) & 0x7FFF) << 13
    exp = o & _F16_EXP
    o += (127 - 15) << 23
    if exp == _F16_EXP:  # inf / NaN
        o += (128 - 16) << 23
    elif exp == 0:  # zero / subnormal: renormalize through a float subtraction
        o += 1 << 23
        o = np.int64(f32_bits(bits_f32(np.uint32(o)) - bits_f32(_MAGIC)))
    o |= (np.int64(h) & 0x8000) << 16
    return bits_f32(np.uint32(o))


@njit(nogil=True, cache=False, inline="always")
def f2h_soft(f: Any) -> Any:
    """float32 -> float16 bits, round to nearest even, without F16C (Giesen's fast3_rtne)."""
    u = np.int64(f32_bits(f))
    sign = u & 0x80000000
    u ^= sign
    o: Any
    if u >= (143 << 23):  # overflow to inf, or inf / NaN
        o = 0x7E00 if u > 0x7F800000 else 0x7C00
    elif u < (113 << 23):  # a float16 subnormal or zero: the float add rounds to even
        o = np.int64(f32_bits(bits_f32(np.uint32(u)) + bits_f32(_DENORM))) - (126 << 23)
    else:
        odd = (u >> 13) & 1
        o = (u + ((15 - 127) << 23) + 0xFFF + odd) >> 13
    return np.uint16(o | (sign >> 16))


h2f: Any = _h2f if HARDWARE_HALF else h2f_soft
f2h: Any = _f2h if HARDWARE_HALF else f2h_soft


@njit(nogil=True, cache=False, inline="always")
def bf2f(h: Any) -> Any:
    return bits_f32(np.uint32(h) << np.uint32(16))


@njit(nogil=True, cache=False, inline="always")
def f2bf(f: Any) -> Any:
    """float32 -> bfloat16 bits, round to nearest even; ±inf stays ±inf, NaN becomes 0x7FC0
    (torch's scalar conversion; its vectorized CPU one gives 0xFFFF).

    Without the NaN select, rounding could carry a NaN's mantissa into its exponent and sign
    (0x7FFFFFFF would become -0.0). KIVI's decoder never produces NaN (finite statistics are
    checked before decoding), but a NaN must not silently become a number anywhere. The
    select vectorizes: it costs nothing measurable.
    """
    u = np.int64(f32_bits(f))
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return np.uint16(0x7FC0 if (u & 0x7FFFFFFF) > 0x7F800000 else rounded)
