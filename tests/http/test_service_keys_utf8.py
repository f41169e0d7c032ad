"""``GET /v1/keys``' ``prefix`` and ``after`` whose percent-decoded bytes are not UTF-8 are
refused like such a key in an object's path (400 ``invalid_key``): decoded with replacement
characters, ``%FF`` and ``%FE`` would both filter as U+FFFD."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest_asyncio
from servers.asgi import serve
from test_service import store_config

from gateway.http.app import create_app


@pytest_asyncio.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(store_config(tmp_path), max_body=1 << 20, body_pool=0)
    async for url in serve(app):
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            yield c


async def test_a_prefix_or_cursor_that_is_not_utf8_is_an_invalid_key(
    client: httpx.AsyncClient,
) -> None:
    for query in ("prefix=%FF", "prefix=k%FE", "prefix=%C0%80", "after=%FF", "prefix=a&after=k%FF"):
        r = await client.get(f"/v1/keys?{query}")
        assert r.status_code == 400, (query, r.status_code, r.text)
        assert r.json()["error"] == "invalid_key", query
        assert "not UTF-8" in r.json()["detail"], query


async def test_a_percent_encoded_utf8_prefix_still_lists(client: httpx.AsyncClient) -> None:
    assert (await client.put("/v1/objects/%C3%A9t%C3%A9", content=b"x")).status_code == 204
    assert (await client.put("/v1/objects/a b", content=b"x")).status_code == 204
    for query, keys in (
        ("prefix=%C3%A9", ["été"]),
        ("prefix=a+b", ["a b"]),  # a query's + is a space, as before
        ("prefix=a%20", ["a b"]),
        ("prefix=&other=%FF", ["a b", "été"]),  # another parameter is not the listing's
    ):
        r = await client.get(f"/v1/keys?{query}")
        assert r.status_code == 200, (query, r.text)
        assert [k["key"] for k in r.json()["keys"]] == keys, query
