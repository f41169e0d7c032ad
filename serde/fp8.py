"""``fp8``: lossy; float8 e4m3 codes with a float32 scale per (plane, layer, channel).

Every value becomes one byte: half the size of float16/bfloat16, a quarter of float32, plus
the scales. For each channel of each plane and layer of the canonical layout
(``serde.layout``), ``scale = absmax over tokens / 448`` and ``code = e4m3(x / scale)``
(``gpu.reference.fp8`` is the exact spec). Keys have per-channel outliers, so per-channel
scales keep every other channel's precision.

Payload (little-endian)::

    scales  float32 [planes, layers, channels]
    codes   uint8   [planes, layers, tokens, channels]   (e4m3 bit patterns)

The frame records ``{"mode": "e4m3"}``; layout, dtype and sizes come from its fmt, shape and
raw_len. Decoding returns the stored dtype (float16, bfloat16 or float32). Stored verbatim
instead (``{"mode": "raw"}``, ``serde.tensors``, exact): objects that are not float tensors or
arrays; tensors whose payload would not be smaller than their bytes (the size is known before
encoding: a 4-byte scale per channel outweighs the 1-byte codes with few tokens, e.g. one
token, a 1-D tensor, or up to 4 tokens of float16); and tensors with a channel whose absmax is
non-zero but below ``448 * 2**-109`` (~7e-31, float32 and bfloat16 only), see below.

Why float32 scales: exact for every input (an fp16 scale would round the scale, underflow for
tiny channels and overflow for float32 inputs above 65504 * 448), and cheap: 4 bytes per
channel against ``tokens`` bytes of codes, 1.6 % of the payload for 256 tokens.

Error bound. e4m3 keeps 3 mantissa bits: rounding ``x / scale`` to nearest costs at most
``2**-4 |x|`` for codes in the normal range and ``2**-10 * scale`` in the subnormal range
(``|x| < 2**-6 * scale``); the float32 division and product add ~2**-23 and the final cast to
bfloat16 (float16) at most ``2**-9`` (``2**-11``) of the result. Per channel the subnormal terms
are negligible against the channel's norm (at least ``448 * scale``), so the relative Frobenius
error of every plane is below ``2**-4 + 2**-9 < 0.065`` (``documented_rel_error``). This needs
every rounding to be relative, i.e. the scale and the decoded values to be normal float32
numbers: a scale below ``2**-109`` (``MIN_SCALE``) would keep only a few significant bits, or
underflow to 0 and zero its whole channel (float32 data below ~1e-43 would decode as zeros).
Such tensors are stored verbatim; no real KV cache comes near that range. Measured:
0.024 on ``randn * 0.5`` data, 0.026 on the synthetic and the MiniLM chunks, whose attention
outputs then differ by 0.037 (relative).

Special values: NaN stays NaN; ±inf saturates to ± the channel's largest finite magnitude
(e4m3fn has no infinity), or to 0 in a channel without finite non-zero values; the scale uses
finite values only, so one inf does not flush its channel to zero. A zero channel has scale 0
and decodes to exact zeros.

Implementations (``gpu.dispatch.backend_for``): a tensor on a GPU is encoded there
(``gpu.cuda.fp8``, cupy) and only the payload crosses to the host; on the host the numba kernels
(``gpu.cpu.fp8``; on the 32 MiB bf16 chunk here encode ~8 GB/s and decode ~11 GB/s, against
0.19 and 0.48 GB/s for the torch reference) or, without numba or with
``KVGATE_KERNELS=reference``, the torch reference. Decoding runs on the host (the result is
host bytes) with the numba kernels or the reference. All produce identical payloads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.errors import ConfigError, CorruptObject
from gateway.frame import FrameInfo
from gateway.objects import ITEMSIZE, ObjectData, torch_dtype
from gateway.types import Buffer, BufferParts, MemoryFormat, ParamValue
from gpu.dispatch import backend_for, forced_reference, has_numba
from serde.layout import KVLayout, layout_of
from serde.tensors import (
    PayloadReader,
    check_decodable,
    float_tensor,
    host_bytes,
    is_raw,
    raw_decode,
    raw_encode,
    tensor_bytes,
)

if TYPE_CHECKING:
    import torch

MODE = "e4m3"
# Smallest scale quantized: from it on the scale and every decoded non-zero value (>= 2**-9
# scale) are normal float32/bfloat16 numbers, so each rounding is relative (module docstring).
MIN_SCALE = 2.0**-109


class Fp8Codec:
    name = "fp8"
    lossless = False
    documented_rel_error = 0.065

    def __init__(self, **options: Any) -> None:
        if options:
            raise ConfigError(f"codec fp8 takes no options (got {', '.join(sorted(options))})")

    def encode(self, obj: ObjectData) -> tuple[BufferParts, dict[str, ParamValue]]:
        t = float_tensor(obj)
        if t is None:
            return raw_encode(obj)
        layout = layout_of(obj.meta.fmt, obj.meta.shape)
        if payload_size(layout) >= obj.meta.nbytes:  # few tokens: the scales outweigh the gain
            return raw_encode(obj)
        if t.device.type not in ("cpu", "cuda"):  # no kernels for other devices: via the host
            t = t.cpu()
        c = layout.to_canonical(t)
        backend = backend_for(t)
        payload: list[memoryview]
        if backend == "cuda":
            from gpu.cuda import fp8 as cuda_fp8

            payload = [host_bytes(cuda_fp8.encode_payload(c))]
        else:
            if backend == "cpu":
                from gpu.cpu import fp8 as cpu_fp8

                scales, codes = cpu_fp8.encode(c)
            else:
                from gpu.reference import fp8 as ref_fp8

                scales, codes = ref_fp8.encode(c)
            payload = [host_bytes(scales), host_bytes(codes)]
        n_scales = layout.planes * layout.layers * layout.channels
        written = np.frombuffer(payload[0][: 4 * n_scales], dtype="<f4")
        if _tiny_channels(c, written.reshape(layout.planes, layout.layers, layout.channels)):
            return raw_encode(obj)
        return payload, {"mode": MODE}

    def decode(self, payload: memoryview, info: FrameInfo, out: memoryview | None) -> Buffer:
        if is_raw(info):
            return raw_decode(payload, info, out)
        check_decodable(info)
        if info.params.get("mode") != MODE:
            raise CorruptObject(f"fp8 frame has an unknown mode: {info.params.get('mode')!r}")
        layout = layout_of(info.fmt, info.shape)
        if layout.numel * ITEMSIZE[info.dtype] != info.raw_len:
            raise CorruptObject(
                f"fp8 frame: shape {info.shape} does not match {info.raw_len} bytes"
            )
        reader = PayloadReader(payload, "fp8")
        scales = reader.array("<f4", layout.planes * layout.layers * layout.channels)
        codes = reader.array(np.uint8, layout.numel)
        reader.finish()
        if not bool(np.all(scales >= 0)) or not bool(np.all(np.isfinite(scales))):
            raise CorruptObject("fp8 payload has negative or non-finite scales")
        dtype = torch_dtype(info.dtype)
        scales = scales.reshape(layout.planes, layout.layers, layout.channels)
        codes = codes.reshape(layout.canonical_shape)
        if has_numba() and not forced_reference():
            return _decode_cpu(scales, codes, dtype, layout, out)
        import torch

        from gpu.reference import fp8 as ref_fp8

        canonical = ref_fp8.decode(
            torch.from_numpy(scales.copy()), torch.from_numpy(codes.copy()), dtype
        )
        return tensor_bytes(layout.from_canonical(canonical), out)


def payload_size(layout: KVLayout) -> int:
    """Bytes of an ``e4m3`` payload: a float32 scale per (plane, layer, channel), a code each."""
    return 4 * layout.planes * layout.layers * layout.channels + layout.numel


def _tiny_channels(c: torch.Tensor, scales: np.ndarray[Any, Any]) -> bool:
    """Whether a channel has finite non-zero values but a scale below ``MIN_SCALE``.

    A scale of 0 is a channel without finite non-zero values (exact), or one whose absmax / 448
    underflowed: only those channels' values are looked at, so the usual case (no scale below
    ``MIN_SCALE``, or zero channels of float16, whose smallest absmax gives 2**-24 / 448) costs
    one comparison per channel.
    """
    small = scales < MIN_SCALE
    if not small.any():
        return False
    if bool(np.any(scales[small] > 0)):
        return True
    import torch

    if c.dtype == torch.float16:
        return False
    for plane, layer in zip(*np.nonzero(small.any(axis=2)), strict=True):
        cols = torch.from_numpy(np.flatnonzero(small[plane, layer])).to(c.device)
        x = c[int(plane), int(layer)].index_select(1, cols)
        if bool((torch.isfinite(x) & (x != 0)).any()):
            return True
    return False


def _decode_cpu(
    scales: np.ndarray[Any, Any],
    codes: np.ndarray[Any, Any],
    dtype: torch.dtype,
    layout: KVLayout,
    out: memoryview | None,
) -> Buffer:
    import torch

    from gpu.cpu import fp8 as cpu_fp8

    if out is None or layout.fmt == MemoryFormat.KV_T2D:
        canonical = cpu_fp8.decode(scales, codes, dtype)
        return tensor_bytes(layout.from_canonical(canonical), out)
    # The stored order is the canonical one: decode straight into the caller's buffer.
    target = torch.from_numpy(np.frombuffer(out, dtype=np.uint8)).view(dtype)
    cpu_fp8.decode(scales, codes, dtype, target.reshape(layout.canonical_shape))
    return out
