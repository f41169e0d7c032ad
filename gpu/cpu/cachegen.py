"""CacheGen kernels on the CPU (numba, ``nogil``), split over the cores by ``gpu.dispatch``.

Same functions and results as ``gpu.reference.cachegen`` (the spec; read it for the shapes):
the statistics are float64 sums in another order (their codes agree, see
``serde.cachegen.model``); symbols, histograms, streams and decoded values are bit-identical.

The kernels read the stored tensor in place (float16 / bfloat16 bits or float32, any strides:
``Source``) and decode straight into the output bytes, so no float32 copy of the chunk is
made. Element passes (``gpu.cpu.cachegen_kernels``) are cut by (plane, layer), the stream
coder (``gpu.cpu.cachegen_coder``) by stream. Importing this module imports numba.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gpu import dispatch
from gpu.cpu import cachegen_coder, cachegen_kernels, rans
from gpu.cpu.cachegen_source import Source, source_of
from serde.cachegen.tables import NCLS, NCTX, NSYM, THRESHOLDS, Tables

_TH = THRESHOLDS.astype(np.int64)
# numba dispatchers, typed loosely (they take any arrays)
K: Any = cachegen_kernels
C: Any = cachegen_coder

__all__ = ["Source", "decode", "decode_into", "encode", "histogram", "quantize", "stats"]


def stats(x: torch.Tensor | Source) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    src = x if isinstance(x, Source) else source_of(x)
    planes, layers, tokens, channels = src.shape
    mean = np.zeros((planes, layers, channels))
    var = np.zeros((planes, layers, channels))
    tms = np.zeros((planes, layers, tokens))
    args = (*src.kernel_args(), mean, var, tms)
    dispatch.parallel(lambda a, b: K.stats_range(*args, a, b), planes * layers)
    return torch.from_numpy(mean), torch.from_numpy(var), torch.from_numpy(tms)


def quantize(
    x: torch.Tensor | Source,
    cval: torch.Tensor,
    icstep: torch.Tensor,
    itfac: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    src = x if isinstance(x, Source) else source_of(x)
    planes, layers, tokens, channels = src.shape
    sym = np.empty((planes, layers, channels, tokens), np.int8)
    maxu = np.zeros((planes, layers, channels), np.float32)
    sumsq = np.zeros((planes, layers, channels), np.int64)
    args = (*src.kernel_args(), cval.numpy(), icstep.numpy(), itfac.numpy(), sym, maxu, sumsq)
    dispatch.parallel(lambda a, b: K.quantize_range(*args, a, b), planes * layers)
    return torch.from_numpy(sym), torch.from_numpy(maxu), torch.from_numpy(sumsq)


def histogram(sym: torch.Tensor, cls: torch.Tensor) -> torch.Tensor:
    ss, cs = sym.numpy(), cls.numpy()
    planes, layers = ss.shape[:2]
    ranges = dispatch.split_range(planes * layers)
    parts = {r: np.zeros((4, planes * NCLS * NCTX * NSYM), np.int32) for r in ranges}
    dispatch.run_chunks(lambda a, b: K.histogram_range(ss, cs, _TH, parts[(a, b)], a, b), ranges)
    total = np.zeros(planes * NCLS * NCTX * NSYM, np.int64)
    for part in parts.values():
        total += part.sum(axis=0, dtype=np.int64)
    return torch.from_numpy(total.reshape(planes * NCLS * NCTX, NSYM))


def encode(
    sym: torch.Tensor, cls: torch.Tensor, tables: Tables, block: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    ss, cs = sym.numpy(), cls.numpy()
    planes, layers, channels, tokens = ss.shape
    streams = planes * layers * (-(-channels // block))
    buf = np.empty((streams, block * tokens + 2), np.uint16)
    lengths = np.zeros(streams, np.int64)
    ent = rans.encoder_table(tables, planes).reshape(-1)
    args = (ss, cs, _TH, ent, block, buf, lengths)
    dispatch.parallel(lambda a, b: C.encode_range(*args, a, b), streams)
    return rans.compact(buf, lengths), lengths


def decode_into(
    out: Source,
    words: np.ndarray[Any, Any],
    offsets: np.ndarray[Any, Any],
    cls: np.ndarray[Any, Any],
    tables: Tables,
    block: int,
    cval: np.ndarray[Any, Any],
    cstep: np.ndarray[Any, Any],
    tfac: np.ndarray[Any, Any],
) -> bool:
    """Decode into ``out`` (the stored dtype and strides); whether every stream was clean."""
    planes, layers, _, channels = out.shape
    streams = planes * layers * (-(-channels // block))
    ok = np.zeros(streams, np.bool_)
    freq, cum = rans.by_id(tables, planes)
    used = tables.tmap >= 0
    lut = rans.context_lut(tables, planes).reshape(-1)
    dent = rans.decoder_entries(freq, cum).reshape(-1)
    args = (words, offsets, cls, used, dent, lut, block, cval, cstep, tfac)
    dispatch.parallel(lambda a, b: C.decode_range(*args, *out.kernel_args(), ok, a, b), streams)
    return bool(ok.all())


def decode(
    words: np.ndarray[Any, Any],
    offsets: np.ndarray[Any, Any],
    cls: np.ndarray[Any, Any],
    tables: Tables,
    block: int,
    cval: np.ndarray[Any, Any],
    cstep: np.ndarray[Any, Any],
    tfac: np.ndarray[Any, Any],
) -> tuple[torch.Tensor, bool]:
    """The reference's contract: a float32 ``[P, L, T, D]`` tensor."""
    planes, layers, tokens = tfac.shape
    out = torch.empty((planes, layers, tokens, cls.shape[2]), dtype=torch.float32)
    ok = decode_into(source_of(out), words, offsets, cls, tables, block, cval, cstep, tfac)
    return out, ok
