"""Fitting a ``kvtc`` calibration from sample K/V chunks.

Per (plane, layer group): the mean and covariance of the group's feature vectors over the
calibration tokens (sinks excluded: they are stored exactly), and its eigenvectors (PCA, with
``torch.linalg.eigh`` in float64). Keys have RoPE undone first when the chunks come with
their start positions and the model's RoPE parameters are given.

The allocation is one uniform step per plane, the reverse water-filling of rate-distortion
theory in its simplest form: every kept component gets the same quantization error
``step**2 / 12``, and a component whose spread is below ``TRUNCATE`` steps (which would
almost always quantize to zero anyway) is dropped, its energy becoming error. The step is the
one at which the expected error reaches ``rel_error`` of the plane's root mean square (on the
calibration data). The kept components are what the calibration stores, so the basis is small
when the energy is concentrated (the post-RoPE key plane is not truncated, see
``POST_ROPE``). ``max_basis_bytes`` caps it further: the weakest components
over all groups go first (the error then exceeds the target).

With ``weights`` (``serde.kvtc.weights``) all of this happens in a weighted metric: features
are scaled by the roots of the weights before the PCA (the scales are stored and folded into
the transform), and with ``shared_step`` keys and values get one step budgeted on their joint
weighted energy, so the allocation between them, and between layers, follows the weights.

Tables: the calibration chunks are coded once with the fitted basis and step, and the symbol
counts per (plane, class) become the static tables (``serde.kvtc.symbols``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from serde.kvtc import symbols, transform
from serde.kvtc.calibration import (
    VERSION,
    Calibration,
    GroupBasis,
    Loaded,
    PlaneCalibration,
    to_bytes,
)
from serde.kvtc.calibration import load as load_calibration
from serde.kvtc.rope import Rope, fits

if TYPE_CHECKING:
    import torch

TRUNCATE = 0.3  # components with a spread below this many steps are dropped
DEFAULT_REL_ERROR = 0.05
DEFAULT_SINKS = 4
# The post-RoPE key plane codes keys at any position, also positions the calibration never
# saw, where their energy leaves the calibrated subspace: it keeps its full basis, so its
# error stays the step's whatever the position (measured: truncated, 0.03 at calibrated
# positions but 0.4 at position 5000).
POST_ROPE = 2


@dataclass(frozen=True, slots=True)
class Chunk:
    kv: torch.Tensor  # [2, layers, tokens, channels] (KV_2LTD), any float dtype
    position: int | None = None  # the chunk's first token's position in its sequence


def _planes(chunk: Chunk, rope: Rope | None, sinks: int) -> tuple[torch.Tensor, ...] | None:
    """The calibration planes of the chunk's coded tokens, float32 ``[L, T', D]``: keys
    (RoPE undone), values, and with RoPE the keys as stored."""
    kv = chunk.kv.float()
    head, _ = transform.exact_tokens(kv.shape[2], chunk.position, sinks, 0)
    keys, values = kv[0, :, head:], kv[1, :, head:]
    if keys.shape[1] == 0:
        return None
    if rope is not None:
        if chunk.position is None:
            raise ValueError("a RoPE-undone calibration needs every chunk's start position")
        unrotated = transform.unrotated_keys(keys, rope, chunk.position + head)
        return unrotated, values, keys
    return keys, values


def fit(
    chunks: Sequence[Chunk],
    *,
    group: int = 1,
    rel_error: float | Sequence[float] = DEFAULT_REL_ERROR,
    rope: Rope | None = None,
    sinks: int = DEFAULT_SINKS,
    max_basis_bytes: int | None = None,
    weights: Sequence[np.ndarray[Any, Any] | None] | None = None,
    shared_step: bool = False,
    post_rope_group: int = 1,
    note: str = "",
) -> Loaded:
    """A calibration for chunks shaped like ``chunks`` (same layers and channels).

    ``weights``, per plane (keys, values, post-RoPE keys), ``[layers, channels]`` positive
    or None: how much a squared error of each element costs (``serde.kvtc.weights``); the
    plane is fitted and its error budgeted in that metric (features scaled by the roots).
    ``shared_step``: keys and values get one step, budgeted on their joint energy (weights
    in one unit for both planes, such as end-to-end sensitivity: ``serde.kvtc.weights``)."""
    import torch

    if not chunks:
        raise ValueError("no calibration chunks")
    _, layers, _, channels = chunks[0].kv.shape
    if any(tuple(c.kv.shape[:2]) != (2, layers) or c.kv.shape[3] != channels for c in chunks):
        raise ValueError("calibration chunks must share [2, layers, *, channels]")
    if rope is not None and not fits(rope, channels):
        raise ValueError(f"RoPE head_dim {rope.head_dim} does not divide {channels} channels")
    rel_errors = _per_plane(rel_error)
    group = max(1, min(group, layers))
    # The post-RoPE key plane keeps its full basis (``POST_ROPE``): in groups of
    # ``post_rope_group`` layers (default one) its size grows only linearly with the layers.
    post_group = max(1, min(post_rope_group, group))
    sizes = [post_group if p == POST_ROPE else group for p in range(3)]
    spans = [[(a, min(g, layers - a)) for a in range(0, layers, g)] for g in sizes]
    prepared = [p for p in (_planes(c, rope, sinks) for c in chunks) if p is not None]
    if not prepared:
        raise ValueError("no calibration tokens outside the sinks")
    # Per plane and group: mean, eigenvalues (descending), eigenvectors.
    nplanes = len(prepared[0])
    scales = _scales(weights, nplanes, layers, channels)
    stats: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
    steps: list[float] = []
    energy: list[tuple[float, int]] = []
    for p in range(nplanes):
        per_group = []
        total_sq, total_n = 0.0, 0
        for first, n in spans[p]:
            feats = [transform.group_features(pl[p], first, n).double() for pl in prepared]
            x = torch.cat(feats)
            mean = x.mean(dim=0)
            scale = _group_scale(scales[p], first, n)
            xc = x - mean
            if scale is not None:
                xc = xc * scale
                x = x * scale
            cov = xc.t() @ xc / max(1, x.shape[0])
            lam, vec = torch.linalg.eigh(cov)
            per_group.append((mean, lam.flip(0).clamp_min(0), vec.flip(1)))
            total_sq += float((x * x).sum())
            total_n += x.numel()
        stats.append(per_group)
        energy.append((total_sq, total_n))
        target = rel_errors[min(p, len(rel_errors) - 1) if p != POST_ROPE else 0] ** 2
        target *= total_sq / total_n
        lams = np.concatenate([g[1].numpy() for g in per_group])
        steps.append(_step_for(lams, target * len(lams)))
    if shared_step:
        steps = [_shared_step(stats, energy, rel_errors[0])] * nplanes
    ranks = _ranks(stats, steps, channels, max_basis_bytes)
    planes = []
    for p in range(nplanes):
        groups = []
        for (mean, lam, vec), rank, (first, n) in zip(stats[p], ranks[p], spans[p], strict=True):
            spread = np.sqrt(lam[:rank].numpy()) / steps[p]
            shift, cls = symbols.shifts_and_classes(spread)
            scale = _group_scale(scales[p], first, n)
            groups.append(
                GroupBasis(
                    rank=rank,
                    mean=mean.numpy().astype("<f4").tobytes(),
                    basis=vec[:, :rank].numpy().astype("<f2").tobytes(),
                    shift=shift.tobytes(),
                    cls=cls.tobytes(),
                    scale=b"" if scale is None else scale.numpy().astype("<f4").tobytes(),
                )
            )
        own = sizes[p] if sizes[p] != group else 0
        planes.append(PlaneCalibration(step=steps[p], groups=groups, group=own))
    draft = Calibration(
        version=VERSION,
        layers=layers,
        channels=channels,
        group=group,
        rope_head_dim=0 if rope is None else rope.head_dim,
        rope_theta=0.0 if rope is None else float(rope.theta),
        planes=planes,
        tables=symbols.table_codes(symbols.empty_counts(nplanes)),
        note=note,
    )
    counts = _count_symbols(load_calibration(to_bytes(draft)), prepared, spans)
    final = Calibration(**{**_fields(draft), "tables": symbols.table_codes(counts)})
    return load_calibration(to_bytes(final))


def _shared_step(
    stats: list[list[tuple[Any, Any, Any]]], energy: list[tuple[float, int]], rel_error: float
) -> float:
    """One step for keys and values: their joint error at ``rel_error`` of their joint
    root mean square (the post-RoPE key plane, which codes the same keys, takes it too)."""
    both = range(min(2, len(stats)))
    lams = np.concatenate([g[1].numpy() for p in both for g in stats[p]])
    sq = sum(energy[p][0] for p in both)
    n = sum(energy[p][1] for p in both)
    return _step_for(lams, rel_error**2 * sq / n * len(lams))


def _per_plane(rel_error: float | Sequence[float]) -> list[float]:
    """``[keys, values]`` relative errors (one number: both); post-RoPE keys take the keys'."""
    errors = [rel_error] if isinstance(rel_error, (int, float)) else list(rel_error)
    if not 1 <= len(errors) <= 2 or not all(0 < e < 1 for e in errors):
        raise ValueError("rel_error must be one or two numbers in (0, 1) (keys, values)")
    return [float(e) for e in errors]


