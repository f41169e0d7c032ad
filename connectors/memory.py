"""``memory://`` — the in-process reference connector: a dict of key -> bytes.

``memory://`` is private to its instance. ``memory://<name>`` names a space that every instance
with that name in this process shares (like fsspec's memory filesystem), and that outlives its
instances until the process ends, so a closed and reopened ``memory://cache`` still holds its
objects. Instances of one name must agree on ``capacity`` and ``eviction``.

``put`` joins the parts into one immutable ``bytes`` and swaps it in with no ``await`` in
between, so a reader always sees a whole object, old or new. ``connector.objects`` is the real
storage dict; tests reach it to corrupt data on purpose (keeping each value's length, or
``usage()`` goes wrong).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from pydantic import Field

from connectors._options import StrictOptions, parse_options, split_url
from gateway.connector import BaseConnector, join_parts
from gateway.errors import CapacityError, ConfigError, GatewayError
from gateway.policies import EvictionPolicy, make_policy
from gateway.types import Buffer, BufferParts, Capabilities, ObjectInfo


class MemoryOptions(StrictOptions):
    capacity: int | None = Field(default=None, gt=0, description="bytes; None = unbounded")
    eviction: str = "lru"


@dataclass(eq=False)
class _Space:
    """One namespace of objects with its byte count and eviction policy (sync, no I/O)."""

    capacity: int | None
    eviction: str
    objects: dict[str, bytes] = field(default_factory=dict)
    used: int = 0
    policy: EvictionPolicy[str] | None = None

    def __post_init__(self) -> None:
        # make_policy validates the name even without a capacity, so a typo fails at start.
        policy = make_policy(self.eviction, self.capacity or 0)
        self.policy = policy if self.capacity is not None else None

    def store(self, key: str, value: bytes) -> None:
        if self.capacity is not None and len(value) > self.capacity:
            raise CapacityError(
                f"object of {len(value)} bytes is larger than the capacity ({self.capacity})"
            )
        self.drop(key)
        if self.policy is not None and self.capacity is not None:
            while self.used + len(value) > self.capacity:
                victim = self.policy.victim()
                if victim is None:  # the policy lost track of keys: nothing left to drop
                    break
                self.used -= len(self.objects.pop(victim, b""))
            self.policy.insert(key, len(value))
        self.objects[key] = value
        self.used += len(value)

    def drop(self, key: str) -> bool:
        old = self.objects.pop(key, None)
        if old is None:
            return False
        self.used -= len(old)
        if self.policy is not None:
            self.policy.remove(key)
        return True


# Named spaces live as long as the process, as fsspec's memory filesystem does. The lock guards
# creation only: connectors may be built from several threads (one event loop each).
_NAMED: dict[str, _Space] = {}
_NAMED_LOCK = threading.Lock()


def _named_space(name: str, capacity: int | None, eviction: str) -> _Space:
    with _NAMED_LOCK:
        space = _NAMED.get(name)
        if space is None:
            space = _NAMED[name] = _Space(capacity, eviction)
        elif (space.capacity, space.eviction.lower()) != (capacity, eviction.lower()):
            raise ConfigError(
                f"memory://{name} is already open with capacity={space.capacity}, "
                f"eviction={space.eviction!r}; got capacity={capacity}, eviction={eviction!r}"
            )
        return space


class MemoryConnector(BaseConnector):
    """Objects in a dict in this process. Not persistent; a miss is None, as everywhere."""

    scheme: ClassVar[str] = "memory"

    def __init__(
        self, name: str | None = None, *, capacity: int | None = None, eviction: str = "lru"
    ) -> None:
        self.name = name
        space = _named_space(name, capacity, eviction) if name else _Space(capacity, eviction)
        self._space = space
        self.objects: dict[str, bytes] = space.objects
        """The real storage (key -> whole object); shared by instances of one name."""
        self.capabilities = Capabilities(batch=True, list=True, max_object_size=capacity)
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        parts = split_url(url, cls.scheme)
        opts = parse_options(MemoryOptions, url, options)
        name = parts.netloc + parts.path
        return cls(name or None, capacity=opts.capacity, eviction=opts.eviction)

    def _check_open(self) -> None:
        if self._closed:
            raise GatewayError(f"{self!r} is closed")

    async def get(self, key: str) -> Buffer | None:
        self._check_open()
        value = self.objects.get(key)
        if value is not None and self._space.policy is not None:
            self._space.policy.touch(key)
        return value

    async def put(self, key: str, data: BufferParts) -> None:
        self._check_open()
        # A copy even for one bytearray or memoryview: the caller may reuse its buffer.
        value = join_parts(data)
        self._space.store(key, value if type(value) is bytes else bytes(value))

    async def exists(self, key: str) -> bool:
        self._check_open()
        return key in self.objects

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        return [key in self.objects for key in keys]

    async def delete(self, key: str) -> bool:
        self._check_open()
        return self._space.drop(key)

    async def ping(self) -> bool:
        self._check_open()
        return True

    def usage(self) -> tuple[int, int | None]:
        return (self._space.used, self._space.capacity)

    async def close(self) -> None:
        if not self._closed and self.name is None:
            # A private space dies with its only user: free the memory now.
            self._space.objects.clear()
            self._space.used = 0
        self._closed = True

    def __repr__(self) -> str:
        return f"MemoryConnector(memory://{self.name or ''})"

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        self._check_open()
        # A snapshot: puts and deletes during the iteration must not break it.
        snapshot = [(k, len(v)) for k, v in self.objects.items() if k.startswith(prefix)]
        for key, size in sorted(snapshot):
            yield ObjectInfo(key, size)
