"""Reading HTTP requests: bounded bodies, the object headers, frames sent by clients.

A body is read into one buffer sized from ``Content-Length``: a declared length over the limit
is refused (413) before a byte of the body is read, and a chunked body is counted while it
streams and refused as soon as it passes the limit. Buffers for bodies that fit come from a
prefaulted pool (a fresh 32 MiB buffer costs as much in page faults as the transfer itself).

Everything a client sends is checked here and refused with ``BadRequest`` (400): malformed
headers, a corrupt frame, a shape that does not match the body. The status map lives in
``gateway.http.app``.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import AsyncIterator
from typing import Any, TypeVar, cast

import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from gateway.codec import Codec, decode_payload
from gateway.errors import (
    CapacityError,
    ConfigError,
    CorruptObject,
    GatewayError,
    InvalidObject,
    NotFound,
    Unsupported,
)
from gateway.frame import FrameHeader, decode_frame, parse_header
from gateway.http.byte_budget import ByteBudget
from gateway.http.codec_options import (
    Fetch,
    calibration_of,
    check_client_options,
    load_named,
    refuse_keyed,
)
from gateway.keys import normalize_key
from gateway.memory import BufferPool, Slab
from gateway.object_meta import (
    FORMATS,
    ITEMSIZE,
    MAX_DIMS,
    MAX_POSITION,
    check_format,
    check_meta,
    check_ttl,
    meta_of_frame,
)
from gateway.object_meta import ObjectMeta as Meta
from gateway.objects import COPIED_KINDS, HAS_TORCH, to_object
from gateway.registry import load_codec
from gateway.staging_allowance import StagingAllowance
from gateway.tiers import codec_inline, offload
from gateway.types import BYTE_KINDS, OBJECT_KINDS, ObjectKind

FRAME_TYPE = "application/vnd.kvgate.frame"
FRAMES_TYPE = "application/vnd.kvgate.frames"
H_KIND, H_DTYPE, H_SHAPE = "x-kvgate-kind", "x-kvgate-dtype", "x-kvgate-shape"
H_FORMAT, H_TTL = "x-kvgate-format", "x-kvgate-ttl"
H_POSITION = "x-kvgate-position"
H_POSITIONS = "x-kvgate-positions"  # a batch put's, one per entry
H_CODEC, H_CODEC_OPTIONS = "x-kvgate-codec", "x-kvgate-codec-options"
M = TypeVar("M", bound=BaseModel)
MAX_CODECS = 32  # codec instances kept per (name, options); a bound, not a tuning knob


class BadRequest(GatewayError):
    """The request itself is malformed: a header, a JSON body, a frame the client sent."""

    kind = "bad_request"


class Body:
    """A request body in one contiguous buffer; ``release()`` returns it to the pool."""

    __slots__ = ("_budget", "_held", "_slab", "_staging", "array")

    def __init__(
        self,
        array: np.ndarray[Any, Any],
        slab: Slab | None,
        budget: ByteBudget | None = None,
        held: int = 0,
        *,
        staging: StagingAllowance | None = None,
    ) -> None:
        self.array = array  # uint8, exactly the body's length
        self._slab = slab
        self._staging = staging  # set when ``slab`` is the store's: put(staged=...)
        self._budget = budget  # what this body holds of the server's in-flight byte budget
        self._held = held

    @property
    def view(self) -> memoryview:
        return self.array.data.cast("B")

    def __len__(self) -> int:
        return int(self.array.nbytes)

    @property
    def staged_slab(self) -> Slab | None:
        """The store's slab the body was read into, for ``Store.put(staged=...)``."""
        return self._slab if self._staging is not None else None

    @contextlib.asynccontextmanager
    async def holding(self, nbytes: int) -> AsyncIterator[None]:
        """Charge ``nbytes`` more to the body budget while inside: memory the request holds
        beside its body, such as an object decoded from it (``ByteBudget.grow``)."""
        budget = self._budget
        if budget is None or nbytes <= 0:
            yield
            return
        n = await budget.grow(nbytes, self._held)
        try:
            yield
        finally:
            budget.release(n)

    def release(self) -> None:
        if self._slab is not None:
            if self._staging is not None:
                self._staging.give_back(self._slab)
            else:
                self._slab.release()
            self._slab = None
        if self._budget is not None:
            self._budget.release(self._held)
            self._budget = None


