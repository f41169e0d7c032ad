"""Batch get and put: many objects in one request, as a stream of length-prefixed frames.

The format (media type ``application/vnd.kvgate.frames``), the same both ways: a sequence of
entries, each ``key_len u16 LE | key (UTF-8) | frame_len u64 LE | frame``. In an answer to
``POST /v1/batch/get`` the entries follow the order of the keys asked for, and a key that is
not stored has ``frame_len`` = 2**64 - 1 and no frame bytes. Frames are kvgate frames
(``gateway/frame.py``): self-describing and checksummed, encoded with the codec the request
names in ``x-kvgate-codec`` (default raw). A batch put checks the whole body's layout before
it stores anything; a frame that fails verification stops it there (the entries before it are
stored, and the 400 names the entry). ``x-kvgate-positions`` gives the entries' start positions
(``Store.put``'s ``position``) in order, comma-separated, an empty item for an unknown one.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request, Response
from pydantic import BaseModel, Field

from gateway.errors import CapacityError
from gateway.http.body import (
    FRAMES_TYPE,
    BadRequest,
    Body,
    frame_object,
    parse_positions,
    read_body,
    read_json,
)
from gateway.http.objects import (
    DURABLE_HEADER,
    PartsResponse,
    frame_parts,
    parse_durable,
)
from gateway.http.state import MAX_BATCH_KEYS, ServiceState, state_of
from gateway.objects import ObjectData
from gateway.types import Buffer

KEY_LEN = struct.Struct("<H")
FRAME_LEN = struct.Struct("<Q")
MISSING = 2**64 - 1
POSITIONS_HEADER = (
    "each entry's start in its token sequence, in order, comma-separated; an empty item is "
    "unknown (kvtc undoes RoPE with them)"
)


class BatchGetRequest(BaseModel):
    keys: list[str] = Field(max_length=MAX_BATCH_KEYS)


def entry_head(key: str, frame_len: int) -> bytes:
    raw = key.encode()
    return KEY_LEN.pack(len(raw)) + raw + FRAME_LEN.pack(frame_len)


def split_entries(blob: memoryview) -> list[tuple[str, memoryview]]:
    """The entries of a batch body; ``BadRequest`` when it is not one."""
    out: list[tuple[str, memoryview]] = []
    at = 0
    while at < blob.nbytes:
        if at + KEY_LEN.size > blob.nbytes:
            raise BadRequest(f"batch entry {len(out)}: truncated key length")
        (klen,) = KEY_LEN.unpack_from(blob, at)
        at += KEY_LEN.size
        if at + klen + FRAME_LEN.size > blob.nbytes:
            raise BadRequest(f"batch entry {len(out)}: truncated key or frame length")
        try:
            key = bytes(blob[at : at + klen]).decode()
        except UnicodeDecodeError:
            raise BadRequest(f"batch entry {len(out)}: key is not UTF-8") from None
        at += klen
        (flen,) = FRAME_LEN.unpack_from(blob, at)
        at += FRAME_LEN.size
        if flen > blob.nbytes - at:
            raise BadRequest(f"batch entry {len(out)}: frame of {flen} bytes overruns the body")
        out.append((key, blob[at : at + flen]))
        at += flen
        if len(out) > MAX_BATCH_KEYS:
            raise BadRequest(f"more than {MAX_BATCH_KEYS} entries in one batch")
    return out


_FRAMES: dict[str, Any] = {
    "content": {FRAMES_TYPE: {"schema": {"type": "string", "format": "binary"}}},
}


def batch_router() -> APIRouter:
    router = APIRouter(tags=["batch"])

    @router.post(
        "/v1/batch/get",
        response_class=Response,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": BatchGetRequest.model_json_schema()}},
            }
        },
        responses={200: {"description": __doc__, **_FRAMES}},
    )
    async def batch_get(
        request: Request,
        x_kvgate_codec: Annotated[str | None, Header(description="codec of the frames")] = None,
        x_kvgate_codec_options: Annotated[str | None, Header(description="JSON")] = None,
    ) -> Response:
        """Frames of the keys asked for, in order; misses marked (see the batch format)."""
        state = state_of(request)
        asked = await read_json(request, state.max_json, BatchGetRequest)
        # One key at a time, the answer's size counted as it grows: what the request holds
        # stays within the limit plus one object, and a refusal stops reading at once (all
        # keys fetched together read every one of them before the size could be checked).
        found: list[ObjectData] = []
        parts: list[Buffer] = []
        total = 0
        for key in asked.keys:
            hit = await state.store.get_stored(key)
            if hit is None:
                parts.append(entry_head(key, MISSING))
                continue
            frame, _ = await frame_parts(state, key, hit, x_kvgate_codec, x_kvgate_codec_options)
            size = sum(memoryview(p).nbytes for p in frame)
            total += size
            if total > state.max_body:  # the answer is bounded like a request body
                raise CapacityError(f"batch answer exceeds {state.max_body} bytes: ask fewer")
            found.append(hit)  # kept by the response: each pool lease while the frames are sent
            parts += [entry_head(key, size), *frame]
        return PartsResponse(parts, media_type=FRAMES_TYPE, headers={}, keep=found)

    @router.post(
        "/v1/batch/put",
        status_code=204,
        response_class=Response,
        openapi_extra={"requestBody": {"required": True, "description": __doc__, **_FRAMES}},
        responses={413: {"description": "Body over the limit"}},
    )
    async def batch_put(
        request: Request,
        x_kvgate_durable: Annotated[str | None, Header(description=DURABLE_HEADER)] = None,
        x_kvgate_positions: Annotated[str | None, Header(description=POSITIONS_HEADER)] = None,
    ) -> Response:
        """Store every entry of the body (each a key and its frame), in order."""
        state = state_of(request)
        durable = parse_durable(x_kvgate_durable)
        body = await read_body(request, state.max_body, state.body_pool, state.body_budget)
        try:
            entries = split_entries(body.view)
            positions = parse_positions(x_kvgate_positions, len(entries))
            for i, ((key, frame), position) in enumerate(zip(entries, positions, strict=True)):
                try:
                    await _put_entry(state, body, key, frame, durable, position)
                except BadRequest as exc:  # the frame's (the store raises none)
                    raise BadRequest(f"batch entry {i}: {exc}") from None
        finally:
            body.release()
        return Response(status_code=204)

    return router


async def _put_entry(
    state: ServiceState,
    body: Body,
    key: str,
    frame: memoryview,
    durable: bool,
    position: int | None,
) -> None:
    """Store one entry. One decoded object at a time, charged to the body budget until it is
    stored; a function of its own so that the object is gone (no local still names it) before
    the next entry waits for room."""
    async with frame_object(body, frame, state.codecs, state.max_body, key) as (obj, header):
        await state.store.put(
            key, obj, fmt=header.fmt, ttl=header.ttl, durable=durable, position=position
        )
