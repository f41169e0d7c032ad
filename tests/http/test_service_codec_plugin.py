"""Codec options over HTTP: a client sets only what a codec class lists in ``client_options``,
so a plugin codec whose options name files is never built from a client's options."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from plugin_dist import installed
from test_service import FRAME
from test_service_hostile import client  # noqa: F401  (the fixture: a service on loopback)


@pytest.fixture
def reading_codec(tmp_path: Path) -> Iterator[Path]:
    """An installed plugin codec ``filecodec`` whose option ``path`` makes it read a file
    when it is built (as a codec loading a table or a key from disk would)."""
    source = textwrap.dedent("""
        from serde.raw import RawCodec

        READ = []

        class FileCodec(RawCodec):
            name = "filecodec"

            def __init__(self, path=None, **options):
                super().__init__(**options)
                if path is not None:
                    with open(path, "rb") as f:
                        READ.append(f.read())
        """)
    entry = "[kvgate.serde]\nfilecodec = filecodec:FileCodec\n"
    with installed(tmp_path, "filecodec", {"filecodec": source}, entry) as where:
        yield where


def _asking(codec: str, options: dict[str, object]) -> dict[str, str]:
    return {"accept": FRAME, "x-kvgate-codec": codec, "x-kvgate-codec-options": json.dumps(options)}


async def test_a_plugin_codec_takes_no_options_from_a_client(
    reading_codec: Path,
    client: httpx.AsyncClient,  # noqa: F811
    tmp_path: Path,
) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"server-side secret")
    assert (await client.put("/v1/objects/o", content=b"x" * 64)).status_code == 204
    r = await client.get("/v1/objects/o", headers=_asking("filecodec", {"path": str(secret)}))
    assert r.status_code == 400
    assert "may not set 'path'" in r.json()["detail"]
    assert sys.modules["filecodec"].READ == []  # built from nothing the client named
    r = await client.get("/v1/objects/o", headers=_asking("filecodec", {}))
    assert r.status_code == 200  # the plugin with its defaults is fine


async def test_a_builtin_codec_takes_only_the_options_it_lists(
    client: httpx.AsyncClient,  # noqa: F811
) -> None:
    assert (await client.put("/v1/objects/o", content=b"x" * 64)).status_code == 204
    r = await client.get("/v1/objects/o", headers=_asking("zstd", {"level": 5}))
    assert r.status_code == 200
    r = await client.get("/v1/objects/o", headers=_asking("zstd", {"dictionary": "/etc/passwd"}))
    assert r.status_code == 400
    assert "may not set 'dictionary' (it may set level, threads)" in r.json()["detail"]
    r = await client.get("/v1/objects/o", headers=_asking("bytesplit+zstd", {"level": 1}))
    assert r.status_code == 400
    assert "a chain takes no options" in r.json()["detail"]
