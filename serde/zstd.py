"""``zstd``: lossless Zstandard compression of the object's bytes.

The compressed payload records the content size; decoding checks it against the frame's
``raw_len`` first and refuses truncated payloads or trailing bytes.
"""

from __future__ import annotations

import os
from typing import Any

from gateway.errors import ConfigError, CorruptObject, MissingDependency
from gateway.frame import FrameInfo
from gateway.objects import ObjectData
from gateway.types import Buffer, BufferParts, ParamValue

try:
    import zstandard
except ModuleNotFoundError as exc:  # pragma: no cover - the test extra installs it
    raise MissingDependency("codec 'zstd' needs zstandard: pip install 'kvgate[zstd]'") from exc


# The highest level at which this codec's work runs on the event loop for objects under
# ``gateway.tiers.OFFLOAD_BYTES`` (``inline_ok``; higher levels always go to a thread). Encode
# time of a 4 MiB - 128 B object, ms, best of 3, on the 2-core dev machine (zstandard 0.25):
#
#   level              -7     1     3     5     9    12    15    19    22
#   fp16 randn        0.7   4.3   6.0   5.7   8.1    37   107   762   689
#   int32 token ids   1.9   4.4    26    41    80   323
#   uint8 in 0..3      14    15    18    40   106
#
# Decoding costs the same at every level (~4 ms). Level 3, the default, stays inline as before;
# from 5 on, integer data costs several times more, and 19-22 cost most of a second.
INLINE_MAX_LEVEL = 3


class ZstdCodec:
    name = "zstd"
    lossless = True
    client_options = frozenset({"level", "threads"})  # what HTTP clients may set
    inline_ok: bool  # cheap enough for the event loop below OFFLOAD_BYTES (gateway.tiers)

    def __init__(self, level: int = 3, threads: int = 0, **options: Any) -> None:
        if options:
            raise ConfigError(f"codec zstd: unknown options {', '.join(sorted(options))}")
        if not _is_int(level) or not -7 <= level <= 22:
            raise ConfigError(f"codec zstd: level must be in -7..22 (an integer), got {level!r}")
        # Bounded by the CPUs (-1: all of them): the options may come from an HTTP client,
        # who must not make the server start thousands of threads per request.
        most = os.cpu_count() or 1
        if not _is_int(threads) or not -1 <= threads <= most:
            raise ConfigError(
                f"codec zstd: threads must be an integer in -1..{most} (-1: every CPU), "
                f"got {threads!r}"
            )
        self.level = level
        self.threads = threads
        self.inline_ok = level <= INLINE_MAX_LEVEL

    def encode(self, obj: ObjectData) -> tuple[BufferParts, dict[str, ParamValue]]:
        cctx = zstandard.ZstdCompressor(level=self.level, threads=self.threads)
        return cctx.compress(obj.host()), {"level": self.level}

    def decode(self, payload: memoryview, info: FrameInfo, out: memoryview | None) -> Buffer:
        try:
            # The declared size is checked before decompressing, so a crafted payload cannot
            # make us allocate more than the frame header promised.
            declared = zstandard.get_frame_parameters(payload).content_size
            if declared != info.raw_len:
                raise CorruptObject(f"zstd payload declares {declared} bytes, not {info.raw_len}")
            dobj = zstandard.ZstdDecompressor().decompressobj()
            data = dobj.decompress(payload)
        except zstandard.ZstdError as exc:
            raise CorruptObject(f"zstd payload does not decompress: {exc}") from None
        if not dobj.eof or dobj.unused_data:
            raise CorruptObject("zstd payload is truncated or has trailing bytes")
        if len(data) != info.raw_len:
            raise CorruptObject(f"zstd payload gave {len(data)} bytes, expected {info.raw_len}")
        if out is None:
            return data
        out[:] = data
        return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
