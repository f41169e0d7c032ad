"""cupy launches on torch's current CUDA stream, so kernels order with torch's own work."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class _StreamHandle:
    """A raw ``cudaStream_t`` behind the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def torch_stream_for_cupy(device: torch.device) -> Any:
    """torch's current stream on ``device`` as a cupy stream (usable as a context manager).

    cupy 14 deprecates ``ExternalStream`` (a DeprecationWarning on every launch) in favour of
    ``Stream.from_external``; cupy 13 has only the former.
    """
    import cupy
    import torch

    ptr = torch.cuda.current_stream(device).cuda_stream
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, device.index if device.index is not None else -1)
