"""CacheGen kernels in plain torch: the executable spec of the ``cachegen`` payload.

The numba (``gpu.cpu.cachegen``) and CUDA (``gpu.cuda.cachegen``) kernels compute the same
integers and floats; this module says what they are. It runs on any device. The shapes, with
``[P, L, T, D]`` the model view (``serde.cachegen.model``):

- ``stats(x)``: float64 channel means and variances ``[P, L, D]`` and the mean over channels
  of every token's squared deviation from the channel mean divided by the channel's variance
  (0 for constant channels) ``[P, L, T]``;
- ``quantize(x, cval, icstep, itfac)``: ``u = ((x - cval) * icstep) * itfac`` in float32;
  the symbols ``q = clamp(rint(u), -QMAX, QMAX)`` int8 in channel-major order ``[P, L, D, T]``
  (each channel's tokens contiguous, as the streams read them), the largest ``|u|`` of each
  channel (float32) and the sum of its ``q**2`` (int64);
- ``histogram(sym, cls)``: the count of each symbol under each table ``[P*NCLS*NCTX, NSYM]``;
- ``encode(sym, cls, tables, block)``: the rANS streams (``gpu.reference.rans``);
- ``decode(...)``: symbols back from the streams, dequantized to ``[P, L, T, D]`` float32 as
  ``cval + q * (cstep * tfac)``.

Stream ``s = (p * L + l) * nblocks + b`` holds the channels ``b*block .. (b+1)*block - 1`` of
(plane p, layer l), channel after channel, each channel's tokens in order. The table of symbol
``q[p, l, c, t]`` is ``(p * NCLS + cls[p, l, c]) * NCTX + ctx`` with ``ctx`` the context of
``q[p, l, c, t - 1]`` (``CTX_START`` at ``t = 0``; ``serde.cachegen.tables``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gpu.reference import rans
from serde.cachegen.tables import CTX_START, NCLS, NCTX, NSYM, QMAX, THRESHOLDS, Tables


def stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 statistics of the model view ``x`` (any float dtype); non-finite if ``x`` is."""
    x64 = x.double()
    mean = x64.mean(dim=2)
    dev = x64 - mean[:, :, None, :]
    var = (dev * dev).mean(dim=2)
    inv = torch.where(var > 0, 1.0 / torch.where(var > 0, var, 1.0), 0.0)
    tms = (dev * dev * inv[:, :, None, :]).mean(dim=3)
    return mean, var, tms


