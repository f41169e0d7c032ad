"""Side objects: what a codec needs besides a frame to decode it, stored in the tiers.

Some codecs decode with a model-wide object (``kvtc``: a calibration of bases and tables,
megabytes, shared by every chunk). Such an object is content-addressed: frames name it by
hash, it is stored once per tier under a reserved key, and the decoding process keeps it
once fetched. The core knows nothing of what the object is:

- a codec that needs one declares ``side_objects``: ``(key, bytes)`` pairs a tier must hold
  before any frame the codec writes (``ConnectorTier.write`` puts them first, once per tier
  and process, and again every ``REFRESH_WRITES`` frames in case a capacity-bound backend
  evicted them);
- a codec that cannot decode a frame because the object it names is not in its process
  raises ``MissingSideObject`` with the key and an ``install`` callback. The tier then reads
  that key from itself once, hands the bytes to ``install`` (which verifies the content hash
  and keeps the object) and decodes again. An object that is still missing, or whose bytes
  do not match their hash, leaves a miss (``CorruptObject``, counted), never a wrong tensor.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.errors import CorruptObject

PREFIX = "kvgate/side/"
REFRESH_WRITES = 1024  # frames a tier writes before it writes its side objects again


class MissingSideObject(CorruptObject):
    """A frame names a side object this process does not have (yet)."""

    def __init__(self, message: str, key: str, install: Callable[[bytes], None]) -> None:
        super().__init__(message)
        self.key = key
        self.install = install  # verifies and keeps the object; CorruptObject if it is wrong


def side_key(kind: str, digest: str) -> str:
    """The reserved key of a side object: ``kvgate/side/<kind>/<sha256 hex>``."""
    return f"{PREFIX}{kind}/{digest}"


def is_side_key(key: str) -> bool:
    return key.startswith(PREFIX)


class SideObjectUnavailable(CorruptObject):
    """The side object a frame names is not in the tier, or is not the named content: the
    frame is a miss (counted), but it is kept, since it is sound."""
