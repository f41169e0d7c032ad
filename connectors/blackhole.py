"""``blackhole://`` — accepts every object and keeps none (for benchmarks of the layers above).

A put costs only the bookkeeping of its length, so a benchmark through this connector measures
the store, codecs and layers without any backend. Every read is a miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Self

from connectors._options import StrictOptions, parse_options, split_url
from gateway.connector import BaseConnector, parts_len
from gateway.errors import ConfigError
from gateway.types import Buffer, BufferParts, Capabilities


class BlackholeOptions(StrictOptions):
    """No options: any given option is a mistake worth reporting."""


class BlackholeConnector(BaseConnector):
    scheme: ClassVar[str] = "blackhole"
    capabilities = Capabilities(stores_data=False)

    def __init__(self) -> None:
        self.bytes_discarded = 0
        """Total length of every object put so far."""
        self.puts = 0

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        parts = split_url(url, cls.scheme)
        if parts.netloc or parts.path:
            raise ConfigError(f"{url!r}: blackhole:// takes no host or path")
        parse_options(BlackholeOptions, url, options)
        return cls()

    async def get(self, key: str) -> Buffer | None:
        return None

    async def put(self, key: str, data: BufferParts) -> None:
        self.bytes_discarded += parts_len(data)
        self.puts += 1

    async def exists(self, key: str) -> bool:
        return False

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [False] * len(keys)

    async def delete(self, key: str) -> bool:
        return False

    async def ping(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "BlackholeConnector(blackhole://)"
