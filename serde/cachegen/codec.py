"""``cachegen``: quantization plus context-modelled rANS coding along tokens (CacheGen-style).

The chunk is seen as ``[planes, layers, tokens, channels]`` (``serde.layout``; plane 0 keys,
plane 1 values). Each element is quantized uniformly with a step chosen per layer from the
configured bins and the ``quality`` knob, refined per channel (and per token for values), see
``serde.cachegen.model``. The integer symbols are entropy coded along tokens with static rANS:
one stream per (plane, layer, block of channels), one table per (plane, channel class,
context of the previous token's symbol), stored compactly (``serde.cachegen.tables``), so the
object costs the symbols' entropy plus about 1 % of side information and tables, not a 4 MiB
CDF per chunk. Many independent streams let the coder run on both CPU cores (numba,
``gpu.cpu.cachegen``) and one stream per GPU thread (``gpu.cuda.cachegen``); all three
implementations write the same payload (``gpu.reference.cachegen`` is the spec). The frame's
params are ``{"v": 1, "block": channels per stream}``; everything else is in the payload
(``serde.cachegen.format``), and a decoder derives the layout from the frame's format and shape.

Options:

- ``quality`` (default 1.75): divides every step. Doubling it costs about one bit per element
  and halves the error: the size/quality knob of the benchmark's rate-distortion curve. The
  default is the smallest round value that keeps the attention-output error of both the
  synthetic chunk and MiniLM's K/V at or below KIVI 4-bit's (``gateway.bench.kv_samples``).
- ``key_bins`` / ``value_bins``: quantization levels per ``SPAN`` (8) standard deviations of a
  layer; entry ``i`` applies to layer ``i`` and the last entry to every layer after. The
  defaults are CacheGen's: keys 32 levels in layers 0-9 and 16 after, values 32 in layers 0-1
  and 16 after (the paper found deeper layers less sensitive for generation quality). Values
  are not clipped at the bins: an element beyond them costs a longer code, not an error.
  (The attention error of every layer counts alike, so uniform bins, ``key_bins=32,
  value_bins=32`` with ``quality=1.0``, give a slightly better ratio at the same error.)

Error bound: an element's reconstruction error is at most half its step (``|x - x_hat| <=
step / 2`` up to float32 and output-dtype rounding; the ``+-127`` alphabet does not clip:
channels that would overflow it get a coarser step). For Gaussian-like data a layer's relative
error is about ``SPAN / (bins * quality * sqrt(12))``: 0.041 at 32 bins and 0.082 at 16 with
the default quality. On ``tests/test_codecs.py``'s ``kv_like`` data (randn * 0.5, four layers)
each plane's relative Frobenius error is about 0.040 (keys) and 0.065 (values, two layers at
16 bins), and at most 0.065 over every shape and format of the suite (one-token and flat
layouts included): ``documented_rel_error`` is 0.08. Constant layers are reproduced to about
``2**-15`` relative (their step is tiny and their symbols free).

Objects that cannot be quantized (not float16/bfloat16/float32, empty), float tensors with
NaN, infinity or magnitudes beyond ``2**90`` (float32 only), tensors with a layer too small
for the steps (below), and tiny tensors whose coded form would not be smaller than their bytes
(side information is per channel) are stored verbatim (``{"mode": "raw"}``): exact.

Too small: layer steps are stored within ``2**+-90`` (``serde.cachegen.model.BS_LOG_MAX``). A
layer whose planned step is below ``2**-90`` (a median channel spread below about ``bins *
quality * 2**-93``, 6e-27 at 32 bins and the default quality; a constant layer's mean below
about ``2**12`` times that) would be quantized with a step too coarse for it, from its
documented error up to all zeros (randn * 1e-30, float32 and bfloat16): if any layer of any
plane is there (its step at the floor), the object is stored verbatim. float32 subnormals are
far below. Zero layers get an ordinary step and come back exactly. float16 output has its own
floor: below ``2**-14`` its numbers are multiples of ``2**-24``, so rounding ``x_hat`` to
float16 costs up to ``2**-25`` absolutely, not relatively (randn * 3e-7 came back with 0.097
relative error); a float16 object with a non-zero layer whose RMS is below ``2**-18``
(``F16_RMS_MIN``: that rounding would add more than ``2**-7`` to the layer's relative error)
is stored verbatim too. Both checks use statistics the encoder computes anyway.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from gateway.errors import ConfigError, CorruptObject
from gateway.frame import FrameInfo
from gateway.objects import ITEMSIZE, ObjectData, torch_dtype
from gateway.types import Buffer, BufferParts, ParamValue
from gpu import dispatch
from serde.cachegen import format as fmt
from serde.cachegen.model import (
    BS_LOG_MAX,
    FINITE_MAX,
    MAX_FIX_ROUNDS,
    Geometry,
    default_block,
    geometry,
    model_dims,
    plan,
    widen,
)
from serde.cachegen.tables import classes_from_sumsq, from_counts
from serde.layout import layout_of
from serde.tensors import (
    check_decodable,
    float_tensor,
    is_raw,
    param_int,
    raw_decode,
    raw_encode,
    tensor_bytes,
)

VERSION = 1
DEFAULT_QUALITY = 1.75
KEY_BINS = (32,) * 10 + (16,)
VALUE_BINS = (32, 32, 16)
MAX_BINS = 1 << 14
MAX_QUALITY = 1024.0
VALUE_LOG_MAX = 90  # chunks with means or spreads above 2**90 are stored verbatim
STEP_FLOOR = np.float32(2.0**-BS_LOG_MAX)  # so are chunks with a layer step planned below it
F16_RMS_MIN = 2.0**-18  # and float16 chunks with a non-zero layer of a smaller RMS


def _bins(name: str, value: Any) -> tuple[int, ...]:
    items = (value,) if isinstance(value, int) else value
    if isinstance(items, str | bytes) or not isinstance(items, Sequence) or not items:
        raise ConfigError(f"codec cachegen: {name} must be an int or a non-empty list of ints")
    out = []
    for b in items:
        if isinstance(b, bool) or not isinstance(b, int) or not 2 <= b <= MAX_BINS:
            raise ConfigError(f"codec cachegen: {name} entries must be ints in 2..{MAX_BINS}")
        out.append(b)
    return tuple(out)


def kernels(backend: str) -> ModuleType:
    """The implementation module of a backend (imported lazily: numba and cupy are heavy)."""
    if backend == "cuda":
        from gpu.cuda import cachegen as cuda_impl

        return cuda_impl
    if backend == "cpu":
        from gpu.cpu import cachegen as cpu_impl

        return cpu_impl
    from gpu.reference import cachegen as ref_impl

    return ref_impl


def host_backend() -> str:
    if dispatch.forced_reference() or not dispatch.has_numba():
        return "reference"
    return "cpu"


class CacheGenCodec:
    name = "cachegen"
    lossless = False
    client_options = frozenset({"quality", "key_bins", "value_bins"})  # what HTTP clients may set
    documented_rel_error = 0.08

    def __init__(
        self,
        quality: float = DEFAULT_QUALITY,
        key_bins: int | Sequence[int] = KEY_BINS,
        value_bins: int | Sequence[int] = VALUE_BINS,
        **options: Any,
    ) -> None:
        if options:
            raise ConfigError(f"codec cachegen: unknown options {', '.join(sorted(options))}")
        if isinstance(quality, bool) or not isinstance(quality, int | float):
            raise ConfigError(f"codec cachegen: quality must be a number, got {quality!r}")
        if not (math.isfinite(quality) and 0 < quality <= MAX_QUALITY):
            raise ConfigError(f"codec cachegen: quality must be in (0, {MAX_QUALITY}]")
        self.quality = float(quality)
        self.bins = (_bins("key_bins", key_bins), _bins("value_bins", value_bins))

    def encode(self, obj: ObjectData) -> tuple[BufferParts, dict[str, ParamValue]]:
        t = float_tensor(obj)
        if t is None:
            return raw_encode(obj)
        layout = layout_of(obj.meta.fmt, obj.meta.shape)
        block = default_block(layout)
        g = geometry(layout, block)
        view = layout.to_canonical(t).reshape(g.shape)  # the stored dtype; a view when it can be
        payload = encode_model(kernels(dispatch.backend_for(t)), g, view, self.bins, self.quality)
        if payload is None or sum(memoryview(p).nbytes for p in payload) >= obj.meta.nbytes:
            return raw_encode(obj)  # NaN or infinity, or a tensor too small to gain anything
        return payload, {"v": VERSION, "block": block}

    def decode(self, payload: memoryview, info: FrameInfo, out: memoryview | None) -> Buffer:
        if is_raw(info):
            return raw_decode(payload, info, out)
        check_decodable(info)
        param_int(info, "v", VERSION, VERSION)
        layout = layout_of(info.fmt, info.shape)
        if layout.numel * ITEMSIZE[info.dtype] != info.raw_len or layout.numel == 0:
            raise CorruptObject("cachegen frame: shape and raw length disagree")
        block = param_int(info, "block", 1, max(1, model_dims(layout)[1]))
        g = geometry(layout, block)
        parsed = fmt.unpack(g, memoryview(payload).cast("B"))
        import torch

        dtype = torch_dtype(info.dtype)
        if out is not None and out.nbytes == info.raw_len:
            flat = torch.frombuffer(out, dtype=torch.uint8)
            result, target = flat.view(dtype).reshape(layout.shape), out
        else:
            result = torch.empty(layout.shape, dtype=dtype)
            target = None
        view = layout.to_canonical(result).reshape(g.shape)
        impl = kernels(host_backend())
        if hasattr(impl, "decode_into") and _shares_storage(view, result):
            ok = impl.decode_into(impl.Source.of(view), *decode_args(parsed, g))
            if not ok:
                raise CorruptObject("cachegen payload: a stream does not decode")
            return target if target is not None else tensor_bytes(result, None)
        x_hat, ok = impl.decode(*decode_args(parsed, g))
        if not ok:
            raise CorruptObject("cachegen payload: a stream does not decode")
        limit = FINITE_MAX[info.dtype]
        canon = x_hat.clamp_(-limit, limit).reshape(layout.canonical_shape).to(dtype)
        return tensor_bytes(layout.from_canonical(canon), out)


def _shares_storage(view: Any, base: Any) -> bool:
    return bool(view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr())


def decode_args(parsed: fmt.Parsed, g: Geometry) -> tuple[Any, ...]:
    """The kernels' decode arguments after the output: streams, tables, steps (host arrays)."""
    steps = parsed.side.steps(g)
    return (
        parsed.words,
        parsed.offsets,
        parsed.side.cls,
        parsed.tables,
        g.block,
        *steps.dequantizer(),
    )


