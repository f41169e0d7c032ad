"""``kvtc``: a calibrated transform codec for KV chunks (KVTC-style: PCA, one step, rANS).

A chunk seen as ``[planes, layers, tokens, channels]`` (``serde.layout``) is coded with a
per-model calibration (``serde.kvtc.calibration``, fitted by ``serde.kvtc.fit`` /
``kvgate calibrate``):

1. the sinks (first positions of a sequence) and an optional recent window are stored
   exactly, in the stored dtype (``serde.kvtc.transform``);
2. keys have RoPE undone when the chunk's start position is known (``ObjectData.position``,
   from ``Store.put(..., position=N)``) and at most ``ROPE_MAX_POSITION``; otherwise they are
   coded as stored (post-RoPE), with the calibration's post-RoPE key basis, at some cost in
   ratio. The frame records which;
3. per (plane, layer group) the tokens' feature vectors minus the calibration's mean are
   projected on its truncated basis and divided by the plane's step, rounded;
4. the integers are coded with static rANS and the calibration's tables (``stream``).

Decoding inverts this (``x_hat = mean + basis @ (q * step)``, RoPE redone). The frame's params
carry the calibration's SHA-256 (``cal``), the start position (``pos``, when known) with the
RoPE parameters used (``theta``, ``hd``), and the exact-token counts. A process that does not
have the calibration raises ``MissingSideObject``: the tier fetches it from itself (it is
stored under ``kvgate/side/kvtc-calibration/<sha256>`` before the first frame that names it),
verifies its hash and decodes again; missing or altered, the frame is a counted miss.

Options: ``calibration`` (a loaded calibration's hash or a calibration file's path),
``sinks`` (default 4) and ``window`` (trailing tokens of each chunk kept exact, default 0).

Without a calibration, or for a chunk it does not fit (other layers or channels, one-plane
layouts, generic tensors), the chunk is coded by ``cachegen`` (params ``via: cachegen``), so
any object can be put through ``kvtc``; ``documented_rel_error`` is cachegen's bound. With a
calibration, the relative error per plane is about the calibration's ``rel_error`` on data
like the calibration's (measured in ``tests/test_kvtc.py``); a chunk unlike it, on which the
calibration's error would pass ``guard.UNLIKE`` (``serde.kvtc.guard``), goes to ``cachegen``
too. Non-float objects are exact.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import numpy as np

from gateway.errors import ConfigError, CorruptObject
from gateway.frame import FrameInfo
from gateway.object_meta import MAX_POSITION
from gateway.objects import ITEMSIZE, ObjectData, torch_dtype
from gateway.types import Buffer, BufferParts, ParamValue
from serde.cachegen.codec import CacheGenCodec
from serde.cachegen.model import FINITE_MAX
from serde.kvtc import guard, host, registry, stream, transform
from serde.kvtc.calibration import Device, Loaded
from serde.kvtc.rope import Rope, fits
from serde.layout import KVLayout, layout_of
from serde.tensors import (
    PayloadReader,
    check_decodable,
    float_tensor,
    is_raw,
    param_int,
    raw_decode,
    raw_encode,
    tensor_bytes,
)

VERSION = 1
VIA = "via"
MAX_EXACT = 1 << 20
# RoPE is undone at start positions up to this, and coded as stored above it. The angle of a
# key pair at position p is p * theta ** (-2i / h) in float64, rounded by up to p * 2**-53
# radians: at 2**40 about 1e-4, two orders under the codec's error, but beyond it the rounding
# grows towards that error (and from 2**53 a chunk's positions are no longer distinct floats),
# so the undone keys would stop matching the calibration's unrotated basis. No model has such
# contexts; chunks put there (any position a Store takes, up to MAX_POSITION) still round-trip.
ROPE_MAX_POSITION = 1 << 40
COEFF_LIMIT = 2.0**30  # |coefficient / step| beyond this: stored verbatim


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_EXACT:
        raise ConfigError(f"codec kvtc: {name} must be an int in 0..{MAX_EXACT}")
    return value


class KvtcCodec:
    name = "kvtc"
    lossless = False
    client_options = frozenset({"calibration", "sinks", "window"})  # what HTTP clients may set
    documented_rel_error = CacheGenCodec.documented_rel_error

    def __init__(
        self, calibration: str | None = None, sinks: int = 4, window: int = 0, **options: Any
    ) -> None:
        if options:
            raise ConfigError(f"codec kvtc: unknown options {', '.join(sorted(options))}")
        if calibration is not None and not isinstance(calibration, str):
            raise ConfigError("codec kvtc: calibration must be a hash or a file path")
        self.loaded: Loaded | None = None if calibration is None else registry.resolve(calibration)
        self.sinks = _count("sinks", sinks)
        self.window = _count("window", window)
        self._fallback = CacheGenCodec()

    @property
    def side_objects(self) -> list[tuple[str, bytes]]:
        """What a tier must hold before this codec's frames (see ``gateway.side_objects``)."""
        if self.loaded is None:
            return []
        return [(registry.key_of(self.loaded.sha256), self.loaded.data)]

    # -- encode ----------------------------------------------------------------------------

    def encode(self, obj: ObjectData) -> tuple[BufferParts, dict[str, ParamValue]]:
        t = float_tensor(obj)
        if t is None:
            return raw_encode(obj)
        layout = layout_of(obj.meta.fmt, obj.meta.shape)
        loaded = self.loaded
        if loaded is None or not _fits(loaded, layout):
            return self._via_fallback(obj)
        position = getattr(obj, "position", None)
        coded = self._encode(loaded, layout, t, position)
        if isinstance(coded, _Unfit):  # the calibration does not describe this chunk (guard)
            return self._via_fallback(obj)
        if coded is None or sum(memoryview(p).nbytes for p in coded[0]) >= obj.meta.nbytes:
            return raw_encode(obj)  # NaN or infinity, or a chunk too small to gain anything
        return list(coded[0]), coded[1]

    def _via_fallback(self, obj: ObjectData) -> tuple[BufferParts, dict[str, ParamValue]]:
        payload, params = self._fallback.encode(obj)
        return payload, {**params, VIA: "cachegen"}

    def _encode(
        self, loaded: Loaded, layout: KVLayout, t: Any, position: int | None
    ) -> tuple[list[Buffer], dict[str, ParamValue]] | _Unfit | None:
        cal = loaded.cal
        canon = layout.to_canonical(t)
        tokens = layout.tokens
        head, tail = transform.exact_tokens(tokens, position, self.sinks, self.window)
        rope = cal.rope if position is not None and position <= ROPE_MAX_POSITION else None
        planes = (loaded.key_plane(rope is not None), 1)
        mid = canon[:, :, head : tokens - tail]
        first = (position or 0) + head
        if t.device.type == "cpu":
            coded = _coefficients_host(loaded, planes, mid, rope, first)
        else:
            coded = _coefficients_torch(loaded, planes, mid, rope, first)
        if coded is None:
            return None
        q, fits = coded
        if not guard.finite(fits):
            return None  # sums that overflowed, or a NaN no coefficient saw: stored verbatim
        # Keys and values with one step were budgeted together (a weighted calibration).
        joint = cal.planes[planes[0]].step == cal.planes[planes[1]].step
        if guard.unlike(fits, joint=joint):
            return UNFIT
        exact = [canon[:, :, :head], canon[:, :, tokens - tail :]]
        exact_bytes = [_host_bytes(e) for e in exact if e.shape[2]]
        block = stream.default_block(q.shape[1])
        sections = stream.encode(loaded, planes, q, block)
        params: dict[str, ParamValue] = {
            "v": VERSION,
            "cal": loaded.sha256,
            "block": block,
            "head": head,
            "tail": tail,
        }
        if position is not None:
            params["pos"] = position
        if rope is not None:
            params["theta"] = rope.theta
            params["hd"] = rope.head_dim
        return [*exact_bytes, *sections], params

    # -- decode ----------------------------------------------------------------------------

    def decode(self, payload: memoryview, info: FrameInfo, out: memoryview | None) -> Buffer:
        if is_raw(info) and VIA not in info.params:
            return raw_decode(payload, info, out)
        if VIA in info.params:
            if info.params[VIA] != "cachegen":
                raise CorruptObject(f"kvtc frame via an unknown codec {info.params[VIA]!r}")
            inner = {k: v for k, v in info.params.items() if k != VIA}
            return self._fallback.decode(payload, _with_params(info, inner), out)
        check_decodable(info)
        param_int(info, "v", VERSION, VERSION)
        sha = info.params.get("cal")
        if not isinstance(sha, str) or len(sha) != 64:
            raise CorruptObject("kvtc frame without a calibration hash")
        layout = layout_of(info.fmt, info.shape)
        if layout.numel * ITEMSIZE[info.dtype] != info.raw_len or layout.numel == 0:
            raise CorruptObject("kvtc frame: shape and raw length disagree")
        loaded = self.loaded
        if loaded is None or loaded.sha256 != sha:
            loaded = registry.require(sha)  # MissingSideObject: the tier fetches it
        if not _fits(loaded, layout):
            raise CorruptObject("kvtc frame: its calibration does not fit its shape")
        return self._decode(loaded, layout, payload, info, out)

    def _decode(
        self,
        loaded: Loaded,
        layout: KVLayout,
        payload: memoryview,
        info: FrameInfo,
        out: memoryview | None,
    ) -> Buffer:
        import torch

        cal = loaded.cal
        tokens = layout.tokens
        head = param_int(info, "head", 0, tokens)
        tail = param_int(info, "tail", 0, tokens - head)
        coded = tokens - head - tail
        block = param_int(info, "block", 1, max(1, stream.STREAM_SYMBOLS))
        position = _position(info)
        rope = _frame_rope(info, layout.channels)
        if rope is not None and (position is None or position > ROPE_MAX_POSITION):
            raise CorruptObject("kvtc frame: RoPE parameters without a position it undoes")
        dtype = torch_dtype(info.dtype)
        reader = PayloadReader(payload, "kvtc")
        canon = torch.empty(layout.canonical_shape, dtype=dtype)
        for first, n in ((0, head), (tokens - tail, tail)):
            if n:
                canon[:, :, first : first + n] = reader.tensor(
                    info.dtype, (layout.planes, layout.layers, n, layout.channels)
                )
        if rope is not None and not cal.rope_head_dim:
            raise CorruptObject("kvtc frame: RoPE undone with a calibration that does not")
        planes = (loaded.key_plane(rope is not None), 1)
        qf = stream.decode(loaded, planes, reader, coded, block)
        reader.finish()
        arrays = loaded.arrays(torch.device("cpu"))
        start = loaded.coords(planes).start
        mid = np.empty((2, layout.layers, coded, layout.channels), np.float32)
        jobs = []
        k = 0  # (plane, group) in coords' order; planes may have different group counts
        for i, p in enumerate(planes):
            for j, (first, n) in enumerate(cal.group_layers(p)):
                rows = qf[int(start[k]) : int(start[k + 1])]
                k += 1
                jobs.append(
                    partial(_reconstruct_into, mid[i, first : first + n], rows, arrays[p][j])
                )
        host.run_groups(jobs)
        if rope is not None:
            assert position is not None
            mid[0] = host.rotate(mid[0], rope, position + head, 1.0)
        limit = FINITE_MAX[info.dtype]
        np.clip(mid, -limit, limit, out=mid)
        host.into_tensor(canon[:, :, head : tokens - tail], mid)
        return tensor_bytes(layout.from_canonical(canon), out)


