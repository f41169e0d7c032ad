"""What lossy codecs share: which objects they may quantize, how decoded tensors are returned,
and a bounds-checked reader for their payload sections.

A lossy codec quantizes only floating-point tensors and arrays (float16, bfloat16, float32).
Anything else (bytes, integer or fp8 tensors) is stored verbatim and recorded in the frame as
``{"mode": "raw"}``, so putting any object through any codec is safe and exact where it cannot
be approximated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.errors import CorruptObject
from gateway.frame import FrameInfo
from gateway.objects import ObjectData, torch_dtype
from gateway.types import Buffer, BufferParts, ParamValue
from serde.raw import decode_raw

if TYPE_CHECKING:
    import torch

QUANTIZABLE = ("float16", "bfloat16", "float32")
RAW_MODE: dict[str, ParamValue] = {"mode": "raw"}


def float_tensor(obj: ObjectData) -> torch.Tensor | None:
    """The object as a torch tensor (on its own device) when a lossy codec may quantize it.

    A tensor queued by the store arrives as host bytes (a pool slab) without the tensor
    object; it is viewed in place, not copied (read-only bytes are copied, since torch cannot
    wrap them).
    """
    if obj.meta.dtype not in QUANTIZABLE or obj.meta.nbytes == 0:
        return None
    if obj.meta.kind not in ("tensor", "ndarray"):
        return None
    if obj.tensor is not None:
        return obj.tensor.detach()  # type: ignore[no-any-return]
    import torch

    host = obj.host()
    raw = np.frombuffer(host, dtype=np.uint8)
    if host.readonly:
        raw = raw.copy()
    return torch.from_numpy(raw).view(torch_dtype(obj.meta.dtype)).reshape(obj.meta.shape)


def raw_encode(obj: ObjectData) -> tuple[BufferParts, dict[str, ParamValue]]:
    return obj.host(), dict(RAW_MODE)


def is_raw(info: FrameInfo) -> bool:
    return info.params.get("mode") == "raw"


raw_decode = decode_raw  # the raw codec's own decoder


def check_decodable(info: FrameInfo) -> None:
    """Refuse frames a lossy codec cannot have written (a hostile or mismatched header)."""
    if info.dtype not in QUANTIZABLE:
        raise CorruptObject(f"{info.codec} frame with non-float dtype {info.dtype}")


def tensor_bytes(t: torch.Tensor, out: memoryview | None) -> Buffer:
    """A decoded host tensor (stored dtype and shape) as raw bytes, written into ``out``."""
    import torch

    flat = t.contiguous().reshape(-1).view(torch.uint8)
    if out is None:
        return flat.numpy().data.cast("B")
    torch.from_numpy(np.frombuffer(out, dtype=np.uint8)).copy_(flat)
    return out


def host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a (possibly device) uint8-viewable tensor, on the host."""
    import torch

    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().data.cast("B")


def param_int(info: FrameInfo, name: str, low: int, high: int) -> int:
    """An integer parameter from the frame, range-checked (a hostile header is corrupt)."""
    value = info.params.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise CorruptObject(f"{info.codec} frame has a bad {name!r} parameter: {value!r}")
    return value


class PayloadReader:
    """Consecutive sections of a payload; running short or leaving bytes over is corrupt."""

    def __init__(self, payload: Buffer, codec: str) -> None:
        self.view = memoryview(payload).cast("B")
        self.pos = 0
        self.codec = codec

    def take(self, nbytes: int) -> memoryview:
        end = self.pos + nbytes
        if nbytes < 0 or end > self.view.nbytes:
            raise CorruptObject(f"{self.codec} payload is truncated")
        section = self.view[self.pos : end]
        self.pos = end
        return section

    def array(self, dtype: Any, count: int) -> np.ndarray[Any, Any]:
        """``count`` items of ``dtype`` (a read-only view, no copy)."""
        dt = np.dtype(dtype)
        return np.frombuffer(self.take(dt.itemsize * count), dtype=dt)

    def tensor(self, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A writable host tensor of ``dtype`` (copied: payload views are read-only)."""
        import torch

        count = int(np.prod(shape)) if shape else 1
        td = torch_dtype(dtype)
        itemsize = torch.empty((), dtype=td).element_size()
        raw = np.frombuffer(self.take(itemsize * count), dtype=np.uint8).copy()
        return torch.from_numpy(raw).view(td).reshape(shape)

    def finish(self) -> None:
        if self.pos != self.view.nbytes:
            raise CorruptObject(
                f"{self.codec} payload has {self.view.nbytes - self.pos} trailing bytes"
            )
