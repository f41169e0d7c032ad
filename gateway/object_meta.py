"""What a stored object is (``ObjectMeta``), and the one check every object passes.

Every way in calls ``check_meta`` (and ``check_ttl``) before it builds or stores anything:
``Store.put`` (through ``to_object_data``), the HTTP service (the ``x-kvgate-*`` headers and
the frames a client sends), the lm:// server (which stores through ``Store.put``) and every
tier that reads a frame back (``meta_of_frame``). So what the memory tier accepts, every lower
tier can store and read back, and no header can make numpy or torch fail while building the
object. The limits, and why:

- at most ``MAX_DIMS`` = 32 dimensions: numpy 1.x's limit (numpy 2 allows 64), and kvgate runs
  on numpy >= 1.26, so that a frame written by one process is an ndarray in any other. Torch
  allows more; no KV layout has more than 4.
- dimensions are non-negative and the bytes of the non-zero ones fit int64 (2**63 - 1): what
  numpy (``size * itemsize`` in intp) and torch (numel and storage size in int64) can build,
  even for an empty object whose other dimensions are huge; and they equal the data's length.
- ``fmt`` is one of LMCache's ``MemoryFormat`` codes (``gateway.types``): the lm:// wire carries
  only those, and any other code would be served there as a different format.
- a TTL is a finite number of seconds > 0: NaN would never expire and a negative one would
  expire at once. No upper bound: any finite float survives the frame header, and
  ``created_at + ttl`` stays finite.
- the dtype is one of ``ITEMSIZE``; an ndarray's must also be one numpy knows here (bfloat16
  and the fp8 types come from the ml_dtypes package, imported when it is installed).

Metadata that breaks a limit is ``InvalidObject``, an unknown dtype ``Unsupported``, and a known
dtype that numpy lacks in this process ``MissingDependency``: a tier reading that one back keeps
the object, since another process may read it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from gateway.errors import InvalidObject, MissingDependency, Unsupported
from gateway.frame import FrameHeader
from gateway.types import BYTE_KINDS, OBJECT_KINDS, MemoryFormat, ObjectKind

MAX_DIMS = 32
INT64_MAX = (1 << 63) - 1
FORMATS = frozenset(int(f) for f in MemoryFormat)
HAS_ML_DTYPES = importlib.util.find_spec("ml_dtypes") is not None

# Canonical dtype names (torch's, without the "torch." prefix) and their sizes in bytes.
ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
}


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    kind: ObjectKind
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    fmt: int = MemoryFormat.UNDEFINED


def check_format(fmt: object) -> int:
    """``fmt`` as an int when it is a ``MemoryFormat`` code; ``InvalidObject`` otherwise."""
    if isinstance(fmt, bool) or not isinstance(fmt, numbers.Integral) or int(fmt) not in FORMATS:
        raise InvalidObject(
            f"memory format {fmt!r} is not one of LMCache's codes {min(FORMATS)}..{max(FORMATS)}"
        )
    return int(fmt)


# The largest start position a put may give: what the HTTP header parser takes (18 digits), so a
# position a Store accepts can travel to another kvgate (``gateway://``) and fits a frame's
# int64 parameter.
MAX_POSITION = 10**18 - 1


def check_position(position: object) -> int | None:
    """A KV chunk's start position (None: unknown); ``InvalidObject`` unless an int in
    0..MAX_POSITION."""
    if position is None:
        return None
    if isinstance(position, bool) or not isinstance(position, int):
        raise InvalidObject(f"position must be a non-negative int, got {position!r}")
    if not 0 <= position <= MAX_POSITION:
        raise InvalidObject(f"position must be an int in 0..{MAX_POSITION}, got {position}")
    return position


def check_ttl(ttl: object) -> float | None:
    """``ttl`` in seconds as a float (None: no expiry); ``InvalidObject`` unless finite, > 0."""
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, numbers.Real):
        raise InvalidObject(f"ttl must be a number of seconds, not {type(ttl).__name__}")
    seconds = float(ttl)
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidObject(f"ttl must be a finite number of seconds > 0, not {seconds}")
    return seconds


def numpy_dtype(name: str) -> np.dtype[Any]:
    """numpy's dtype for a canonical name; ``MissingDependency`` (an ``Unsupported``) naming
    what is missing when numpy does not have it here."""
    if name not in ITEMSIZE:
        raise Unsupported(f"unknown dtype {name!r}")
    return _numpy_dtype(name)


# Every put and get checks its dtype here; np.dtype(name) took ~10 us of a 1 MiB put's loop
# time. Only the names of ITEMSIZE reach it, so the cache stays that small.
@functools.lru_cache(maxsize=len(ITEMSIZE))
def _numpy_dtype(name: str) -> np.dtype[Any]:
    try:
        return np.dtype(name)
    except TypeError:
        pass
    if HAS_ML_DTYPES:
        importlib.import_module("ml_dtypes")  # registers bfloat16 and the fp8 types by name
        try:
            return np.dtype(name)
        except TypeError:
            pass
        missing = f"the installed ml_dtypes has no {name}: upgrade it"
    else:
        missing = "the ml_dtypes package adds it and is not installed: pip install ml_dtypes"
    raise MissingDependency(
        f"numpy has no dtype {name!r} here ({missing}), or store it as a torch tensor"
    )


def check_meta(kind: str, dtype: str, shape: tuple[int, ...], nbytes: int, fmt: object = 0) -> None:
    """Raise unless every tier can store, and numpy or torch rebuild, this object.

    ``InvalidObject`` for metadata out of the limits above (or not describing ``nbytes``
    bytes of ``kind``); ``Unsupported`` for a dtype this process does not know.
    """
    if kind not in OBJECT_KINDS:
        raise InvalidObject(f"unknown object kind {kind!r}")
    itemsize = ITEMSIZE.get(dtype)
    if itemsize is None:
        raise Unsupported(f"unknown dtype {dtype!r}")
    check_format(fmt)
    if len(shape) > MAX_DIMS:
        raise InvalidObject(f"{len(shape)} dimensions: kvgate stores at most {MAX_DIMS}")
    extent = itemsize  # bytes spanned by the non-zero dimensions
    for d in shape:
        if d < 0:
            raise InvalidObject(f"negative dimension in shape {shape}")
        extent *= d or 1
        if extent > INT64_MAX:
            raise InvalidObject(f"shape {_short(shape)} of {dtype} spans more than 2**63-1 bytes")
    if kind in BYTE_KINDS and (dtype != "uint8" or len(shape) != 1):
        raise InvalidObject(f"{kind} objects are 1-D uint8, not {dtype} {_short(shape)}")
    if kind == "ndarray":
        numpy_dtype(dtype)
    size = 0 if 0 in shape else extent
    if size != nbytes:
        raise InvalidObject(f"shape {_short(shape)} of {dtype} is {size} bytes, not {nbytes}")


def meta_of_frame(header: FrameHeader) -> ObjectMeta:
    """The object a frame header describes, checked like any other (``check_meta``, TTL)."""
    shape = tuple(header.shape)
    check_meta(header.kind, header.dtype, shape, header.raw_len, header.fmt)
    check_ttl(header.ttl)
    if header.ttl is not None and not math.isfinite(header.created_at):
        raise InvalidObject(f"frame created at {header.created_at}: its TTL never ends")
    return ObjectMeta(header.kind, header.dtype, shape, header.raw_len, header.fmt)


def _short(shape: tuple[int, ...]) -> str:
    """A shape for a message: a hostile header's is cut short."""
    if len(shape) <= 8:
        return str(shape)
    return f"({', '.join(map(str, shape[:8]))}, ... {len(shape)} dims)"