def quantize(
    x: torch.Tensor, cval: torch.Tensor, icstep: torch.Tensor, itfac: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    u = ((x.float() - cval[:, :, None, :]) * icstep[:, :, None, :]) * itfac[:, :, :, None]
    maxu = u.abs().amax(dim=2)
    q = torch.round(u).clamp(-QMAX, QMAX).to(torch.int8)
    sym = q.transpose(2, 3).contiguous()
    sumsq = (sym.long() * sym.long()).sum(dim=3)
    return sym, maxu, sumsq


def contexts(sym: torch.Tensor, cls: torch.Tensor) -> torch.Tensor:
    """The context of every symbol ``[P, L, D, T]`` (from its predecessor in the channel)."""
    th = torch.as_tensor(THRESHOLDS, device=sym.device).long()
    prev = sym[..., :-1].long()
    th1 = th[cls.long(), 0][..., None]
    th2 = th[cls.long(), 1][..., None]
    a = prev.abs()
    m = (a > th1).long() + (a > th2).long()
    ctx = torch.full(sym.shape, CTX_START, dtype=torch.int64, device=sym.device)
    ctx[..., 1:] = CTX_START + torch.sign(prev) * m
    return ctx


def table_ids(sym: torch.Tensor, cls: torch.Tensor) -> torch.Tensor:
    planes = sym.shape[0]
    p = torch.arange(planes, device=sym.device).view(planes, 1, 1, 1)
    return (p * NCLS + cls.long()[..., None]) * NCTX + contexts(sym, cls)


def histogram(sym: torch.Tensor, cls: torch.Tensor) -> torch.Tensor:
    ids = table_ids(sym, cls) * NSYM + (sym.long() + QMAX)
    n = sym.shape[0] * NCLS * NCTX
    return torch.bincount(ids.reshape(-1), minlength=n * NSYM).view(n, NSYM)


def _blocked(a: torch.Tensor, block: int, fill: int) -> torch.Tensor:
    """``[P, L, D, T]`` -> ``[streams, block * T]`` (channels padded to whole blocks)."""
    planes, layers, channels, tokens = a.shape
    nblocks = -(-channels // block)
    pad = nblocks * block - channels
    if pad:
        a = torch.cat([a, a.new_full((planes, layers, pad, tokens), fill)], dim=2)
    return a.reshape(planes * layers * nblocks, block * tokens)


def _counts(
    channels: int, tokens: int, block: int, planes: int, layers: int, dev: Any
) -> torch.Tensor:
    nblocks = -(-channels // block)
    b = torch.arange(nblocks, device=dev)
    per = (channels - b * block).clamp(max=block) * tokens
    return per.repeat(planes * layers)


def _dense(tables: Tables, dev: Any) -> tuple[torch.Tensor, ...]:
    return (
        torch.as_tensor(tables.tmap, device=dev).long(),
        torch.as_tensor(tables.freq, device=dev).long(),
        torch.as_tensor(tables.cum, device=dev).long(),
    )


def encode(
    sym: torch.Tensor, cls: torch.Tensor, tables: Tables, block: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``(words uint16, lengths int64)`` of all streams (host arrays)."""
    planes, layers, channels, tokens = sym.shape
    tmap, freq, cum = _dense(tables, sym.device)
    dense = tmap[table_ids(sym, cls)]
    s = _blocked(sym.long() + QMAX, block, 0)
    t = _blocked(dense, block, 0)
    count = _counts(channels, tokens, block, planes, layers, sym.device)
    words, lengths = rans.encode(s, t, count, freq, cum)
    return words.cpu().numpy().astype(np.uint16), lengths.cpu().numpy()


def decode(
    words: np.ndarray[Any, Any],
    offsets: np.ndarray[Any, Any],
    cls: np.ndarray[Any, Any],
    tables: Tables,
    block: int,
    cval: np.ndarray[Any, Any],
    cstep: np.ndarray[Any, Any],
    tfac: np.ndarray[Any, Any],
    device: Any = "cpu",
) -> tuple[torch.Tensor, bool]:
    """``(x_hat [P, L, T, D] float32, every stream decoded cleanly)`` from host arrays (the
    parsed payload), computed on ``device``."""
    arrays = (words.astype(np.int64), offsets, cls, cval, cstep, tfac)
    w, o, k, cv, cs, tf = (torch.as_tensor(a, device=device) for a in arrays)
    return _decode(w, o, k, cv, cs, tf, tables, block)


def _decode(
    words: torch.Tensor,
    offsets: torch.Tensor,
    cls: torch.Tensor,
    cval: torch.Tensor,
    cstep: torch.Tensor,
    tfac: torch.Tensor,
    tables: Tables,
    block: int,
) -> tuple[torch.Tensor, bool]:
    planes, layers, tokens = tfac.shape
    channels = cls.shape[2]
    dev = cls.device
    tmap, freq, cum = _dense(tables, dev)
    lut = torch.as_tensor(tables.lut(), device=dev)
    nblocks = -(-channels // block)
    streams = planes * layers * nblocks
    sidx = torch.arange(streams, device=dev)
    p = sidx // (layers * nblocks)
    first = (sidx % nblocks) * block
    pl = sidx // nblocks  # flat (plane, layer)
    th = torch.as_tensor(THRESHOLDS, device=dev).long()
    cls_flat = cls.long().reshape(planes * layers, channels)
    count = _counts(channels, tokens, block, planes, layers, dev)
    dec = rans.Decoder(words, offsets)
    out = torch.zeros((streams, block * tokens), dtype=torch.int64, device=dev)
    prev = torch.zeros(streams, dtype=torch.int64, device=dev)
    for i in range(block * tokens):
        active = count > i
        c = (first + i // tokens).clamp_max(channels - 1)
        k = cls_flat[pl, c]
        if i % tokens == 0:
            ctx = torch.full_like(prev, CTX_START)
        else:
            a = prev.abs()
            ctx = CTX_START + torch.sign(prev) * ((a > th[k, 0]).long() + (a > th[k, 1]).long())
        tbl = tmap[(p * NCLS + k) * NCTX + ctx]
        s = dec.get(tbl, active, freq, cum, lut)
        prev = s - QMAX
        out[:, i] = prev
    ok = bool(dec.finish().all())
    q = out.view(planes, layers, nblocks * block, tokens)[:, :, :channels, :]
    step = cstep[:, :, None, :] * tfac[:, :, :, None]
    x_hat = cval[:, :, None, :] + q.transpose(2, 3).float() * step
    return x_hat, ok
