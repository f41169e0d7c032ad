"""Block-parallel lossless compression with byte planes: what ``lz4`` and ``bytesplit`` share.

The object's raw bytes are cut into blocks of ``block_size`` bytes (the last one shorter), and
each block into ``planes`` byte planes: plane ``j`` holds byte ``planes - 1 - j`` of every item,
so for little-endian values the most significant bytes (sign and exponent, very skewed) come
first and the noisy low bytes last. With one plane a block is just its bytes. Each plane of each
block (a *piece*) is compressed independently, so both cores work on one object: lz4 and zstd
release the GIL, and the pieces run on the kernel threads of ``gpu.dispatch``.

Payload (little-endian)::

    table   u32 stored size of every piece, block by block, plane by plane
    pieces  the stored pieces, in table order

Nothing else is stored: the number of blocks and each piece's raw size follow from the frame's
``raw_len`` and the ``block``/``planes`` params. A piece whose stored size equals its raw size is
stored raw (a piece that does not shrink by at least 1/64 is not worth decompressing; random low
mantissa bytes cost a memcpy), any smaller size is compressed. Decoding checks the whole table
against those raw sizes and the payload length before it allocates or decompresses anything, so
a hostile table (a size above its piece, truncated or trailing bytes) is a ``CorruptObject``
and the output is never larger than ``raw_len``. So is a ``raw_len`` the payload cannot hold:
every compressed piece must be able to expand to its raw size (at most LZ4's 255x or zstd's
32768x, and zstd pieces must declare exactly that size), checked on the headers before the
output is allocated, so 5 KiB cannot make the decoder allocate a terabyte.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from gateway.errors import CorruptObject
from gateway.frame import FrameInfo
from gateway.types import Buffer
from gpu.dispatch import cpu_workers, run_chunks
from serde.tensors import param_int

T = TypeVar("T")

MIN_BLOCK = 4 << 10
MAX_BLOCK = 1 << 30  # stored sizes are u32
MAX_PLANES = 16
TABLE_DTYPE = np.dtype("<u4")
# Plane j is byte ``planes - 1 - j`` of each item in memory: little-endian words of that width.
_WORDS: dict[int, np.dtype[Any]] = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}

Compress = Callable[[memoryview], Buffer]
"""Compress one piece (called on any kernel thread)."""
Decompress = Callable[[memoryview, int], Buffer]
"""Decompress one piece to exactly the given number of bytes, or raise ``CorruptObject``."""
Declared = Callable[[memoryview], int]
"""The raw size a compressed piece declares in its header (``CorruptObject`` if unreadable)."""


def check_block_size(codec: str, block_size: int) -> int:
    """The ``block_size`` option, validated (a ``ValueError`` message for ``ConfigError``)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"codec {codec}: block_size must be an integer, got {block_size!r}")
    if not MIN_BLOCK <= block_size <= MAX_BLOCK:
        raise ValueError(f"codec {codec}: block_size must be in {MIN_BLOCK}..{MAX_BLOCK}")
    return int(block_size)  # a plain int (an int subclass would reach the frame's params)


def block_params(info: FrameInfo) -> tuple[int, int]:
    """``(block_size, planes)`` from a frame, range-checked against its ``raw_len``."""
    block_size = param_int(info, "block", MIN_BLOCK, MAX_BLOCK)
    planes = param_int(info, "planes", 1, MAX_PLANES) if "planes" in info.params else 1
    if planes & (planes - 1) or info.raw_len % planes:
        raise CorruptObject(f"{info.codec} frame: {planes} planes do not divide {info.raw_len}")
    return block_size, planes


def run_blocks(fn: Callable[[int], T], n: int) -> list[T]:
    """``[fn(i) for i in range(n)]`` on all kernel threads, each taking the next index free.

    Pieces differ a lot in cost (a compressible plane vs. a raw one), so indices are handed
    out one at a time instead of in fixed ranges. Every worker finishes before this returns,
    even when one fails, so no thread still writes into a caller's buffer after an error.
    """
    results: list[Any] = [None] * n
    errors: list[BaseException] = []
    lock = threading.Lock()
    next_index = iter(range(n))

    def worker(_start: int, _end: int) -> None:
        while True:
            with lock:
                i = next(next_index, n) if not errors else n
            if i >= n:
                return
            try:
                results[i] = fn(i)
            except BaseException as exc:  # re-raised in the caller's thread below
                with lock:
                    errors.append(exc)

    workers = min(cpu_workers(), n)
    run_chunks(worker, [(w, w + 1) for w in range(workers)])
    if errors:
        raise errors[0]
    return results