def _declared_length(request: Request) -> int | None:
    text = request.headers.get("content-length")
    if text is None:
        return None
    if not text.isascii() or not text.isdigit():
        raise BadRequest(f"bad Content-Length {text!r}")
    return int(text)


async def read_body(
    request: Request,
    limit: int,
    pool: BufferPool | None = None,
    budget: ByteBudget | None = None,
    staging: StagingAllowance | None = None,
) -> Body:
    """The whole body, refused with ``CapacityError`` once it is known to exceed ``limit``.

    With a ``budget``, the body's bytes are reserved from it before they are read (a chunked
    body of unknown length reserves ``limit``); ``Body.release`` gives them back. A body of
    declared length is read into the store's memory when ``staging`` gives some
    (``Store.reserve``: the put then keeps it, no copy), else into ``pool``'s, else into a
    fresh buffer.
    """
    declared = _declared_length(request)
    if declared is not None and declared > limit:
        raise CapacityError(f"request body of {declared} bytes exceeds the limit of {limit}")
    held = await budget.acquire(limit if declared is None else declared) if budget else 0
    try:
        body = await _read(request, limit, declared, pool, staging)
    except BaseException:
        if budget is not None:
            budget.release(held)
        raise
    body._budget, body._held = budget, held
    return body


async def _read(
    request: Request,
    limit: int,
    declared: int | None,
    pool: BufferPool | None,
    staging: StagingAllowance | None,
) -> Body:
    if declared is None:  # chunked: grow, counting as it streams
        grown = bytearray()
        async for chunk in request.stream():
            if len(grown) + len(chunk) > limit:
                raise CapacityError(f"request body exceeds the limit of {limit} bytes")
            grown += chunk
        return Body(np.frombuffer(grown, dtype=np.uint8), None)
    slab = staging.reserve(declared) if staging is not None and declared else None
    from_store = staging if slab is not None else None
    if slab is None and pool is not None and declared:
        slab = pool.alloc(declared)
    array = np.frombuffer(slab.view(), np.uint8) if slab else np.empty(declared, np.uint8)
    body = Body(array, slab, staging=from_store)
    try:
        dst = body.view
        n = 0
        async for chunk in request.stream():
            end = n + len(chunk)
            if end > declared:  # the server's parser frames by Content-Length; never trust it
                raise BadRequest("request body longer than its Content-Length")
            dst[n:end] = chunk
            n = end
        if n != declared:
            raise BadRequest(f"request body of {n} bytes, {declared} declared")
    except BaseException:
        body.release()
        raise
    return body


async def read_json(request: Request, limit: int, model: type[M]) -> M:
    """A small JSON body validated as ``model``; 400 when it is not one.

    Read here rather than by FastAPI so that the body is bounded and read only after the
    request passed authentication (FastAPI reads declared bodies before dependencies run).
    """
    body = await read_body(request, limit)
    try:
        return model.model_validate_json(bytes(body.view))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise BadRequest(f"bad JSON body: {problems}") from None


# -- object headers ----------------------------------------------------------------------


