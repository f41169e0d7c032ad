"""The ``kvtc`` calibration of a model: bases, means, steps and tables, as a stored object.

A calibration is serialized with msgspec's MessagePack (deterministic: fields in declaration
order, arrays as little-endian bytes; no pickle) and named by the SHA-256 of those bytes.
Frames name the calibration that coded them by that hash, so a reader with another
calibration, or none, cannot decode them into a wrong tensor (``serde.kvtc.registry``).

Layers are coded in groups of ``group`` consecutive layers (the last group may be smaller):
the feature vector of a token in a group is its ``group * channels`` K (or V) values, layer
after layer. Per (plane, group) the calibration holds the mean of those vectors, an
orthonormal basis truncated to the components that carry energy above the plane's
quantization step (``rank`` columns, stored float16), and per component its shift and class
(``serde.kvtc.symbols``). Per plane one uniform step; per (plane, class) one rANS table.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from serde.cachegen.tables import Tables
from serde.kvtc import symbols
from serde.kvtc.rope import Rope, fits

if TYPE_CHECKING:
    import torch

VERSION = 1
MAX_LAYERS = 4096
MAX_CHANNELS = 1 << 16
MAX_FEATURES = 1 << 16


class GroupBasis(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    rank: int
    mean: bytes  # <f4 [features]
    basis: bytes  # <f2 [features, rank], orthonormal columns (up to float16 rounding)
    shift: bytes  # u1 [rank]
    cls: bytes  # u1 [rank]
    # <f4 [features], all > 0, or empty (all ones): the basis is over ``scale * (x - mean)``,
    # a metric in which a unit of error costs the same wherever it falls (keys weighted by
    # their queries' energy: ``serde.kvtc.weights``)
    scale: bytes = b""


class PlaneCalibration(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    step: float
    groups: list[GroupBasis]
    # layers per group of this plane; 0: the calibration's ``group`` (the post-RoPE key plane
    # keeps its full basis, so it is grouped by single layers to keep its size down)
    group: int = 0


class Calibration(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    layers: int
    channels: int
    group: int  # layers per group
    rope_head_dim: int  # 0: keys were calibrated as stored (post-RoPE)
    rope_theta: float
    # keys (RoPE undone when ``rope_head_dim``), values, and with RoPE also keys as stored
    # (post-RoPE: what a chunk whose position is unknown is coded with)
    planes: list[PlaneCalibration]
    tables: list[bytes]  # per (plane, class): ``symbols.table_codes``
    note: str = ""  # where it came from (free text)

    @property
    def rope(self) -> Rope | None:
        return Rope(self.rope_head_dim, self.rope_theta) if self.rope_head_dim else None

    def plane_group(self, plane: int) -> int:
        """Layers per group of ``plane``."""
        return self.planes[plane].group or self.group

    def group_layers(self, plane: int) -> list[tuple[int, int]]:
        """``(first layer, layers)`` of each group of ``plane``."""
        size = self.plane_group(plane)
        return [(a, min(size, self.layers - a)) for a in range(0, self.layers, size)]

    def basis_bytes(self) -> int:
        return sum(len(g.basis) for p in self.planes for g in p.groups)


class CalibrationError(ValueError):
    """Bytes that are not a valid calibration."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Calibration)


def to_bytes(cal: Calibration) -> bytes:
    return _encoder.encode(cal)


def digest(data: bytes | memoryview) -> str:
    """The content hash that names a calibration: SHA-256, lowercase hex."""
    return hashlib.sha256(data).hexdigest()


def from_bytes(data: bytes | memoryview) -> Calibration:
    """Parse and validate; ``CalibrationError`` for anything ``fit`` cannot have written."""
    try:
        cal = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CalibrationError(f"not a kvtc calibration: {exc}") from None
    problem = _problem(cal)
    if problem is not None:
        raise CalibrationError(f"invalid kvtc calibration: {problem}")
    return cal


def _problem(cal: Calibration) -> str | None:
    if cal.version != VERSION:
        return f"version {cal.version}"
    if not (1 <= cal.layers <= MAX_LAYERS and 1 <= cal.channels <= MAX_CHANNELS):
        return "layers or channels out of range"
    if not 1 <= cal.group <= cal.layers or cal.group * cal.channels > MAX_FEATURES:
        return "bad layer group"
    if any(not 0 <= p.group <= cal.group for p in cal.planes):
        return "bad plane layer group"
    if cal.rope_head_dim and not (fits(Rope(cal.rope_head_dim, 1.0), cal.channels)):
        return "RoPE head dimension does not divide the channels"
    if cal.rope_head_dim and not (np.isfinite(cal.rope_theta) and cal.rope_theta > 1.0):
        return "bad RoPE theta"
    if len(cal.planes) != (3 if cal.rope_head_dim else 2):
        return "wrong plane count"
    for index, plane in enumerate(cal.planes):
        groups = cal.group_layers(index)
        if not (np.isfinite(plane.step) and plane.step > 0) or len(plane.groups) != len(groups):
            return "bad step or group count"
        for g, (_, n) in zip(plane.groups, groups, strict=True):
            features = n * cal.channels
            if not 0 <= g.rank <= features:
                return "rank out of range"
            sizes = (len(g.mean), len(g.basis), len(g.shift), len(g.cls))
            if sizes != (4 * features, 2 * features * g.rank, g.rank, g.rank):
                return "array sizes disagree"
            if not np.isfinite(np.frombuffer(g.mean, "<f4")).all():
                return "non-finite mean"
            if not np.isfinite(np.frombuffer(g.basis, "<f2")).all():
                return "non-finite basis"
            if g.scale and not _valid_scale(g.scale, features):
                return "bad feature scale"
            if g.rank and (max(g.shift) > symbols.MAX_SHIFT or max(g.cls) >= symbols.NCLS):
                return "shift or class out of range"
    return symbols.check_codes(cal.tables, len(cal.planes))


