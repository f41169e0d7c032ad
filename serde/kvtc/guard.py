"""Whether a calibration fits a chunk: ``kvtc``'s error on it, found while encoding.

A calibration's bases, means and step were fitted to one model's chunks; on a chunk unlike them
(all zeros, another scale, another model of the same shape) the coded chunk can come back with
an error many times its own size (measured with the tests' calibration: a zero chunk returned
values of norm 105, a chunk scaled by 0.1 an error 3.8 times its norm, random data 1.07). The
encoder therefore measures, per plane, the error the decoder will make, in the calibration's own
metric (the basis is over ``u = s * (x - mean)``, ``s`` the feature scale or ones), against the
energy of the coded tokens in that metric, ``|s * x|^2``. A plane whose error exceeds
``UNLIKE`` of that energy is not coded by the calibration: the codec hands the chunk to
``cachegen``, whose error is bounded relative to the chunk itself.

The error costs no reconstruction. With ``c = basis.T @ u / step`` the coefficients in steps
and ``q`` their rounding, the basis' columns orthonormal::

    |u - basis @ (q * step)|^2 = |u|^2 - step^2 |c|^2 + step^2 |c - q|^2

(what the basis does not span, plus the rounding), two passes over the features and one over
the coefficients. On data like the calibration's the relative error is about the
calibration's target (0.02-0.05 in the README's calibrations; SmolLM2's test texts, 16 chunks,
unweighted and with the model's weights, at most 0.029 at a 0.025 target and 0.054 at 0.05),
``UNLIKE`` 5-10 times that, so only chunks the calibration does not describe go to
``cachegen``. A calibration whose keys and values share one step is judged on both planes
together (``unlike``). One fitted looser than ``UNLIKE`` (a large ``rel_error``, a small
``max_basis_bytes``) would send its own data to ``cachegen``: ``kvgate calibrate`` says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from serde.kvtc.calibration import Device

UNLIKE = 0.25  # relative error (in the calibration's metric) past which a plane is not coded

Array = np.ndarray[Any, Any]


def host_fit(x: Array, c: Array, q: Array, dev: Device) -> tuple[float, float]:
    """``(error^2, energy^2)`` of features ``x`` ``[tokens, F]`` float32 whose coefficients in
    steps are ``c`` ``[rank, tokens]``, rounded to ``q``."""
    # Overflow is an answer here (an infinite sum: ``finite`` says no), not an error.
    with np.errstate(over="ignore", invalid="ignore"):
        sx = x if dev.scale is None else x * dev.scale.numpy()
        smean = dev.mean.numpy() if dev.scale is None else dev.mean.numpy() * dev.scale.numpy()
        energy = _sq(sx)
        u_sq = _sq(sx - smean)
        step2 = dev.step * dev.step
        return max(u_sq - step2 * _sq(c), 0.0) + step2 * _sq(c - q), energy


def torch_fit(x: torch.Tensor, c: torch.Tensor, dev: Device) -> torch.Tensor:
    """``host_fit`` on the tensors' device, as a tensor ``[error^2, energy^2]`` there (one
    copy to the host for all groups, not a synchronisation per sum); ``c`` unrounded."""
    import torch

    sx = x if dev.scale is None else x * dev.scale
    smean = dev.mean if dev.scale is None else dev.mean * dev.scale
    energy = sx.square().sum()
    step2 = dev.step * dev.step
    missed = ((sx - smean).square().sum() - step2 * c.square().sum()).clamp(min=0.0)
    error = missed + step2 * (c - c.round()).square().sum()
    return torch.stack((error, energy))


Fits = Sequence[Sequence[tuple[float, float]]]  # per plane, per group: (error^2, energy^2)


def finite(fits: Fits) -> bool:
    """Whether every sum is finite. float32 sums of finite data can overflow (a bfloat16 chunk
    near 1e22), and a NaN in a group without components reaches no coefficient: such a chunk
    is stored verbatim, not judged."""
    return all(math.isfinite(e) and math.isfinite(f) for plane in fits for e, f in plane)


def unlike(fits: Fits, *, joint: bool) -> bool:
    """Whether the coding error is over ``UNLIKE`` of the energy: of either plane, or with
    ``joint`` of both together. Joint is how a calibration whose keys and values share one
    step was budgeted (a weighted one, ``kvgate calibrate --weights``): the step spends the
    error where the weights are low, and one plane alone may carry most of it (values at 0.10-
    0.15 of their energy, keys at 0.02, on SmolLM2 at ``--rel-error 0.025``)."""
    sums = [(sum(e for e, _ in plane), sum(f for _, f in plane)) for plane in fits]
    if joint:
        sums = [(sum(e for e, _ in sums), sum(f for _, f in sums))]
    return any(error > UNLIKE * UNLIKE * energy for error, energy in sums)


def _sq(a: Array) -> float:
    flat = a.reshape(-1)
    return float(np.dot(flat, flat))
