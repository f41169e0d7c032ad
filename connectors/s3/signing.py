"""SigV4 payload hashes computed in a thread, not on the event loop.

SigV4 signs an S3 request's payload: botocore hashes the whole body with SHA-256 while it
signs the request, on the caller's thread, which for aiobotocore is the event loop. That is
15-20 ms of loop time per 32 MiB put here, during which no other request moves. botocore only
skips it (``UNSIGNED-PAYLOAD``) over HTTPS *and* with a request checksum header, which this
client does not send (``request_checksum_calculation="when_required"``: frames carry their own
checksum), so both plain HTTP and HTTPS puts sign their payloads.

Why not ``UNSIGNED-PAYLOAD`` instead: over plain HTTP the signature then no longer covers the
body, so anything on the path could replace an object's bytes undetected by S3. The frame's
own checksum (xxh3) does not help there, since whoever changes the bytes can recompute it. So
the payload stays signed, and only where the hash is computed changes:

- ``prehashed_body`` hashes the parts in a worker thread (``hashlib`` releases the GIL for
  large buffers) and returns a ``PartsBody`` that carries the hex digest;
- ``PrehashedS3SigV4Auth``, botocore's S3 SigV4 signer registered under its own name, uses a
  body's digest where botocore would hash the body, and otherwise does what botocore does;
- ``use_prehashed_signer`` makes a client choose that signer for ``PutObject`` and
  ``UploadPart`` (botocore's ``choose-signer`` event), the two calls that carry payloads.

Every other request is signed exactly as before.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import botocore.auth  # type: ignore[import-untyped]
import botocore.handlers  # type: ignore[import-untyped]

from connectors.parts_body import PartsBody
from gateway.thread_jobs import in_thread

SIGNER = "kvgate-s3v4"
SIGNED_OPERATIONS = ("PutObject", "UploadPart")
# Below this a body is hashed on the loop, as botocore does: a thread's round trip (~0.1 ms
# each way on a 2-core VM) costs more than hashing 256 KiB (~0.15 ms at ~1.7 GB/s).
THREAD_HASH_BYTES = 256 << 10


class HashedBody(PartsBody):
    """A ``PartsBody`` whose SHA-256 (hex) is known already."""

    def __init__(self, pieces: Sequence[memoryview], sha256_hex: str) -> None:
        super().__init__(pieces)
        self.sha256_hex = sha256_hex


class PrehashedS3SigV4Auth(botocore.auth.S3SigV4Auth):  # type: ignore[misc]
    """botocore's S3 SigV4 signer, taking the payload hash from a ``HashedBody``."""

    def payload(self, request: Any) -> str:
        body = request.body
        if (
            isinstance(body, HashedBody)
            and self._should_sha256_sign_payload(request)
            and not self._is_streaming_checksum_payload(request)
        ):
            return body.sha256_hex
        digest: str = super().payload(request)
        return digest


botocore.auth.AUTH_TYPE_MAPS.setdefault(SIGNER, PrehashedS3SigV4Auth)


def _choose_signer(**kwargs: Any) -> str | None:
    # Runs before botocore's own choice (a handler of the more specific event) and ends the
    # choosing when it answers: so it asks botocore's handler first, and stands in only for
    # plain S3 SigV4 (not for presigning, S3 Express, SigV4a or an unsigned client).
    chosen = botocore.handlers.set_operation_specific_signer(**kwargs)
    if chosen is None and kwargs.get("signature_version") == "s3v4":
        chosen = "s3v4"  # no operation-specific choice: the client's own signature version
    return SIGNER if chosen == "s3v4" else chosen


def use_prehashed_signer(client: Any) -> None:
    """Sign ``client``'s payload-carrying calls with ``PrehashedS3SigV4Auth``."""
    for operation in SIGNED_OPERATIONS:
        client.meta.events.register(f"choose-signer.s3.{operation}", _choose_signer)


def _threads() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="kvgate-sign")


_THREADS = _threads()


def _new_threads_after_fork() -> None:
    # A forked child inherits the executor but not its threads: jobs would never run.
    global _THREADS
    _THREADS = _threads()


os.register_at_fork(after_in_child=_new_threads_after_fork)


def sha256_hex(pieces: Sequence[memoryview]) -> str:
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return digest.hexdigest()


async def prehashed_body(pieces: Sequence[memoryview]) -> PartsBody:
    """The request body of ``pieces``, hashed in a thread first when it is large enough. A
    cancelled caller still waits for the hash, which reads its buffers."""
    size = sum(p.nbytes for p in pieces)
    if size < THREAD_HASH_BYTES:
        return PartsBody(pieces)
    digest = await in_thread(_THREADS, lambda: sha256_hex(pieces))
    return HashedBody(pieces, digest)
