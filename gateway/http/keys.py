"""``GET /v1/keys``: the store's keys, sorted and paginated (what ``kvgate ls`` reads)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from gateway.http.state import state_of
from gateway.listing import MAX_PAGE


class KeyInfo(BaseModel):
    key: str
    size: int = Field(description="bytes in the fastest tier holding it")


class KeyPage(BaseModel):
    keys: list[KeyInfo]
    next: str | None = Field(description="pass as `after` for the next page; null at the end")


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
        listings = state_of(request).listings
        items, cursor = await listings.page(prefix, limit=limit, after=after)
        return KeyPage(keys=[KeyInfo(key=i.key, size=i.size) for i in items], next=cursor)

    return router