def _valid_scale(scale: bytes, features: int) -> bool:
    if len(scale) != 4 * features:
        return False
    s = np.frombuffer(scale, "<f4")
    return bool(np.isfinite(s).all() and (s > 0).all() and (np.isfinite(1.0 / s)).all())


@dataclass(eq=False)
class Loaded:
    """A validated calibration with its hash and the arrays the codec computes with."""

    cal: Calibration
    sha256: str
    data: bytes
    _device: dict[str, list[list[Device]]] = field(default_factory=dict)
    _coords: dict[tuple[int, ...], Coords] = field(default_factory=dict)

    @functools.cached_property
    def tables(self) -> Tables:
        return symbols.tables_of(self.cal.tables, len(self.cal.planes))

    @functools.cached_property
    def lut(self) -> np.ndarray[Any, Any]:
        """``[tables, 2**PREC]`` uint8: the symbol of every rANS slot (decoding)."""
        out: np.ndarray[Any, Any] = self.tables.lut()
        return out

    def key_plane(self, unrotated: bool) -> int:
        """The calibration plane that codes keys: 0 (as calibrated) or 2 (post-RoPE keys of
        a RoPE-undone calibration, for chunks whose position is unknown)."""
        return 0 if unrotated or self.cal.rope_head_dim == 0 else 2

    def coords(self, planes: tuple[int, ...]) -> Coords:
        """``coords_of`` for the planes a chunk is coded with (keys' plane, values')."""
        got = self._coords.get(planes)
        if got is None:
            got = self._coords[planes] = self._coords_of(planes)
        return got

    def _coords_of(self, planes: tuple[int, ...]) -> Coords:
        """Per coordinate, over (plane, group, component) in that order: table id, shift,
        range; and where each (plane, group) starts."""
        tid, shift, rng, start = [], [], [], [0]
        for p in planes:
            for g in self.cal.planes[p].groups:
                cls = np.frombuffer(g.cls, np.uint8)
                tid.append(symbols.table_id(p, cls))
                shift.append(np.frombuffer(g.shift, np.uint8).astype(np.int64))
                rng.append(symbols.RANGES[cls])
                start.append(start[-1] + g.rank)
        cat = np.concatenate
        return Coords(cat(tid), cat(shift), cat(rng), np.array(start, np.int64))

    def arrays(self, device: torch.device) -> list[list[Device]]:
        """Per plane, per group: the group's transform as float32 on ``device``."""
        key = str(device)
        got = self._device.get(key)
        if got is None:
            got = [
                [Device.of(g, plane.step, device) for g in plane.groups]
                for plane in self.cal.planes
            ]
            self._device[key] = got
        return got


@dataclass(frozen=True, slots=True)
class Coords:
    tid: np.ndarray[Any, Any]  # [N] int64
    shift: np.ndarray[Any, Any]  # [N] int64
    rng: np.ndarray[Any, Any]  # [N] int64
    start: np.ndarray[Any, Any]  # [planes * groups + 1] int64

    @property
    def count(self) -> int:
        return int(self.start[-1])


@dataclass(frozen=True, slots=True)
class Device:
    """A group's transform, in steps: ``q = encode @ x.T - offset`` (then rounded) and
    ``x_hat = q.T @ decode + mean``. A feature scale ``s`` folds into the matrices (the
    basis is over ``s * x``), so it costs nothing per chunk."""

    mean: torch.Tensor  # [F]
    encode: torch.Tensor  # [rank, F]: basis.T * s / step, contiguous
    offset: torch.Tensor  # [rank, 1]: encode @ mean
    decode: torch.Tensor  # [rank, F]: basis.T / s * step, contiguous
    scale: torch.Tensor | None  # [F] s, or None (all ones): the metric of the chunk guard
    step: float

    @classmethod
    def of(cls, g: GroupBasis, step: float, device: torch.device) -> Device:
        import torch

        mean = torch.from_numpy(np.frombuffer(g.mean, "<f4").copy()).to(device)
        features = len(g.mean) // 4  # explicit: a group with no components has rank 0
        basis = np.frombuffer(g.basis, "<f2").astype(np.float32).reshape(features, g.rank)
        bt = torch.from_numpy(basis).to(device).t()
        s = None
        if g.scale:
            s = torch.from_numpy(np.frombuffer(g.scale, "<f4").copy()).to(device)
            encode = (bt * (s / step)).contiguous()
            decode = (bt * (step / s)).contiguous()
        else:
            encode = (bt * (1.0 / step)).contiguous()
            decode = (bt * step).contiguous()
        return cls(mean, encode, (encode @ mean)[:, None], decode, s, step)


def load(data: bytes | memoryview) -> Loaded:
    raw = bytes(data)
    return Loaded(from_bytes(raw), digest(raw), raw)