def _layout(raw_len: int, planes: int, block_size: int) -> tuple[int, int, int]:
    """Items per block, number of blocks and item count."""
    items = raw_len // planes
    per_block = max(1, block_size // planes)
    return per_block, -(-items // per_block), items


def _piece_sizes(raw_len: int, planes: int, block_size: int) -> np.ndarray[Any, Any]:
    """The raw size of every piece, in table order (an item count per plane)."""
    per_block, blocks, items = _layout(raw_len, planes, block_size)
    sizes = np.full(blocks, per_block, dtype=np.int64)
    if blocks:
        sizes[-1] = items - per_block * (blocks - 1)
    return np.repeat(sizes, planes)


def split_planes(chunk: np.ndarray[Any, Any], planes: int) -> list[memoryview]:
    """The byte planes of ``chunk`` (uint8, whole items), most significant byte first."""
    if planes == 1:
        return [chunk.data]
    out = [np.empty(chunk.size // planes, dtype=np.uint8) for _ in range(planes)]
    if planes in _WORDS:
        # Shifting whole words is several times faster than strided byte copies.
        words = chunk.view(_WORDS[planes])
        for j, plane in enumerate(out):
            shift = 8 * (planes - 1 - j)
            if shift:
                np.right_shift(words, shift, out=plane, casting="unsafe")
            else:
                np.copyto(plane, words, casting="unsafe")
    else:
        rows = chunk.reshape(-1, planes)
        for j, plane in enumerate(out):
            np.copyto(plane, rows[:, planes - 1 - j])
    return [plane.data for plane in out]


def merge_planes(chunk: np.ndarray[Any, Any], pieces: list[Buffer]) -> None:
    """Write byte planes (most significant first) back into ``chunk`` as whole items."""
    planes = len(pieces)
    arrays = [np.frombuffer(p, dtype=np.uint8) for p in pieces]
    if planes in (2, 4):  # word shifts win for 2 and 4 planes, strided copies for 8
        words = chunk.view(_WORDS[planes])
        np.copyto(words, arrays[0], casting="unsafe")
        for plane in arrays[1:]:
            np.left_shift(words, 8, out=words)
            np.bitwise_or(words, plane, out=words)
        return
    rows = chunk.reshape(-1, planes)
    for j, plane in enumerate(arrays):
        rows[:, planes - 1 - j] = plane


def encode_blocks(
    data: memoryview, planes: int, block_size: int, compress: Compress
) -> list[Buffer]:
    """The payload of ``data`` (``table`` then pieces) as a scatter list.

    Raw pieces of a one-plane object are views of ``data`` (no copy).
    """
    src = np.frombuffer(data, dtype=np.uint8)
    per_block, blocks, _ = _layout(src.size, planes, block_size)

    def one_block(b: int) -> list[Buffer]:
        chunk = src[b * per_block * planes : (b + 1) * per_block * planes]
        out: list[Buffer] = []
        for raw in split_planes(chunk, planes):
            packed = compress(raw)
            keep = len(packed) < raw.nbytes - raw.nbytes // 64
            out.append(packed if keep else raw)
        return out

    pieces = [p for block in run_blocks(one_block, blocks) for p in block]
    table = np.array([memoryview(p).nbytes for p in pieces], dtype=TABLE_DTYPE)
    return [table.tobytes(), *pieces]


def check_expansion(
    codec: str,
    view: memoryview,
    starts: np.ndarray[Any, Any],
    ends: np.ndarray[Any, Any],
    raw_sizes: np.ndarray[Any, Any],
    max_ratio: int,
    declared: Declared | None,
) -> None:
    """Refuse compressed pieces (``view[starts[i]:ends[i]]`` shorter than ``raw_sizes[i]``)
    that cannot decompress to their raw size: more than ``max_ratio`` times their stored size
    (the format's limit), or another size than their header declares. Headers only: cheap."""
    stored = ends - starts
    packed = stored != raw_sizes
    if np.any(raw_sizes[packed] > stored[packed] * max_ratio):
        raise CorruptObject(f"{codec} piece claims more than its format can expand to")
    if declared is None:
        return
    for i in np.flatnonzero(packed):
        size = declared(view[int(starts[i]) : int(ends[i])])
        if size != raw_sizes[i]:
            raise CorruptObject(f"{codec} piece declares {size} bytes, not {raw_sizes[i]}")


def decode_blocks(
    payload: memoryview,
    info: FrameInfo,
    decompress: Decompress,
    out: memoryview | None,
    max_ratio: int,
    declared: Declared | None = None,
) -> Buffer:
    """The ``info.raw_len`` raw bytes of a payload written by ``encode_blocks``.

    ``max_ratio`` is the most a piece of the format can expand (raw / stored bytes) and
    ``declared`` reads a piece's own size claim: both are checked for every piece before the
    output is allocated, so a small hostile payload cannot claim a huge ``raw_len``.
    """
    block_size, planes = block_params(info)
    raw_len = info.raw_len
    view = memoryview(payload).cast("B")
    per_block, blocks, _ = _layout(raw_len, planes, block_size)
    n_pieces = blocks * planes
    table_len = n_pieces * TABLE_DTYPE.itemsize
    if view.nbytes < table_len:
        raise CorruptObject(f"{info.codec} payload is truncated (block table)")
    stored = np.frombuffer(view[:table_len], dtype=TABLE_DTYPE).astype(np.int64)
    raw_sizes = _piece_sizes(raw_len, planes, block_size)
    if np.any(stored > raw_sizes):
        raise CorruptObject(f"{info.codec} block table claims a piece larger than its block")
    ends = table_len + np.cumsum(stored)
    if (int(ends[-1]) if n_pieces else table_len) != view.nbytes:
        raise CorruptObject(f"{info.codec} payload length does not match its block table")
    starts = ends - stored
    check_expansion(info.codec, view, starts, ends, raw_sizes, max_ratio, declared)
    if out is not None:
        dst = np.frombuffer(out, dtype=np.uint8)
    else:
        try:
            dst = np.empty(raw_len, np.uint8)
        except MemoryError:  # the checks above bound it by the payload: treat it as corrupt
            raise CorruptObject(f"{info.codec} frame claims {raw_len} bytes") from None
    if dst.size != raw_len:
        raise ValueError(f"output buffer is {dst.size} bytes, expected {raw_len}")

    def piece(i: int) -> Buffer:
        body = view[int(starts[i]) : int(ends[i])]
        size = int(raw_sizes[i])
        if body.nbytes == size:
            return body
        got = decompress(body, size)
        if memoryview(got).nbytes != size:
            raise CorruptObject(f"{info.codec} piece decompressed to the wrong size")
        return got

    def one_block(b: int) -> None:
        chunk = dst[b * per_block * planes : (b + 1) * per_block * planes]
        merge_planes(chunk, [piece(b * planes + j) for j in range(planes)])

    run_blocks(one_block, blocks)
    return out if out is not None else dst.data
