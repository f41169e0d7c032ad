"""``bytesplit``: lossless; values split into byte planes, each plane compressed with zstd.

In a float16/bfloat16 KV cache the high byte of every value (sign and exponent) takes few,
very skewed values while the low byte (mantissa) is nearly random. Plain zstd sees them
interleaved and gains little (1.28x on bf16); split into planes, the high plane shrinks about
2.8x and the low one is stored as it is, for ~1.45x on bf16. A value of ``k`` bytes gives ``k``
planes (fp32: 4), 1-byte dtypes and bytes one plane. Blocks of planes are compressed on all
cores and a plane block that does not shrink is stored raw (``serde.blocks``).

Why zstd level 1 with a small hash table (``hash_log=8``) by default: the high plane is a
stream of nearly independent symbols, so it is entropy coding (zstd's Huffman literals) that
pays, not LZ matches. A small match finder finds fewer, mostly useless, matches: it is both
faster and smaller. Measured on the 32 MiB synthetic bf16 chunk, high plane alone, one core:
level 1 2.66x at 0.39 GB/s of plane bytes, level 1 + hash_log 8 2.80x at 1.05 GB/s, level 3
2.31x at 0.19 GB/s. ``hash_log=None`` keeps zstd's table for the level. The whole codec on that
chunk, both cores: 1.48x, encode ~1.4 GB/s, decode ~2.6 GB/s (plain zstd level 3: 1.28x at
~0.7 GB/s both ways); splitting is done with word shifts, not strided byte copies (4x faster).

Options: ``level`` (zstd, -7..22, default 1), ``hash_log`` (6..26 or None, default 8),
``block_size`` (raw bytes per block, default 4 MiB). The frame records ``{"block", "planes"}``;
zstd frames describe themselves, so decoding needs no level.
"""

from __future__ import annotations

import threading
from typing import Any

from gateway.errors import ConfigError, CorruptObject, MissingDependency
from gateway.frame import FrameInfo
from gateway.objects import ITEMSIZE, ObjectData
from gateway.types import Buffer, BufferParts, ParamValue
from serde.blocks import check_block_size, decode_blocks, encode_blocks

try:
    import zstandard
except ModuleNotFoundError as exc:  # pragma: no cover - the zstd extra installs it
    raise MissingDependency(
        "codec 'bytesplit' needs zstandard: pip install 'kvgate[zstd]'"
    ) from exc

DEFAULT_BLOCK = 4 << 20
DEFAULT_LEVEL = 1
DEFAULT_HASH_LOG = 8
# A zstd frame expands at most 32768x: a block regenerates at most 128 KiB and takes at least
# 4 bytes (an RLE block: 3-byte header + 1 byte). Measured: 32483x on 64 MiB of zeros.
MAX_RATIO = 32768

# zstd contexts are not thread-safe and cost a little to build: one per thread and setting.
_local = threading.local()
KEPT_COMPRESSORS = 4  # zstd contexts a thread keeps, one per setting (the oldest dropped)


def planes_of(dtype: str) -> int:
    """Byte planes for an item of ``dtype`` (one per byte; one for unknown dtypes)."""
    return ITEMSIZE.get(dtype, 1)


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    # Real ints only (not bool, 1.0 or numpy integers), returned as plain ints.
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(
            f"codec bytesplit: {name} must be an integer in {low}..{high}, got {value!r}"
        )
    return int(value)


# What keeps this codec's work on the event loop below ``gateway.tiers.OFFLOAD_BYTES``
# (``inline_ok``). Encode of 4 MiB - 128 B, ms, best of 3, 2-core dev machine: level 1-3 with
# blocks of 64 KiB or more 0.7-18 (uint8 in 0..3 the worst), level 5 42, level 9 52, level 19
# 2500; 4 KiB blocks 32-50 at level 1 (the per-piece cost). Decoding does not depend on the
# level: 2-13 ms, 20-32 ms for frames of 4 KiB blocks.
INLINE_MAX_LEVEL = 3
INLINE_MIN_BLOCK = 64 << 10


class BytesplitCodec:
    name = "bytesplit"
    lossless = True
    client_options = frozenset({"level", "hash_log", "block_size"})  # what HTTP clients may set
    inline_ok: bool  # cheap enough for the event loop below OFFLOAD_BYTES (gateway.tiers)

    def __init__(
        self,
        level: int = DEFAULT_LEVEL,
        hash_log: int | None = DEFAULT_HASH_LOG,
        block_size: int = DEFAULT_BLOCK,
        **options: Any,
    ) -> None:
        if options:
            raise ConfigError(f"codec bytesplit: unknown options {', '.join(sorted(options))}")
        self.level = _check_int("level", level, -7, 22)
        self.hash_log = None if hash_log is None else _check_int("hash_log", hash_log, 6, 26)
        try:
            self.block_size = check_block_size("bytesplit", block_size)
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        self.inline_ok = self.level <= INLINE_MAX_LEVEL and self.block_size >= INLINE_MIN_BLOCK

    def _compressor(self) -> Any:
        key = (self.level, self.hash_log, self.block_size)
        cache: dict[tuple[int, int | None, int], Any] = _local.__dict__.setdefault("cctx", {})
        cctx = cache.pop(key, None)
        if cctx is not None:
            cache[key] = cctx  # the most recently used last: dropped last
        else:
            extra = {} if self.hash_log is None else {"hash_log": self.hash_log}
            params = zstandard.ZstdCompressionParameters.from_level(
                self.level, source_size=self.block_size, write_content_size=True, **extra
            )
            # Settings come from configs and from HTTP clients, and a context of a large
            # hash_log holds ~13 MiB: a thread keeps the few it used last, not one per setting.
            while len(cache) >= KEPT_COMPRESSORS:
                del cache[next(iter(cache))]
            cctx = cache[key] = zstandard.ZstdCompressor(compression_params=params)
        return cctx

    def _compress(self, piece: memoryview) -> Buffer:
        return self._compressor().compress(piece)  # type: ignore[no-any-return]

    def encode(self, obj: ObjectData) -> tuple[BufferParts, dict[str, ParamValue]]:
        planes = planes_of(obj.meta.dtype)
        payload = encode_blocks(obj.host(), planes, self.block_size, self._compress)
        return payload, {"block": self.block_size, "planes": planes}

    def decode(self, payload: memoryview, info: FrameInfo, out: memoryview | None) -> Buffer:
        return decode_blocks(payload, info, _decompress, out, MAX_RATIO, _declared)


def _declared(piece: memoryview) -> int:
    """The content size a zstd piece declares (-1 when it has none: the encoder always writes
    it, so such a piece is refused)."""
    try:
        size = int(zstandard.get_frame_parameters(piece).content_size)
    except zstandard.ZstdError as exc:
        raise CorruptObject(f"bytesplit piece is not a zstd frame: {exc}") from None
    return -1 if size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR) else size


def _decompress(piece: memoryview, size: int) -> Buffer:
    dctx = _local.__dict__.get("dctx")
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    try:
        # decode_blocks has checked the size the piece declares (``_declared``), and
        # ``max_output_size`` caps what zstd may allocate whatever the frame says.
        return dctx.decompress(piece, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptObject(f"bytesplit piece does not decompress: {exc}") from None