def _scales(
    weights: Sequence[np.ndarray[Any, Any] | None] | None, planes: int, layers: int, channels: int
) -> list[np.ndarray[Any, Any] | None]:
    """Per plane: the feature scales ``sqrt(weight)`` as float32 ``[layers, channels]``."""
    if weights is None:
        return [None] * planes
    if len(weights) > planes:
        raise ValueError(f"{len(weights)} weight planes for {planes} calibration planes")
    out: list[np.ndarray[Any, Any] | None] = []
    for p in range(planes):
        w = weights[p] if p < len(weights) else None
        if w is None:
            out.append(None)
            continue
        w = np.asarray(w, np.float64)
        if w.shape != (layers, channels) or not (np.isfinite(w).all() and (w > 0).all()):
            raise ValueError(f"plane {p}'s weights must be positive [{layers}, {channels}]")
        out.append(np.sqrt(w).astype(np.float32))
    return out


def _group_scale(scale: np.ndarray[Any, Any] | None, first: int, count: int) -> Any:
    """A group's feature scales (layer after layer, as ``group_features``), float64 torch
    rounded through float32 (what the calibration stores), or None."""
    import torch

    if scale is None:
        return None
    return torch.from_numpy(scale[first : first + count].reshape(-1).astype(np.float64))


def _fields(cal: Calibration) -> dict[str, Any]:
    return {f: getattr(cal, f) for f in cal.__struct_fields__}


