"""Small value types shared by the contracts. No logic beyond trivial helpers."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias, get_args

Buffer: TypeAlias = bytes | bytearray | memoryview
"""Anything a connector accepts or returns as object bytes."""

BufferParts: TypeAlias = Buffer | Sequence[Buffer]
"""One buffer, or a scatter list whose concatenation is the object (written without joining)."""

ParamScalar: TypeAlias = int | float | str | bool | None
ParamValue: TypeAlias = ParamScalar | list[int | float | str | bool]
"""A codec parameter recorded in the frame header."""

ObjectKind = Literal["tensor", "ndarray", "bytes", "bytearray", "memoryview"]
"""What kind of Python object a user stored; ``get`` returns the same kind."""
OBJECT_KINDS: tuple[ObjectKind, ...] = get_args(ObjectKind)
BYTE_KINDS: tuple[ObjectKind, ...] = ("bytes", "bytearray", "memoryview")
"""The kinds that are plain bytes: 1-D uint8, all "bytes" over HTTP."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a connector can do, as data: the core and the tests read this, never names.

    ``max_object_size`` is in bytes (None = no limit the connector knows of). ``zero_copy``
    means ``get_into`` reads straight into a caller's buffer instead of copying from ``get``.
    ``persistent`` means objects survive a restart of the process (and of the Store).
    ``batch`` means ``exists_many`` answers many keys in one round trip (a pipeline, a batch
    call, an index in memory), not one request per key: ``Store.lookup`` then asks such a tier
    about all remaining keys once its first window is all there.
    """

    batch: bool = False
    list: bool = False
    ttl: bool = False
    zero_copy: bool = False
    persistent: bool = False
    stores_data: bool = True
    max_object_size: int | None = None
    max_key_length: int | None = None


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """A listed object: its key and stored size in bytes."""

    key: str
    size: int


@dataclass(slots=True)
class LatencyHistogram:
    """Cumulative-bucket latency histogram in seconds (Prometheus style)."""

    bounds: tuple[float, ...] = (
        0.0001,
        0.00025,
        0.0005,
        0.001,
        0.0025,
        0.005,
        0.01,
        0.025,
        0.05,
        0.1,
        0.25,
        0.5,
        1.0,
        2.5,
        5.0,
        10.0,
    )
    counts: list[int] = field(default_factory=lambda: [0] * 17)
    total: float = 0.0
    n: int = 0

    def observe(self, seconds: float) -> None:
        i = 0
        for i, bound in enumerate(self.bounds):  # noqa: B007 - i is used after the loop
            if seconds <= bound:
                break
        else:
            i = len(self.bounds)
        self.counts[i] += 1
        self.total += seconds
        self.n += 1

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile ``q`` (0 when empty)."""
        if self.n == 0:
            return 0.0
        target = q * self.n
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= target and c:
                return self.bounds[i] if i < len(self.bounds) else float("inf")
        return float("inf")


@dataclass(slots=True)
class TierStats:
    """Per-tier counters; the metrics layer and the store update them."""

    name: str
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    corrupt: int = 0
    skipped_writes: int = 0
    evictions: int = 0
    queue_depth: int = 0
    latency: dict[str, LatencyHistogram] = field(default_factory=dict)

    def count_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def observe(self, op: str, seconds: float) -> None:
        hist = self.latency.get(op)
        if hist is None:
            hist = self.latency[op] = LatencyHistogram()
        hist.observe(seconds)


class MemoryFormat(enum.IntEnum):
    """LMCache's KV memory formats; the values travel on the wire and in frame headers."""

    UNDEFINED = 0
    KV_2LTD = 1  # [2, layers, tokens, hidden]
    KV_T2D = 2  # [tokens, 2, hidden]
    KV_2TD = 3  # [2, tokens, hidden]
    BINARY = 4
    BINARY_BUFFER = 5
    KV_MLA_FMT = 6  # [1, layers, tokens, aligned_head_size]
    EC_TD = 7
    HS_TD = 8
