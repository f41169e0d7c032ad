"""The object API: ``PUT``/``GET``/``HEAD``/``DELETE /v1/objects/{key}``, ``POST /v1/lookup``
and ``POST /v1/exists``.

An object travels either as its plain bytes (``application/octet-stream``, with kind, dtype,
shape and memory format in ``x-kvgate-*`` headers) or as a kvgate frame
(``application/vnd.kvgate.frame``): a client that asks for a frame names the codec that encodes
it (``x-kvgate-codec``), so compressed objects cross the network compressed. Frames sent by a
client are verified and decoded before the object is stored. Answers are written from the
store's memory without joining or copying (a tensor's bytes go to the socket as they are).
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import unquote_to_bytes

from fastapi import APIRouter, Depends, Header, Path, Request, Response
from pydantic import BaseModel, Field
from starlette.types import Receive, Scope, Send

from gateway.codec import encode_frame
from gateway.errors import InvalidKey, NotFound
from gateway.http.body import (
    FRAME_TYPE,
    BadRequest,
    Body,
    frame_object,
    meta_headers,
    object_of,
    parse_format,
    parse_position,
    parse_ttl,
    read_body,
    read_json,
)
from gateway.http.key_path import KEY_PATH
from gateway.http.state import MAX_LOOKUP_KEYS, ServiceState, state_of
from gateway.keys import normalize_key
from gateway.objects import ObjectData
from gateway.tiers import codec_inline, offload
from gateway.types import Buffer

OCTETS = "application/octet-stream"
DURABLE_HEADER = "true: answer only once every tier holds the object (default false)"
POSITION_HEADER = "where the KV chunk starts in its token sequence (kvtc undoes RoPE with it)"


def parse_durable(value: str | None) -> bool:
    """``x-kvgate-durable``: true or false (1 or 0); absent is false."""
    if value is None:
        return False
    flag = value.strip().lower()
    if flag not in ("true", "false", "1", "0"):
        raise BadRequest(f"x-kvgate-durable must be true or false, not {value!r}")
    return flag in ("true", "1")


class PartsResponse(Response):
    """A body sent as a list of buffers, none joined or copied; ``keep`` outlives the send."""

    def __init__(
        self, parts: list[Buffer], *, media_type: str, headers: dict[str, str], keep: object
    ) -> None:
        self.parts = [memoryview(p).cast("B") for p in parts]
        self.keep = keep  # the object whose memory the parts view (a lease on the cache)
        size = sum(p.nbytes for p in self.parts)
        super().__init__(None, 200, {**headers, "content-length": str(size)}, media_type)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        parts = [p for p in self.parts if p.nbytes] or [memoryview(b"")]
        for i, part in enumerate(parts):
            await send(
                {"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1}
            )


def wants_frame(accept: str | None) -> bool:
    return accept is not None and FRAME_TYPE in accept


async def frame_parts(
    state: ServiceState, key: str, data: ObjectData, codec: str | None, options: str | None
) -> tuple[list[Buffer], dict[str, str]]:
    """The frame of ``data`` encoded with the named codec, bound to ``key``: head and payload
    parts."""
    chosen = await state.codecs.for_client(codec or "raw", options, state.store.get_stored)
    slow = not codec_inline(chosen) or not data.on_host  # zstd level 22 is, at any size
    bound = normalize_key(key)
    head, parts, _ = await offload(data.meta.nbytes, encode_frame, chosen, data, bound, device=slow)
    return [head, *parts], {"x-kvgate-codec": chosen.name}


class LookupRequest(BaseModel):
    keys: list[str] = Field(max_length=MAX_LOOKUP_KEYS)


class ExistsRequest(BaseModel):
    keys: list[str] = Field(max_length=MAX_LOOKUP_KEYS)


class ExistsAnswer(BaseModel):
    exists: list[bool] = Field(description="per key, in order: whether any tier stores it")


class TierHits(BaseModel):
    tier: str
    hits: int = Field(
        description="how many ADDITIONAL leading keys this tier holds after those counted by "
        "the tiers above it (a key in memory and on disk counts for memory only)"
    )


class LookupAnswer(BaseModel):
    prefix: int = Field(description="how many leading keys are stored, in any tier")
    tiers: list[TierHits] = Field(description="per tier, in order; their hits sum to prefix")


_OBJECT_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "The object's bytes, or a kvgate frame (verified, then decoded).",
        "content": {
            OCTETS: {"schema": {"type": "string", "format": "binary"}},
            FRAME_TYPE: {"schema": {"type": "string", "format": "binary"}},
        },
    }
}
_OBJECT_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The object's bytes (kind, dtype, shape in x-kvgate-* headers), or its "
        "frame when Accept names application/vnd.kvgate.frame",
        "content": {
            OCTETS: {"schema": {"type": "string", "format": "binary"}},
            FRAME_TYPE: {"schema": {"type": "string", "format": "binary"}},
        },
    },
    404: {"description": "Not stored"},
}
_LOOKUP_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": LookupRequest.model_json_schema()}},
    }
}

_EXISTS_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": ExistsRequest.model_json_schema()}},
    }
}

Str = str | None
KeyPath = Annotated[str, Path(description="the key: LMCache's form or printable UTF-8")]
OBJECTS = "/v1/objects/"


async def object_key(key: KeyPath, request: Request) -> str:
    """The key in the path; ``InvalidKey`` when its percent-decoded bytes are not UTF-8.

    The server decodes the path with replacement characters, so ``k%FF`` and ``k%FE`` would
    both arrive as ``k`` and U+FFFD, and name one object: the raw path is checked instead.
    (async: FastAPI runs a plain function dependency in a thread.)"""
    raw = request.scope.get("raw_path")
    if isinstance(raw, bytes):
        decoded = unquote_to_bytes(raw)
        try:
            decoded.decode()
        except UnicodeDecodeError:
            shown = decoded.partition(OBJECTS.encode())[2][:120]
            raise InvalidKey(f"key {shown!r} is not UTF-8 (once percent-decoded)") from None
    return key


ObjectKey = Annotated[str, Depends(object_key)]


def object_router() -> APIRouter:
    router = APIRouter(tags=["objects"])

    @router.put(
        OBJECTS + KEY_PATH,
        status_code=204,
        response_class=Response,
        openapi_extra=_OBJECT_BODY,
        responses={413: {"description": "Body over the limit"}},
    )
    async def put_object(
        key: ObjectKey,
        request: Request,
        content_type: Annotated[Str, Header()] = None,
        x_kvgate_kind: Annotated[Str, Header(description="tensor, ndarray or bytes")] = None,
        x_kvgate_dtype: Annotated[Str, Header(description="e.g. bfloat16 (a tensor)")] = None,
        x_kvgate_shape: Annotated[Str, Header(description="comma-separated ints")] = None,
        x_kvgate_format: Annotated[Str, Header(description="LMCache memory format")] = None,
        x_kvgate_ttl: Annotated[Str, Header(description="seconds to keep the object")] = None,
        x_kvgate_durable: Annotated[Str, Header(description=DURABLE_HEADER)] = None,
        x_kvgate_position: Annotated[Str, Header(description=POSITION_HEADER)] = None,
    ) -> Response:
        """Store an object (204: in the first tier; with x-kvgate-durable: true or the store's
        write_policy through, in every tier). Plain bytes or, with the frame media type, a
        kvgate frame."""
        state = state_of(request)
        durable = parse_durable(x_kvgate_durable)
        ttl = parse_ttl(x_kvgate_ttl)
        fmt = parse_format(x_kvgate_format)
        position = parse_position(x_kvgate_position)
        media = (content_type or OCTETS).partition(";")[0].strip().lower()
        if media not in (OCTETS, FRAME_TYPE):
            raise BadRequest(f"Content-Type must be {OCTETS} or {FRAME_TYPE}, not {media!r}")
        # A plain body is read into the store's own memory where it gives some: the object is
        # a view of it, which the put keeps (a frame is decoded into new memory: no use).
        staging = state.staging if media == OCTETS else None
        body: Body = await read_body(
            request, state.max_body, state.body_pool, state.body_budget, staging
        )
        try:
            if media == FRAME_TYPE:
                # The decoded object counts against the body budget until the store has it.
                async with frame_object(body, body.view, state.codecs, state.max_body, key) as fo:
                    obj, header = fo
                    ttl = ttl if ttl is not None else header.ttl
                    await state.store.put(
                        key, obj, fmt=header.fmt, ttl=ttl, durable=durable, position=position
                    )
            else:
                obj = object_of(body, x_kvgate_kind, x_kvgate_dtype, x_kvgate_shape)
                staged = body.staged_slab
                await state.store.put(
                    key, obj, fmt=fmt, ttl=ttl, durable=durable, position=position, staged=staged
                )
        finally:
            body.release()  # the store copied the object, or holds the staged slab itself
        return Response(status_code=204)

    @router.get(OBJECTS + KEY_PATH, response_class=Response, responses=_OBJECT_ANSWER)
    async def get_object(
        key: ObjectKey,
        request: Request,
        accept: Annotated[Str, Header()] = None,
        x_kvgate_codec: Annotated[Str, Header(description="codec of a frame answer")] = None,
        x_kvgate_codec_options: Annotated[Str, Header(description="its options, JSON")] = None,
    ) -> Response:
        """The object: its bytes, or its frame encoded with the codec asked for."""
        state = state_of(request)
        data = await state.store.get_stored(key)
        if data is None:
            raise NotFound(f"no object under key {key!r}")
        headers = meta_headers(data.meta)
        if wants_frame(accept):
            parts, more = await frame_parts(
                state, key, data, x_kvgate_codec, x_kvgate_codec_options
            )
            return PartsResponse(parts, media_type=FRAME_TYPE, headers=headers | more, keep=data)
        return PartsResponse([data.host()], media_type=OCTETS, headers=headers, keep=data)

    @router.head(OBJECTS + KEY_PATH, response_class=Response, responses=_OBJECT_ANSWER)
    async def head_object(key: ObjectKey, request: Request) -> Response:
        """The headers a plain GET would answer, without the body. An object only a lower
        tier holds is read but not promoted into the memory tier (``Store.stat``)."""
        meta = await state_of(request).store.stat(key)
        if meta is None:
            raise NotFound(f"no object under key {key!r}")
        headers = meta_headers(meta) | {"content-length": str(meta.nbytes)}
        return Response(status_code=200, headers=headers, media_type=OCTETS)

    @router.delete(
        OBJECTS + KEY_PATH,
        status_code=204,
        response_class=Response,
        responses={404: {"description": "Not stored"}},
    )
    async def delete_object(key: ObjectKey, request: Request) -> Response:
        """Remove the object from every tier (204), or 404 when no tier held it."""
        if not await state_of(request).store.delete(key):
            raise NotFound(f"no object under key {key!r}")
        return Response(status_code=204)

    @router.post("/v1/lookup", response_model=LookupAnswer, openapi_extra=_LOOKUP_BODY)
    async def lookup(request: Request) -> LookupAnswer:
        """How many leading keys are stored (LMCache's prefix rule), and in which tier.

        Each tier's ``hits`` counts the ADDITIONAL leading keys it holds after those the tiers
        above it counted, so they sum to ``prefix``: a key held in memory and on disk counts
        for memory only, and ``file: 0`` does not mean the disk lacks it.
        """
        state = state_of(request)
        asked = await read_json(request, state.max_json, LookupRequest)
        detail = await state.store.lookup_detail(asked.keys)
        tiers = [TierHits(tier=name, hits=n) for name, n in detail]
        return LookupAnswer(prefix=sum(n for _, n in detail), tiers=tiers)

    @router.post("/v1/exists", response_model=ExistsAnswer, openapi_extra=_EXISTS_BODY)
    async def exists(request: Request) -> ExistsAnswer:
        """Whether each key is stored, in any tier, every key answered (``lookup`` stops at
        the first miss). Lower tiers answer from existence checks, as for ``lookup``: a get
        can still miss."""
        state = state_of(request)
        asked = await read_json(request, state.max_json, ExistsRequest)
        return ExistsAnswer(exists=await state.store.contains_many(asked.keys))

    return router