def _reconstruct_into(out: np.ndarray[Any, Any], q: np.ndarray[Any, Any], dev: Device) -> None:
    """``out`` ``[layers, tokens, channels]`` of a group from its coefficients."""
    x = host.reconstruct(q, dev)  # [tokens, layers * channels]
    out[...] = x.reshape(x.shape[0], out.shape[0], -1).transpose(1, 0, 2)


def _coefficients_host(
    loaded: Loaded, planes: tuple[int, int], mid: Any, rope: Rope | None, first: int
) -> Coded | None:
    """The rounded coefficients ``[components, tokens]`` int32 of host K/V ``mid``
    ``[2, L, T, D]`` (any float dtype) and, per plane, each group's ``(error^2, energy^2)``
    (``serde.kvtc.guard``); None when they are not finite or too large."""
    import torch

    cal = loaded.cal
    x32 = host.float32(mid)
    keys = host.rotate(x32[0], rope, first, -1.0) if rope is not None else x32[0]
    coords = loaded.coords(planes)
    arrays = loaded.arrays(torch.device("cpu"))
    q = np.empty((coords.count, x32.shape[2]), np.int32)
    fits: list[list[tuple[float, float]]] = []
    jobs = []
    k = 0
    for p, data in zip(planes, (keys, x32[1]), strict=True):
        groups = cal.group_layers(p)
        plane_fits = [(0.0, 0.0)] * len(groups)  # each group's job fills in its own
        fits.append(plane_fits)
        for j, (a, n) in enumerate(groups):
            rows = q[int(coords.start[k]) : int(coords.start[k + 1])]
            k += 1
            job = partial(_coefficients_into, rows, data[a : a + n], arrays[p][j], plane_fits, j)
            jobs.append(job)
    try:
        host.run_groups(jobs)
    except ValueError:
        return None  # NaN, infinity or magnitudes no step can code
    dropped = any(g.rank == 0 for p in planes for g in cal.planes[p].groups)
    if dropped and not np.isfinite(x32).all():  # a group without components checks nothing
        return None
    return q, fits