def encode_model(
    impl: ModuleType,
    g: Geometry,
    x: Any,
    bins: tuple[tuple[int, ...], tuple[int, ...]],
    quality: float,
) -> list[Buffer] | None:
    """The payload of the model view ``x`` (any float dtype, strides and device), or ``None``
    if ``x`` holds NaN or infinity."""
    mean, var, tms = (a.cpu().numpy() for a in impl.stats(x))
    if not all(np.isfinite(a).all() for a in (mean, var, tms)):
        return None
    if max(np.abs(mean).max(), np.sqrt(var.max())) > 2.0**VALUE_LOG_MAX:
        return None  # beyond the steps' range (|x| ~ 1e27 in float32): store it verbatim
    import torch

    if x.dtype == torch.float16:
        rms = np.sqrt((var + mean * mean).mean(axis=2))  # of every (plane, layer)
        if np.any((rms > 0) & (rms < F16_RMS_MIN)):
            return None  # float16's subnormal spacing would add too much (module docstring)
    side = plan(g, mean, var, tms, bins, quality)
    if np.any(side.bs <= STEP_FLOOR):
        return None  # a layer too small for the steps' range (1e-30 would decode as zeros)
    for attempt in range(MAX_FIX_ROUNDS):  # a channel may overflow the alphabet: widen it
        sym, maxu, sumsq = impl.quantize(x, *_device(side.steps(g).quantizer(), x))
        if attempt == MAX_FIX_ROUNDS - 1 or not widen(side, g, maxu.cpu().numpy(), mean):
            break  # (the last attempt keeps its steps: the kernels clamp what still overflows)
    side.cls = classes_from_sumsq(sumsq.cpu().numpy(), g.tokens)
    cls = _device((side.cls,), x)[0]
    counts = impl.histogram(sym, cls).cpu().numpy()
    tables = from_counts(counts, g.planes)
    words, lengths = impl.encode(sym, cls, tables, g.block)
    head = fmt.pack(g, side, lengths, tables)
    return [head, np.ascontiguousarray(words, dtype="<u2").data.cast("B")]


def _device(arrays: tuple[np.ndarray[Any, Any], ...], like: Any) -> list[Any]:
    import torch

    return [torch.from_numpy(np.ascontiguousarray(a)).to(like.device) for a in arrays]
