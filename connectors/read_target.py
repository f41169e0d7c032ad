"""The buffer one read of an object fills, for the object-store connectors.

The size comes from the first response's headers; the buffer comes from the caller's ``alloc``
(a pool slab) once, else it is one of the connector's own.
"""

from __future__ import annotations

from gateway.connector import Allocator


class ReadTarget:
    """The buffer a read fills: from ``alloc`` once, else a new one of its own.

    A read that starts again after an overwrite reuses the buffer when the size is the same.
    When it is not, a buffer ``alloc`` gave cannot be traded for another (the caller holds it
    as the result): the read is then a miss.
    """

    def __init__(self, alloc: Allocator) -> None:
        self.alloc = alloc
        self.buf: memoryview | None = None
        self.from_alloc = False

    def get(self, size: int) -> memoryview | None:
        if self.buf is not None:
            if self.buf.nbytes == size:
                return self.buf
            if self.from_alloc:
                return None
        given = self.alloc(size) if self.buf is None else None
        if given is not None:
            if given.nbytes != size:
                raise ValueError(f"alloc({size}) gave {given.nbytes} bytes")
            self.buf = given.cast("B") if given.format != "B" else given
            self.from_alloc = True
        else:
            # A bytearray, not numpy.empty: numpy asks for transparent huge pages on large
            # arrays, and faulting those in while bodies stream in stalled reads here.
            self.buf = memoryview(bytearray(size))
        return self.buf