def _coefficients_into(
    out: np.ndarray[Any, Any],
    layers: np.ndarray[Any, Any],
    dev: Device,
    fits: list[tuple[float, float]],
    index: int,
) -> None:
    x = layers.transpose(1, 0, 2).reshape(layers.shape[1], -1)  # [tokens, F]
    fits[index] = host.coefficients(x, dev, out)


def _coefficients_torch(
    loaded: Loaded, planes: tuple[int, int], mid: Any, rope: Rope | None, first: int
) -> Coded | None:
    """``_coefficients_host`` on the tensor's device (a GPU: the products are matmuls there)."""
    import torch

    cal = loaded.cal
    x = mid.float()
    keys = transform.unrotated_keys(x[0], rope, first) if rope is not None else x[0]
    arrays = loaded.arrays(mid.device)
    ys = []
    group_fits = []  # [error^2, energy^2] per (plane, group), on the device
    for p, data in zip(planes, (keys, x[1]), strict=True):
        for j, (a, n) in enumerate(cal.group_layers(p)):
            features = transform.group_features(data, a, n)
            c = transform.coefficients(features, arrays[p][j])
            group_fits.append(guard.torch_fit(features, c, arrays[p][j]))
            ys.append(c)
    on_host = torch.stack(group_fits).cpu().tolist()
    first_plane = len(cal.group_layers(planes[0]))
    fits = [
        [(float(e), float(f)) for e, f in on_host[:first_plane]],
        [(float(e), float(f)) for e, f in on_host[first_plane:]],
    ]
    y = torch.cat(ys)  # [components, coded tokens]
    if y.numel() == 0 and not bool(torch.isfinite(x).all()):
        return None
    # NaN and infinity in x make their coefficients NaN or infinite: caught here too.
    if y.numel() and not float(y.abs().max()) <= COEFF_LIMIT:
        return None
    q: np.ndarray[Any, Any] = y.round_().to(torch.int32).cpu().numpy()
    return q, fits


