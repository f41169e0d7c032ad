"""The ``kvtc`` transform on the host, in numpy: what the codec runs for CPU tensors.

Why not torch here: on this project's two shared cores, torch's OpenMP threads and
OpenBLAS's spin between calls and fight the codec's numba threads for the cores; a chunk
took 0.3-7 s instead of 0.05 s (measured, MiniLM's 2.4 MB chunk). So the host path does its
matrix products with BLAS held to one thread (``threadpoolctl``, when installed) and runs the
(plane, group) products on the kernel threads of ``gpu.dispatch`` instead, and its elementwise
work in numpy. The arithmetic is the torch path's (``serde.kvtc.transform``): float32, the
same bases, rounding half to even.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gpu import dispatch
from serde.kvtc import guard
from serde.kvtc.rope import Rope

if TYPE_CHECKING:
    import torch

    from serde.kvtc.calibration import Device

Array = np.ndarray[Any, Any]


@functools.cache
def _blas_controller() -> Any:
    """threadpoolctl's view of the loaded BLAS libraries (found once: finding them walks every
    loaded library, tens of milliseconds), or None without threadpoolctl."""
    try:
        from threadpoolctl import ThreadpoolController  # type: ignore[import-untyped]
    except ModuleNotFoundError:  # pragma: no cover - the codecs extra installs it
        return None
    return ThreadpoolController()


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    controller = _blas_controller()
    if controller is None:  # pragma: no cover
        yield
        return
    with controller.limit(limits=1, user_api="blas"):
        yield


def float32(t: torch.Tensor) -> Array:
    """A float16 / bfloat16 / float32 host tensor (any strides) as a float32 array.

    float16 is widened by torch: numpy's float16 casts have no vector loop (8.5 ms against
    torch's 3.8 for a 5.9 MB SmolLM2 chunk on one core here)."""
    import torch

    if t.dtype == torch.bfloat16:
        bits = t.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16
        out: Array = bits.view(np.float32)
        return out
    if t.dtype == torch.float16:
        wide: Array = t.to(torch.float32).numpy()
        return wide
    return t.numpy().astype(np.float32)


def into_tensor(dst: torch.Tensor, x: Array) -> None:
    """Store float32 ``x`` into ``dst`` (float16, bfloat16 or float32), rounding to nearest
    even: torch's conversion, 3 ms for a 5.9 MB chunk where numpy's ``astype(float16)`` took
    18 ms (no vector loop) and the bfloat16 rounding in numpy several passes."""
    import torch

    dst.copy_(torch.from_numpy(x))


def rotate(k: Array, rope: Rope, first: int, sign: float) -> Array:
    """RoPE (``sign`` 1) or its inverse (-1) on ``k`` ``[layers, tokens, channels]``."""
    layers, tokens, width = k.shape
    half = rope.head_dim // 2
    inv = rope.theta ** (-(np.arange(half, dtype=np.float64) / half))
    ang = np.arange(first, first + tokens, dtype=np.float64)[:, None] * inv[None, :]
    cos = np.cos(ang).astype(np.float32)[:, None, :]
    sin = (sign * np.sin(ang)).astype(np.float32)[:, None, :]
    x = k.reshape(layers, tokens, width // rope.head_dim, 2, half)
    x1, x2 = x[..., 0, :], x[..., 1, :]
    out = np.empty_like(x)
    out[..., 0, :] = x1 * cos - x2 * sin
    out[..., 1, :] = x2 * cos + x1 * sin
    return out.reshape(layers, tokens, width)


def run_groups(jobs: Sequence[Callable[[], None]]) -> None:
    """Run independent jobs on the kernel threads, BLAS single-threaded meanwhile."""
    with single_threaded_blas():
        dispatch.parallel(lambda a, b: [jobs[i]() for i in range(a, b)], len(jobs))


def coefficients(x: Array, dev: Device, out: Array) -> tuple[float, float]:
    """``out`` ``[rank, tokens]`` int32 = round(encode @ x.T - offset), or a ValueError for
    coefficients that are not finite or beyond int32 range. Returns the coding's
    ``(error^2, energy^2)`` in the calibration's metric (``serde.kvtc.guard``)."""
    c = np.matmul(dev.encode.numpy(), x.T)
    c -= dev.offset.numpy()
    q = np.rint(c)
    if q.size and not float(np.abs(q).max()) <= 2.0**30:
        raise ValueError("coefficients out of range")
    out[...] = q
    return guard.host_fit(x, c, q, dev)


def reconstruct(q: Array, dev: Device) -> Array:
    """``[tokens, F]`` float32 from ``[rank, tokens]`` float32 coefficients."""
    x: Array = np.matmul(q.T, dev.decode.numpy())
    x += dev.mean.numpy()
    return x
