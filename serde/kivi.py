"""``kivi``: 2- or 4-bit asymmetric quantization of KV caches (KIVI, ICML 2024).

Keys are quantized per channel and values per token, as KIVI does: key outliers live in a few
channels, so a key group runs along tokens of one (layer, channel); a value group runs along
channels of one (layer, token). The memory format in the frame (``serde.layout``) says which
axis is which; a one-plane layout (MLA, or any other tensor as rows x channels) is treated as
keys. Per group, the minimum and the scale ``(max - min) / (2**bits - 1)`` are stored as
float16 and every element as a ``bits``-bit code, packed densely: with the default 2 bits and
groups of 32, 2 + 2 * 16 / 32 = 3 bits per element, 5.3x smaller than float16 (4 bits: 3.2x).
The exact arithmetic and byte layout are specified by ``gpu.reference.kivi``.

Options:

- ``bits``: 2 (default) or 4. KIVI's paper finds 2 bits enough for most models and recommends
  4 for grouped-query ones; 2 is the default because it is what makes remote tiers fast.
- ``group``: elements per group, 2..1024 (default 32). A token or channel count that is not a
  multiple of it ends with a partial group.
- ``residual``: how many of the latest tokens of every (plane, layer) are stored verbatim in
  the stored dtype (default 0). KIVI keeps its latest 128 tokens in full precision because,
  while generating, they are the sliding window still being appended to and attended to most.
  A stored chunk is a fixed 256-token slice of a sequence whose later tokens live in the next
  chunks, so its last tokens are not special, and keeping 128 of 256 verbatim would cut the
  ratio from 5.3x to 1.8x. Set it when storing the open tail of a sequence.

Error bound: every quantized element satisfies ``|x - x_hat| <= sc16 / 2`` where ``sc16`` is
its group's stored float16 scale, which is the exact scale rounded *up* to float16 while the
minimum is rounded *down*, so the codes cover the group and float16 rounding never adds a
clamping error. On top come float32 rounding (a few ulp) and the rounding of ``x_hat`` to the
stored dtype (half an ulp of float16 / bfloat16). Residual tokens and constant groups of
float16 values are exact. ``documented_rel_error`` = 0.45 bounds the relative Frobenius error
of each plane with the default options on Gaussian KV-like data (measured 0.37-0.40; 4 bits:
0.07-0.08, so 0.10 bounds it).

NaN, inf, and values beyond float16's range (|x| > 65504, possible in bfloat16 and float32,
of either sign) cannot be described by float16 statistics within the bound above: such an
object is stored verbatim (``{"mode": "raw"}``), exactly, never as garbage. So are non-float
objects (``serde.tensors``), tensors too small for float16 statistics (below), and tensors
whose payload (its size is known before encoding) would not be smaller than their bytes: with
one token, a 1-D tensor or a few channels, the float16 statistics of a group outweigh its
codes. Decoding refuses a payload whose statistics are inf or NaN (``CorruptObject``): the
encoder never writes them.

Too small: below ``2**-14`` float16 numbers are subnormal, multiples of ``2**-24``. A group
whose scale falls there (a non-zero ``sc16 < 2**-14``: a spread below about 2e-4 with 2 bits,
1e-3 with 4) has its scale, and a minimum in that range, rounded by up to ``2**-24`` absolutely
instead of relatively: each of its elements may be off by up to ``2**-24`` more than with exact
statistics (and float16 output, whose rounding is then absolute too, up to ``2**-25`` more).
Under 1 % for data of magnitude 1e-5 and up, but randn * 1e-7 came back with 0.52 relative error
at 2 bits, and from about 1e-8 as zeros. So a plane with such groups is checked after encoding:
if ``2**-24 * sqrt(n)`` (float16: ``1.5 * 2**-24 * sqrt(n)``), ``n`` the elements of those
groups (as whole groups), exceeds ``UNDERFLOW_TOL`` = ``2**-7`` of the plane's norm (the
documented error, which is per plane, could grow by more than 0.008), the object is stored
verbatim. A plane of normal magnitude with a few tiny groups (a layer or channel near zero)
stays quantized, those groups within about ``2**-24``. Groups with ``sc16 == 0`` (every value
equal to the float16 minimum: zeros, constant float16 values) are exact and never count. Planes
without subnormal scales (ordinary data) cost one look at their scales; the others one more
pass (their norm). The payload format is unchanged: the kernels do not take part.

Kernels (``gpu.dispatch``): numba on the CPU (fused single-pass kernels on both cores; numba
compiles them on first use in a process: about 4 s for encode and 1 s for decode here), cupy
on a CUDA tensor (encoded on its GPU; only the payload crosses to the host), the torch
reference when ``KVGATE_KERNELS=reference`` or neither is available. All produce the same
bytes. Decoding always runs on the host (the payload is there) and writes the stored dtype
straight into the caller's buffer in the stored layout.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.errors import ConfigError, CorruptObject
from gateway.frame import FrameInfo
from gateway.objects import ObjectData, torch_dtype
from gateway.types import Buffer, BufferParts, ParamValue
from gpu import dispatch
from serde.layout import layout_of
from serde.tensors import (
    check_decodable,
    float_tensor,
    host_bytes,
    is_raw,
    param_int,
    raw_decode,
    raw_encode,
    tensor_bytes,
)

if TYPE_CHECKING:
    import torch

    from gpu.reference.kivi import KiviGeometry

BITS = (2, 4)
F16_EXPONENT = 0x7C00  # all ones: inf or NaN
F16_TINY = 2.0**-24  # float16's spacing below 2**-14 (its subnormal range)
F16_SUBNORMAL = 0x0400  # float16 bit patterns 1..0x3FF: positive subnormal numbers
UNDERFLOW_TOL = 2.0**-7  # how much float16's spacing may add to a plane's relative error
MIN_GROUP = 2
MAX_GROUP = 1024


def _option(name: str, value: Any, low: int, high: int) -> int:
    # A real int only: 2.0 or numpy.int64(2) would be accepted here and then break every encode
    # (payload sizes and msgpack params need Python ints); bool is an int but never meant.
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"codec kivi: {name} must be an integer in {low}..{high}, got {value!r}")
    return int(value)


class KiviCodec:
    name = "kivi"
    lossless = False
    client_options = frozenset({"bits", "group", "residual"})  # what HTTP clients may set
    documented_rel_error = 0.45

    def __init__(self, bits: int = 2, group: int = 32, residual: int = 0, **options: Any) -> None:
        if options:
            raise ConfigError(f"codec kivi: unknown options {', '.join(sorted(options))}")
        if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
            raise ConfigError(f"codec kivi: bits must be the integer 2 or 4, got {bits!r}")
        self.bits = int(bits)
        self.group = _option("group", group, MIN_GROUP, MAX_GROUP)
        self.residual = _option("residual", residual, 0, 1 << 62)

    def encode(self, obj: ObjectData) -> tuple[BufferParts, dict[str, ParamValue]]:
        t = float_tensor(obj)
        if t is None:
            return raw_encode(obj)
        if t.device.type not in ("cpu", "cuda"):  # no kernels for other devices: via the host
            t = t.cpu()
        from gpu.reference import kivi as reference

        layout = layout_of(obj.meta.fmt, obj.meta.shape)
        geom = reference.geometry(
            layout.canonical_shape, t.dtype, self.bits, self.group, self.residual
        )
        if geom.total >= obj.meta.nbytes:  # few tokens or channels: statistics outweigh codes
            return raw_encode(obj)
        canon = layout.to_canonical(t if t.is_contiguous() else t.contiguous())
        backend = dispatch.backend_for(t)
        payload: Buffer | None
        if backend == "cuda":
            from gpu.cuda import kivi as cuda

            payload = cuda.encode(canon, geom)
        elif backend == "cpu":
            from gpu.cpu import kivi as cpu

            encoded = cpu.encode(canon, geom)
            payload = None if encoded is None else encoded.data.cast("B")
        else:
            ref = reference.encode(canon, geom)
            payload = None if ref is None else host_bytes(ref)
        if payload is None or _underflows(payload, canon, geom):  # NaN/inf, |x| > 65504, or
            return raw_encode(obj)  # too small for float16 statistics: stored exactly instead
        params: dict[str, ParamValue] = {
            "bits": self.bits,
            "group": self.group,
            "residual": geom.residual,
        }
        return payload, params

    def decode(self, payload: memoryview, info: FrameInfo, out: memoryview | None) -> Buffer:
        if is_raw(info):
            return raw_decode(payload, info, out)
        import torch

        from gpu.reference import kivi as reference

        check_decodable(info)
        if "mode" in info.params or info.kind not in ("tensor", "ndarray"):
            raise CorruptObject(f"kivi frame of kind {info.kind} with params {info.params}")
        bits = param_int(info, "bits", BITS[0], BITS[-1])
        if bits not in BITS:
            raise CorruptObject(f"kivi frame has a bad 'bits' parameter: {bits}")
        group = param_int(info, "group", MIN_GROUP, MAX_GROUP)
        layout = layout_of(info.fmt, info.shape)
        residual = param_int(info, "residual", 0, layout.tokens)
        dtype = torch_dtype(info.dtype)
        geom = reference.geometry(layout.canonical_shape, dtype, bits, group, residual)
        if geom.numel == 0 or geom.numel * geom.itemsize != info.raw_len:
            raise CorruptObject(f"kivi frame shape {info.shape} does not match {info.raw_len}")
        view = memoryview(payload).cast("B")
        if view.nbytes != geom.total:
            raise CorruptObject(f"kivi payload is {view.nbytes} bytes, expected {geom.total}")
        data = np.frombuffer(view, dtype=np.uint8)
        _check_stats(data, geom)
        if dispatch.forced_reference() or not dispatch.has_numba():
            canon = reference.decode(torch.from_numpy(data.copy()), geom, dtype)
            return tensor_bytes(layout.from_canonical(canon), out)
        from gpu.cpu import kivi as cpu

        fits = out is not None and out.nbytes == info.raw_len
        target: np.ndarray[Any, Any] | None = None
        if out is not None and fits:
            target = np.frombuffer(out, dtype=np.uint8)
            if target.ctypes.data % geom.itemsize:  # the kernels need aligned elements
                target = None
        direct = target is not None
        if target is None:
            target = np.empty(info.raw_len, dtype=np.uint8)
        stored = torch.from_numpy(target).view(dtype).view(layout.shape)
        cpu.decode_into(data, geom, layout.to_canonical(stored))
        if out is None or not fits:
            return target.data.cast("B")
        if not direct:
            out.cast("B")[:] = target.data.cast("B")
        return out


def _underflows(payload: Buffer, canon: torch.Tensor, geom: KiviGeometry) -> bool:
    """Whether float16's subnormal spacing could add more than ``UNDERFLOW_TOL`` to the relative
    error of a plane (module docstring): groups with a subnormal scale may each cost up to
    ``F16_TINY`` per element more than exact statistics (1.5 times that for float16 output)."""
    import torch

    data = np.frombuffer(payload, dtype=np.uint8)
    # float16 output: rounding x_hat to it costs up to 2**-25 more in that range
    excess = F16_TINY * (1.5 if canon.dtype == torch.float16 else 1.0)
    for plane in range(geom.planes):
        n = geom.stats_count(plane)
        start = geom.stats_offset(plane) + 2 * n  # the scales follow the minima
        scales = data[start : start + 2 * n].view("<u2")
        tiny = int(np.count_nonzero(scales - np.uint16(1) < np.uint16(F16_SUBNORMAL - 1)))
        if not tiny:  # ordinary data: no subnormal scale (0 wraps around to 65535)
            continue
        x = canon[plane, :, : geom.quant_tokens, :]
        norm = float(torch.linalg.vector_norm(x, dtype=torch.float64))
        if excess * math.sqrt(tiny * geom.group) > UNDERFLOW_TOL * norm:
            return True
    return False


def _check_stats(data: np.ndarray[Any, Any], geom: KiviGeometry) -> None:
    """Refuse float16 statistics that are inf or NaN: the encoder never writes them (it stores
    such objects raw), and they would decode to inf/NaN (or, rounded, to garbage)."""
    start, end = geom.stats_offset(0), geom.stats_offset(geom.planes)
    exponent = np.bitwise_and(data[start:end].view("<u2"), F16_EXPONENT)
    if exponent.size and int(exponent.max()) == F16_EXPONENT:
        raise CorruptObject("kivi payload has non-finite float16 statistics")