class _Unfit:
    """What ``_encode`` returns for a chunk its calibration does not describe."""


UNFIT = _Unfit()
# The coefficients, and per plane each group's (error^2, energy^2) (serde.kvtc.guard).
Coded = tuple[np.ndarray[Any, Any], list[list[tuple[float, float]]]]


def _fits(loaded: Loaded, layout: KVLayout) -> bool:
    cal = loaded.cal
    return (
        layout.planes == 2
        and layout.layers == cal.layers
        and layout.channels == cal.channels
        and layout.tokens > 0
    )


def _host_bytes(t: Any) -> bytes:
    from serde.tensors import host_bytes

    return bytes(host_bytes(t.contiguous()))


def _position(info: FrameInfo) -> int | None:
    if "pos" not in info.params:
        return None
    return param_int(info, "pos", 0, MAX_POSITION)


def _frame_rope(info: FrameInfo, channels: int) -> Rope | None:
    if "theta" not in info.params and "hd" not in info.params:
        return None
    theta = info.params.get("theta")
    hd = param_int(info, "hd", 2, channels)
    if isinstance(theta, bool) or not isinstance(theta, int | float):
        raise CorruptObject("kvtc frame: bad RoPE theta")
    if not (math.isfinite(theta) and theta > 1.0) or not fits(Rope(hd, float(theta)), channels):
        raise CorruptObject("kvtc frame: bad RoPE parameters")
    return Rope(hd, float(theta))


def _with_params(info: FrameInfo, params: dict[str, ParamValue]) -> FrameInfo:
    import msgspec

    return msgspec.structs.replace(info, params=params)
