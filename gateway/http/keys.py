"""``GET /v1/keys``: the store's keys, sorted and paginated (what ``kvgate ls`` reads)."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import parse_qsl

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from gateway.errors import InvalidKey
from gateway.http.state import state_of
from gateway.listing import MAX_PAGE

KEY_PARAMETERS = ("prefix", "after")


class KeyInfo(BaseModel):
    key: str
    size: int = Field(description="bytes in the fastest tier holding it")


class KeyPage(BaseModel):
    keys: list[KeyInfo]
    next: str | None = Field(description="pass as `after` for the next page; null at the end")


def refuse_non_utf8(request: Request) -> None:
    """``InvalidKey`` when ``prefix`` or ``after``, percent-decoded, is not UTF-8.

    The query is decoded with replacement characters, so ``%FF`` and ``%FE`` would both arrive
    as U+FFFD and filter alike: the raw query is checked instead, as ``objects.object_key``
    checks the raw path. latin-1 maps each byte to one character and back."""
    query = request.scope.get("query_string", b"")
    for name, value in parse_qsl(
        query.decode("latin-1"), keep_blank_values=True, encoding="latin-1"
    ):
        if name in KEY_PARAMETERS:
            decoded = value.encode("latin-1")
            try:
                decoded.decode()
            except UnicodeDecodeError:
                shown = decoded[:120]
                raise InvalidKey(f"{name} {shown!r} is not UTF-8 (once percent-decoded)") from None


def keys_router() -> APIRouter:
    router = APIRouter(tags=["objects"])

    @router.get("/v1/keys", response_model=KeyPage)
    async def keys(
        request: Request,
        prefix: Annotated[str, Query(max_length=4096)] = "",
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
        after: Annotated[str | None, Query(max_length=4096)] = None,
    ) -> KeyPage:
        """Keys starting with ``prefix``, sorted, after the cursor ``after``: the memory tier
        and every lower tier that can list, each key once. A listing's later pages come from
        a snapshot its first page (no ``after``) took, for up to 60 s."""
        refuse_non_utf8(request)
        listings = state_of(request).listings
        items, cursor = await listings.page(prefix, limit=limit, after=after)
        return KeyPage(keys=[KeyInfo(key=i.key, size=i.size) for i in items], next=cursor)

    return router
