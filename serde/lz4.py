"""``lz4``: lossless LZ4 block compression, cut into blocks compressed on all cores.

LZ4 is the codec for speed: it gains little on float KV cache (mantissas look random) but a lot
on integer tensors, token ids and padded buffers, at several GB/s. The object is cut into
``block_size`` blocks (4 MiB by default) compressed concurrently (lz4 releases the GIL); a block
that does not shrink is stored raw. The payload is a block table plus the blocks
(``serde.blocks``); the frame records ``{"block": block_size}``.

Options: ``acceleration`` (1 = LZ4's default; higher is faster and compresses less, up to
65537) and ``block_size`` (4 KiB..1 GiB).
"""

from __future__ import annotations

from typing import Any

from gateway.errors import ConfigError, CorruptObject, MissingDependency
from gateway.frame import FrameInfo
from gateway.objects import ObjectData
from gateway.types import Buffer, BufferParts, ParamValue
from serde.blocks import check_block_size, decode_blocks, encode_blocks

try:
    import lz4.block
except ModuleNotFoundError as exc:  # pragma: no cover - the lz4 extra installs it
    raise MissingDependency("codec 'lz4' needs lz4: pip install 'kvgate[lz4]'") from exc

MAX_ACCELERATION = 65537  # LZ4_ACCELERATION_MAX
DEFAULT_BLOCK = 4 << 20
# An LZ4 block expands at most 255x: past the first bytes of a match, every input byte adds
# at most 255 to its length (measured: 254.99x on 64 MiB of zeros).
MAX_RATIO = 255


class Lz4Codec:
    name = "lz4"
    lossless = True
    client_options = frozenset({"acceleration", "block_size"})  # what HTTP clients may set
    # Cheap enough for the event loop below OFFLOAD_BYTES (gateway.tiers) at every setting:
    # 4 MiB - 128 B took at most 14 ms to encode and 12 ms to decode (uint8 in 0..3, 4 KiB
    # blocks, the worst tried; fp16 at the defaults: 0.5 and 0.1 ms), as much as zstd's
    # default level; a higher acceleration is only faster.
    inline_ok = True

    def __init__(
        self, acceleration: int = 1, block_size: int = DEFAULT_BLOCK, **options: Any
    ) -> None:
        if options:
            raise ConfigError(f"codec lz4: unknown options {', '.join(sorted(options))}")
        if (
            isinstance(acceleration, bool)
            or not isinstance(acceleration, int)
            or not 1 <= acceleration <= MAX_ACCELERATION
        ):
            raise ConfigError(
                f"codec lz4: acceleration must be an integer in 1..{MAX_ACCELERATION}, "
                f"got {acceleration!r}"
            )
        try:
            self.block_size = check_block_size("lz4", block_size)
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        self.acceleration = int(acceleration)

    def _compress(self, piece: memoryview) -> Buffer:
        return lz4.block.compress(  # type: ignore[no-any-return]
            piece, mode="fast", acceleration=self.acceleration, store_size=False
        )

    def encode(self, obj: ObjectData) -> tuple[BufferParts, dict[str, ParamValue]]:
        payload = encode_blocks(obj.host(), 1, self.block_size, self._compress)
        return payload, {"block": self.block_size}

    def decode(self, payload: memoryview, info: FrameInfo, out: memoryview | None) -> Buffer:
        return decode_blocks(payload, info, _decompress, out, MAX_RATIO)


def _decompress(piece: memoryview, size: int) -> Buffer:
    # ``uncompressed_size`` is the exact size the table allows, so a hostile block cannot make
    # lz4 allocate more; it may decode to fewer bytes, which decode_blocks rejects.
    try:
        return lz4.block.decompress(piece, uncompressed_size=size)  # type: ignore[no-any-return]
    except lz4.block.LZ4BlockError as exc:
        raise CorruptObject(f"lz4 block does not decompress: {exc}") from None
