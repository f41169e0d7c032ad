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
the coefficients. On data like the calibration's the relative error is the calibration's
target (0.02-0.05 in the README's calibrations): ``UNLIKE`` is 5-10 times that, so only chunks
the calibration does not describe go to ``cachegen``.
"""

from __future__ import annotations

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


def unlike(fits: list[tuple[float, float]]) -> bool:
    """Whether the summed ``(error^2, energy^2)`` of a plane's groups is over ``UNLIKE``."""
    error = sum(f[0] for f in fits)
    energy = sum(f[1] for f in fits)
    return error > UNLIKE * UNLIKE * energy


def _sq(a: Array) -> float:
    flat = a.reshape(-1)
    return float(np.dot(flat, flat))
