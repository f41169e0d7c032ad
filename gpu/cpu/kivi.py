"""KIVI on the CPU: the numba kernels of ``gpu.cpu.kivi_kernels`` split over both cores.

``encode`` and ``decode_into`` take the canonical ``[planes, layers, tokens, channels]`` view
(``serde.layout``) of a contiguous host tensor and hand the kernels its flat storage plus
element strides, so KV_T2D and every other format are read and written in place without a
transposing copy. The payload is built in one preallocated buffer; the residual tokens are
copied by torch. Importing this module imports numba (the codec imports it lazily).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gpu import dispatch
from gpu.cpu import kivi_kernels as K
from gpu.reference.kivi import KIND, RECIP, KiviGeometry

# Below this many elements per chunk, a thread hand-off costs more than it saves.
MIN_CHUNK_ELEMENTS = 1 << 16
VALUE_BLOCK = 16  # token rows per unit of a per-token plane (finer than a group: balance)
# numba dispatchers, typed as Any: numba's own annotations do not describe compiled calls.
_ENCODE: Any = K.encode_plane
_DECODE: Any = K.decode_plane
_EMPTY16 = np.empty(0, np.uint16)
_EMPTY32 = np.empty(0, np.float32)


def _readonly(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    view = a.view()
    view.flags.writeable = False  # one numba specialization for writable and read-only input
    return view


def _flat(t: torch.Tensor) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(uint16 view, float32 view) of the whole storage under ``t`` (one is an empty dummy)."""
    size = t.untyped_storage().nbytes() // t.element_size()
    flat = t.as_strided((size,), (1,), 0)
    if t.dtype == torch.float32:
        return _EMPTY16, flat.numpy()
    return flat.view(torch.int16).numpy().view(np.uint16), _EMPTY32


def _strided(canon: torch.Tensor) -> torch.Tensor:
    if canon.shape[-1] > 1 and canon.stride(-1) != 1:
        return canon.contiguous()
    return canon


def _block(g: KiviGeometry, plane: int) -> int:
    """Tokens per kernel unit: one group for per-channel planes, a few rows for per-token."""
    return g.group if g.per_channel(plane) else VALUE_BLOCK


def _ranges(g: KiviGeometry, plane: int) -> list[tuple[int, int]]:
    block = _block(g, plane)
    units = g.layers * -(-g.quant_tokens // block)
    per_unit = block * g.channels
    parts = max(1, min(dispatch.cpu_workers(), units * per_unit // MIN_CHUNK_ELEMENTS))
    return dispatch.split_range(units, parts)


def _stats_views(
    payload: np.ndarray[Any, Any], g: KiviGeometry, plane: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    n = g.stats_count(plane)
    start = g.stats_offset(plane)
    stats = payload[start : start + 4 * n].view(np.uint16)
    code_start = g.codes_offset(plane)
    return stats[:n], stats[n:], payload[code_start : code_start + g.plane_code_bytes]


def encode(canon: torch.Tensor, g: KiviGeometry) -> np.ndarray[Any, Any] | None:
    """The payload of a canonical host tensor, or ``None`` if it must be stored verbatim."""
    canon = _strided(canon)
    q = g.quant_tokens
    payload = np.empty(g.total, np.uint8)
    if g.residual_bytes:
        res = torch.from_numpy(payload[: g.residual_bytes]).view(canon.dtype)
        res.view(g.planes, g.layers, g.residual, g.channels).copy_(canon[:, :, q:, :])
    if q == 0:
        return payload
    src16, src32 = _flat(canon)
    src16, src32 = _readonly(src16), _readonly(src32)
    kind = KIND[canon.dtype]
    recip = np.float32(RECIP[g.bits])
    off = canon.storage_offset()
    sp, sl, st, _ = canon.stride()
    for plane in range(g.planes):
        mins, scales, codes = _stats_views(payload, g, plane)
        args: tuple[Any, ...] = (src16, src32, kind, off + plane * sp, sl, st, q, g.channels)
        args += (g.group, g.bits, recip, g.per_channel(plane), _block(g, plane))
        args += (mins, scales, codes)

        def run(start: int, end: int, args: tuple[Any, ...] = args) -> int:
            return int(_ENCODE(*args, start, end))

        if sum(dispatch.run_chunks(run, _ranges(g, plane))):
            return None
    return payload


def decode_into(payload: np.ndarray[Any, Any], g: KiviGeometry, canon: torch.Tensor) -> None:
    """Decode a payload of exactly ``g.total`` bytes into ``canon``: the canonical view of a
    contiguous host tensor of the stored dtype (the caller's output buffer)."""
    q = g.quant_tokens
    if g.residual_bytes:  # copied: torch does not wrap read-only payload memory
        res = torch.from_numpy(payload[: g.residual_bytes].copy()).view(canon.dtype)
        canon[:, :, q:, :].copy_(res.view(g.planes, g.layers, g.residual, g.channels))
    if q == 0:
        return
    dst16, dst32 = _flat(canon)
    if payload.ctypes.data % 2:  # float16 statistics must be aligned for the kernels
        payload = payload.copy()
    payload = _readonly(payload)
    kind = KIND[canon.dtype]
    off = canon.storage_offset()
    sp, sl, st, _ = canon.stride()
    for plane in range(g.planes):
        mins, scales, codes = _stats_views(payload, g, plane)
        args: tuple[Any, ...] = (codes, mins, scales, dst16, dst32, kind, off + plane * sp, sl)
        args += (st, q)
        args += (g.channels, g.group, g.bits, g.per_channel(plane), _block(g, plane))

        def run(start: int, end: int, args: tuple[Any, ...] = args) -> None:
            _DECODE(*args, start, end)

        dispatch.run_chunks(run, _ranges(g, plane))