def expected_mse(lams: np.ndarray[Any, Any], step: float) -> float:
    """The expected squared error of components with variances ``lams`` at ``step``."""
    kept = np.sqrt(lams) >= TRUNCATE * step
    return float(np.where(kept, np.minimum(lams, step * step / 12), lams).sum())


def _step_for(lams: np.ndarray[Any, Any], budget: float) -> float:
    """The largest step whose expected error stays within ``budget`` (bisection in log)."""
    top = float(max(lams.max(), 1e-30))
    lo, hi = math.log(1e-9 * math.sqrt(top)), math.log(100 * math.sqrt(top))
    if budget <= 0:
        return math.exp(lo)
    for _ in range(80):
        mid = (lo + hi) / 2
        if expected_mse(lams, math.exp(mid)) <= budget:
            lo = mid
        else:
            hi = mid
    return math.exp(lo)


def _ranks(
    stats: list[list[tuple[Any, Any, Any]]],
    steps: list[float],
    channels: int,
    max_basis_bytes: int | None,
) -> list[list[int]]:
    """Components kept per (plane, group): above ``TRUNCATE`` steps, then within the cap."""
    ranks = [
        [
            g[2].shape[1]
            if p == POST_ROPE
            else int((np.sqrt(g[1].numpy()) >= TRUNCATE * steps[p]).sum())
            for g in stats[p]
        ]
        for p in range(len(stats))
    ]
    if max_basis_bytes is None:
        return ranks
    # Every kept component costs its basis column (float16); drop the weakest first.
    cands = [
        (float(g[1][i]) / steps[p] ** 2, p, j, 2 * g[2].shape[0])
        for p in range(len(stats))
        if p != POST_ROPE
        for j, g in enumerate(stats[p])
        for i in range(ranks[p][j])
    ]
    cands.sort()
    used = sum(c[3] for c in cands)
    for _, p, j, cost in cands:
        if used <= max_basis_bytes:
            break
        ranks[p][j] -= 1  # the weakest of that group is its last kept component
        used -= cost
    return ranks


def _count_symbols(
    loaded: Loaded,
    prepared: list[tuple[torch.Tensor, ...]],
    spans: list[list[tuple[int, int]]],
) -> np.ndarray[Any, Any]:
    import torch

    nplanes = len(loaded.cal.planes)
    counts = symbols.empty_counts(nplanes)
    arrays = loaded.arrays(torch.device("cpu"))
    for p in range(nplanes):
        for j, (first, n) in enumerate(spans[p]):
            dev = arrays[p][j]
            g = loaded.cal.planes[p].groups[j]
            if g.rank == 0:
                continue
            shift = np.frombuffer(g.shift, np.uint8).astype(np.int64)[:, None]
            cls = np.frombuffer(g.cls, np.uint8)
            tid = symbols.table_id(p, cls)[:, None]
            rng = symbols.RANGES[cls][:, None]
            for pl in prepared:
                x = transform.group_features(pl[p], first, n)
                q = transform.coefficients(x, dev).round().numpy().astype(np.int64)
                idx = symbols.symbol_index(q >> shift, rng)
                np.add.at(counts, (np.broadcast_to(tid, idx.shape), idx), 1)
    return counts
