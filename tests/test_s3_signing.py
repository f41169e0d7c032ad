"""S3 payload signing off the event loop (``connectors.s3.signing``), against SeaweedFS.

A put's body is hashed in a thread before the request, and the signer takes that hash
instead of reading the body again on the loop.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from typing import Any

import pytest
from botocore.auth import UNSIGNED_PAYLOAD  # type: ignore[import-untyped]
from botocore.awsrequest import AWSRequest  # type: ignore[import-untyped]
from botocore.credentials import Credentials  # type: ignore[import-untyped]
from servers.s3 import S3Server

from connectors.parts_body import PartsBody
from connectors.s3 import S3Connector
from connectors.s3.signing import (
    THREAD_HASH_BYTES,
    HashedBody,
    PrehashedS3SigV4Auth,
    prehashed_body,
)

MiB = 1 << 20


def _views(*sizes: int) -> list[memoryview]:
    return [memoryview(os.urandom(n)) for n in sizes]


async def test_large_signed_bodies_carry_their_sha256() -> None:
    pieces = _views(100, 3 * MiB, 7)
    body = await prehashed_body(pieces)
    assert isinstance(body, HashedBody)
    assert body.sha256_hex == hashlib.sha256(b"".join(pieces)).hexdigest()


async def test_small_bodies_are_left_to_botocore() -> None:
    body = await prehashed_body(_views(THREAD_HASH_BYTES - 1))
    assert not isinstance(body, HashedBody)
    assert isinstance(body, PartsBody)


def _sign(url: str, body: Any) -> str:
    request = AWSRequest(method="PUT", url=url, data=body, headers={})
    request.context["timestamp"] = "20260101T000000Z"
    auth = PrehashedS3SigV4Auth(Credentials("AKID", "SECRET"), "s3", "us-east-1")
    auth.add_auth(request)
    return str(request.headers["X-Amz-Content-SHA256"])


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/b/k", "https://s3.example/b/k"])
def test_the_signer_takes_the_precomputed_hash_and_reads_nothing(url: str) -> None:
    # A stand-in digest that is not the body's: the signer must use it as it is, which shows
    # that it did not hash the body again (on the caller's thread, the event loop). Over
    # HTTPS too: without a checksum header botocore signs S3 payloads there as well.
    body = HashedBody(_views(MiB), "ab" * 32)
    assert _sign(url, body) == "ab" * 32
    assert body.tell() == 0


def test_the_signer_hashes_other_bodies_itself() -> None:
    data = os.urandom(1000)
    assert _sign("http://127.0.0.1:9/b/k", PartsBody([memoryview(data)])) == (
        hashlib.sha256(data).hexdigest()
    )


def test_an_unsigned_payload_stays_unsigned() -> None:
    # HTTPS, a checksum header and a streaming input: botocore sends UNSIGNED-PAYLOAD, and
    # so does this signer, whatever digest the body carries.
    request = AWSRequest(
        method="PUT",
        url="https://s3.example/b/k",
        data=HashedBody(_views(10), "ab" * 32),
        headers={"Content-MD5": "x"},
    )
    request.context["timestamp"] = "20260101T000000Z"
    request.context["has_streaming_input"] = True
    PrehashedS3SigV4Auth(Credentials("AKID", "SECRET"), "s3", "us-east-1").add_auth(request)
    assert request.headers["X-Amz-Content-SHA256"] == UNSIGNED_PAYLOAD


@pytest.mark.parametrize("size", [3 * MiB, 12 * MiB])  # one PutObject; a multipart upload
async def test_puts_send_the_sha256_of_what_they_send(s3_server: S3Server, size: int) -> None:
    conn = S3Connector.from_url(
        s3_server.url(f"sign-{uuid.uuid4().hex[:8]}"),
        **s3_server.options(multipart_threshold=5 * MiB, part_size=5 * MiB),
    )
    sent: list[tuple[str, bytes]] = []

    def record(request: Any, **_: Any) -> None:
        body = request.body
        if isinstance(body, PartsBody):
            body.seek(0)
            data = b"".join(bytes(body.read(MiB)) for _ in range(-(-len(body) // MiB)))
            body.seek(0)
            sent.append((request.headers["X-Amz-Content-SHA256"], data))

    try:
        client = await conn._client.get()
        client.meta.events.register("before-send.s3", record)
        data = os.urandom(size)
        await conn.put("k", [memoryview(data)])
        got = await conn.get("k")
        assert got is not None
        assert bytes(got) == data
        assert sent, "no request carried a body"
        for declared, body in sent:
            declared = declared.decode() if isinstance(declared, bytes) else declared
            assert declared == hashlib.sha256(body).hexdigest()
        assert sum(len(body) for _, body in sent) == size
        await conn.delete("k")
    finally:
        await conn.close()