def parse_ttl(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return check_ttl(float(text))
    except (ValueError, InvalidObject):  # float() raises ValueError, check_ttl InvalidObject
        raise BadRequest(f"bad {H_TTL} header {text[:40]!r}: seconds, finite and > 0") from None


def parse_position(text: str | None, header: str = H_POSITION) -> int | None:
    """``x-kvgate-position``: where a KV chunk starts in its token sequence (codecs such as
    kvtc undo RoPE on keys with it); absent is unknown."""
    if text is None:
        return None
    stripped = text.strip()
    if not stripped.isdigit() or not stripped.isascii() or len(stripped) > len(str(MAX_POSITION)):
        raise BadRequest(f"bad {header} header {text[:40]!r}: a token index, an int >= 0")
    return int(stripped)


def parse_positions(text: str | None, count: int) -> list[int | None]:
    """``x-kvgate-positions`` of a batch put: one item per entry, in order, comma-separated,
    each a token index or empty (unknown); absent: every position unknown."""
    if text is None or (count == 0 and not text.strip()):
        return [None] * count
    items = text.split(",", count)  # at most count + 1 items, whatever the header holds
    if len(items) != count:
        raise BadRequest(f"{H_POSITIONS} has {len(items)} items for {count} batch entries")
    return [
        None if not item.strip() else parse_position(item, f"{H_POSITIONS} item {i}")
        for i, item in enumerate(items)
    ]


def parse_format(text: str | None) -> int:
    if text is None:
        return 0
    try:
        return check_format(int(text))
    except (ValueError, InvalidObject):
        raise BadRequest(
            f"bad {H_FORMAT} header {text[:40]!r}: a memory format code, "
            f"{min(FORMATS)} to {max(FORMATS)}"
        ) from None


def _parse_shape(text: str) -> tuple[int, ...]:
    if text.count(",") > MAX_DIMS:  # before int() turns a long header into many big numbers
        raise InvalidObject(f"bad {H_SHAPE} header: more than {MAX_DIMS} dimensions")
    try:
        return tuple(int(d) for d in text.split(",") if d.strip() != "")
    except ValueError:
        raise BadRequest(f"bad {H_SHAPE} header {text[:40]!r}: comma-separated integers") from None


def object_of(body: Body, kind: str | None, dtype: str | None, shape_text: str | None) -> object:
    """The object a plain (octet-stream) PUT describes: bytes, an ndarray or a tensor.

    The object shares the body's memory: the store copies it before ``put`` returns. Its
    description is checked as every object's is (``check_meta``) before it is built.
    """
    kind = kind or ("tensor" if dtype else "bytes")
    if kind not in OBJECT_KINDS:
        raise BadRequest(f"bad {H_KIND} header {kind[:40]!r}: one of {', '.join(OBJECT_KINDS)}")
    if kind in BYTE_KINDS:
        if dtype not in (None, "uint8"):
            raise BadRequest(f"{kind} objects are uint8, not {dtype[:40]}")
        # Kept as a memoryview: the store copies it into its pool once and a GET sends the
        # pool's memory as is. As ``bytes`` it would be copied twice more, each time into a
        # fresh allocation (page faults: measured here, 0.8 instead of 1.4-3 GB/s at 32 MiB).
        return body.view
    dtype = dtype or "uint8"
    if dtype not in ITEMSIZE:
        raise Unsupported(f"unknown dtype {dtype[:40]!r}")
    shape = _parse_shape(shape_text) if shape_text is not None else None
    if shape is None:
        if len(body) % ITEMSIZE[dtype]:
            raise BadRequest(f"{len(body)} body bytes are not a whole number of {dtype}")
        shape = (len(body) // ITEMSIZE[dtype],)
    if kind == "tensor" and not HAS_TORCH:
        kind = "ndarray"  # the same bytes, dtype and shape; numpy may lack the dtype (bfloat16)
    check_meta(kind, dtype, shape, len(body))
    return to_object(Meta(cast(ObjectKind, kind), dtype, shape, len(body)), body.view)


def meta_headers(meta: Meta) -> dict[str, str]:
    return {
        H_KIND: "bytes" if meta.kind in BYTE_KINDS else meta.kind,
        H_DTYPE: meta.dtype,
        H_SHAPE: ",".join(str(d) for d in meta.shape),
        H_FORMAT: str(int(meta.fmt)),
    }


# -- frames ------------------------------------------------------------------------------


class Codecs:
    """Codec instances by (name, options), bounded; unknown names are the client's error.

    Options come from clients: none may name a file (``gateway.http.codec_options``)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, str], Codec] = {}
        # Used from the event loop and from the threads that decode frames: one at a time.
        self._lock = threading.Lock()

    def cached(self, name: str) -> Codec | None:
        """The instance with default options, if one was built (building one may import and
        compile: not for the event loop)."""
        with self._lock:
            return self._cache.get((name, "{}"))

    def get(self, name: str, options_json: str | None = None) -> Codec:
        options_json = options_json or "{}"
        with self._lock:
            cached = self._cache.get((name, options_json))
        if cached is not None:
            return cached
        options = _parse_options(options_json)
        try:
            refuse_keyed(name)
            check_client_options(name, options)
            codec = load_codec(name, **options)
        except (NotFound, ConfigError) as exc:  # the client named it in a header
            raise BadRequest(str(exc)) from None
        except (TypeError, ValueError) as exc:  # a codec's own option checks
            raise BadRequest(f"codec {name!r}: {exc}") from None
        # A kvtc codec holds the calibration it names (tens to hundreds of MiB): kept here, 32
        # clients' hashes would pin 32 of them past the registry's bound. Building one by hash
        # is a registry lookup, so such codecs are built per request instead.
        if calibration_of(name, options) is not None:
            return codec
        with self._lock:
            if len(self._cache) >= MAX_CODECS:
                self._cache.pop(next(iter(self._cache)))
            self._cache[(name, options_json)] = codec
        return codec

    async def for_client(self, name: str, options_json: str | None, fetch: Fetch) -> Codec:
        """``get``, once what the options name by hash (a kvtc calibration) is loaded from
        the store's tiers through ``fetch``, if they hold it."""
        held = None  # the calibration loaded for this request, until its codec holds it
        with self._lock:
            known = (name, options_json or "{}") in self._cache
        if not known:
            try:
                held = await load_named(name, _parse_options(options_json or "{}"), fetch)
            except ConfigError as exc:
                raise BadRequest(str(exc)) from None
        codec = self.get(name, options_json)
        del held
        return codec


def _parse_options(options_json: str) -> dict[str, Any]:
    try:
        options = json.loads(options_json)
    except ValueError:
        raise BadRequest(f"bad {H_CODEC_OPTIONS} header: not JSON") from None
    if not isinstance(options, dict):
        raise BadRequest(f"bad {H_CODEC_OPTIONS} header: a JSON object")
    return options


def _decode_frame_object(blob: memoryview, meta: Meta, codecs: Codecs, key: str) -> object:
    try:
        header, payload = decode_frame(blob, key=key)
        codec = codecs.get(header.codec)
        raw = decode_payload(codec, payload, header, None, key)
        if memoryview(raw).nbytes != header.raw_len:
            raise CorruptObject(f"codec {header.codec} returned the wrong length")
        return to_object(meta, raw)
    except (CorruptObject, ValueError) as exc:  # the client's frame, not a backend's
        raise BadRequest(f"bad frame: {exc}") from None


@contextlib.asynccontextmanager
async def frame_object(
    body: Body, blob: memoryview, codecs: Codecs, max_size: int, key: str
) -> AsyncIterator[tuple[object, FrameHeader]]:
    """The object of a frame a client sent for ``key`` (``blob``, in ``body``), verified and
    decoded; a frame bound to another key is refused. Store it inside the block.

    The header decides, before anything is decoded, as a plain PUT's length does: an object
    over ``max_size`` is refused (413), and the decoded bytes are charged to the body budget
    until the block ends (``Body.holding``), so a small frame of a large object waits or is
    refused like a large body. The decode runs off the event loop unless the object and the
    frame are small and the codec cheap (``codec_inline``): a 32 KB zstd frame can hold 1 GiB.
    """
    try:
        header = parse_header(blob)[0]
        meta = meta_of_frame(header)
    except (CorruptObject, ValueError) as exc:
        raise BadRequest(f"bad frame: {exc}") from None
    if header.raw_len > max_size:
        raise CapacityError(f"frame claims {header.raw_len} bytes, over {max_size}")
    # A raw frame's tensor or array is a view of the body; other objects are new memory.
    views_body = header.codec == "raw" and meta.kind not in COPIED_KINDS
    async with body.holding(0 if views_body else header.raw_len):
        codec = codecs.cached(header.codec)  # none yet: built in the thread
        inline = codec is not None and codec_inline(codec)
        size = max(header.raw_len, blob.nbytes)  # the checksum reads the whole payload
        bound = normalize_key(key)
        obj = await offload(
            size, _decode_frame_object, blob, meta, codecs, bound, device=not inline
        )
        yield obj, header
