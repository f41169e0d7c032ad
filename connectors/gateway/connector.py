"""The ``gateway://`` connector: ``GatewayConnector``, an HTTP client of another kvgate.

One ``httpx.AsyncClient`` (HTTP/1.1, a bounded keep-alive pool) per connector. Every request
has a deadline (``timeout``, around the whole call) and goes through ``errors.py``'s one map.

- put: a frame goes with ``Content-Type: application/vnd.kvgate.frame``, streamed from the
  tier's scatter list with an explicit length (no join); anything else goes as opaque bytes
  (``wire.py``), and so does a frame the remote refuses as corrupt or cannot decode. A
  durable put's write (``durable_write()``) asks the remote for one too (``x-kvgate-durable``),
  so the promise holds through a chain of gateways, and the chunk's start position
  (``write_position()``) goes with a frame as ``x-kvgate-position``: the remote decodes the
  frame and encodes the object again with its own tiers' codecs, which may use it (``kvtc``).
- get: ``Accept: application/vnd.kvgate.frame`` with ``x-kvgate-codec`` (the ``codec`` option,
  raw by default): the frame comes back as the remote encoded it; 404 is a miss.
- exists is HEAD, exists_many one ``POST /v1/exists`` (per-key HEADs against a remote that
  lacks the route), delete is DELETE. ``list`` is unsupported (``capabilities.list`` is False):
  the remote's ``GET /v1/keys`` reports the sizes of its own objects, not of the frames this
  tier wrote, and keys this connector escaped would come back escaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, ClassVar, Self

import httpx

from connectors.gateway import wire
from connectors.gateway.config import Endpoint, GatewayOptions, parse, tls_verify
from connectors.gateway.errors import error_for, remote_kind, transport_errors
from gateway.connector import BaseConnector, as_parts, durable_write, write_position
from gateway.errors import GatewayError, InvalidKey
from gateway.inflight import InFlight
from gateway.keys import MAX_KEY_BYTES
from gateway.tiers import offload
from gateway.types import Buffer, BufferParts, Capabilities

# Answers the remote gives for a frame it will not store as a frame: corrupt, or a codec or
# media type it does not know (415). The bytes then go as opaque bytes instead.
_REFUSED_FRAME = {"bad_request", "corrupt", "unsupported", "missing_dependency"}


class GatewayConnector(BaseConnector):
    scheme: ClassVar[str] = "gateway"
    # batch: exists_many is one POST /v1/exists
    capabilities = Capabilities(batch=True, persistent=True, max_key_length=MAX_KEY_BYTES)

    def __init__(self, url: str, **options: Any) -> None:
        self.endpoint, self.options = parse(url, options)
        self.scheme = self.endpoint.scheme  # type: ignore[misc]  # gateway or gateways
        self.batch_concurrency = self.options.batch_concurrency
        self._client = _new_client(self.endpoint, self.options)
        self._get_headers = {
            "accept": wire.FRAME_TYPE,
            "x-kvgate-codec": self.options.codec,
        }
        if self.options.codec_options:
            self._get_headers["x-kvgate-codec-options"] = json.dumps(self.options.codec_options)
        self._in_flight = InFlight()
        self._batch_exists = True  # POST /v1/exists, until the remote says it has no such route
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        return cls(url, **options)

    def __repr__(self) -> str:
        return (
            f"GatewayConnector({self.endpoint.scheme}://{self.endpoint.base_url.split('://')[1]})"
        )

    @contextlib.contextmanager
    def _op(self, what: str) -> Iterator[str]:
        if self._closed:
            raise GatewayError(f"{self!r} is closed")
        with self._in_flight.track(), transport_errors(f"{self!r} {what}"):
            yield f"{self!r} {what}"

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        # The deadline covers the whole call: connect, pool wait, upload and the full body.
        async with asyncio.timeout(self.options.timeout):
            return await self._client.request(method, path, **kwargs)

    # -- reads -------------------------------------------------------------------------------

    async def get(self, key: str) -> Buffer | None:
        remote = _remote(key)
        if remote is None:
            return None
        with self._op("GET") as where:
            response = await self._request(
                "GET", wire.object_path(remote), headers=self._get_headers
            )
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise error_for(response, where)
        blob = response.content
        if not response.headers.get("content-type", "").startswith(wire.FRAME_TYPE):
            return wire.unwrap_plain(blob)  # a service that answers with the plain payload
        return await offload(len(blob), wire.unwrap, blob)

    async def exists(self, key: str) -> bool:
        remote = _remote(key)
        if remote is None:
            return False
        with self._op("HEAD") as where:
            response = await self._request("HEAD", wire.object_path(remote))
        if response.status_code in (200, 204):
            return True
        if response.status_code == 404:
            return False
        raise error_for(response, where)

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """``POST /v1/exists``: one request per ``wire.MAX_BATCH_KEYS`` keys. A remote
        without the route (an older kvgate: 404 or 405) gets one HEAD per key instead, from
        then on."""
        remotes = [_remote(k) for k in keys]
        asked = [r for r in remotes if r is not None]
        if not self._batch_exists or not asked:
            return await super().exists_many(keys)
        answers: list[bool] = []
        for start in range(0, len(asked), wire.MAX_BATCH_KEYS):
            chunk = asked[start : start + wire.MAX_BATCH_KEYS]
            with self._op("POST /v1/exists") as where:
                response = await self._request("POST", "/v1/exists", json={"keys": chunk})
            if response.status_code in (404, 405):
                self._batch_exists = False
                return await super().exists_many(keys)
            if response.status_code != 200:
                raise error_for(response, where)
            answers += wire.exists_answer(response.content, len(chunk), where)
        found = iter(answers)
        return [r is not None and next(found) for r in remotes]

    # -- writes ------------------------------------------------------------------------------

    async def put(self, key: str, data: BufferParts) -> None:
        remote = _remote(key)
        if remote is None:
            raise InvalidKey(f"{self!r}: the key does not fit the remote's {MAX_KEY_BYTES} bytes")
        parts = as_parts(data)
        total = sum(p.nbytes for p in parts)
        if wire.is_frame(parts, total):
            try:
                await self._put(remote, parts, total, wire.FRAME_TYPE)
                return
            except _Refused:
                pass  # not a frame the remote can store: keep the bytes as they are
        await self._put(remote, [memoryview(wire.OPAQUE), *parts], total + len(wire.OPAQUE))

    async def _put(
        self, remote: str, parts: list[memoryview], total: int, media: str = wire.BYTES_TYPE
    ) -> None:
        headers = {"content-type": media, "content-length": str(total)}
        if durable_write():  # a durable put: the remote writes all its tiers before answering
            headers["x-kvgate-durable"] = "true"
        position = write_position()
        if position is not None and media == wire.FRAME_TYPE:  # its codecs re-encode the object
            headers["x-kvgate-position"] = str(position)
        with self._op("PUT") as where:
            response = await self._request(
                "PUT", wire.object_path(remote), content=_stream(parts), headers=headers
            )
        if response.status_code in (200, 201, 204):
            return
        error = error_for(response, where)
        if media == wire.FRAME_TYPE and (
            remote_kind(response) in _REFUSED_FRAME or response.status_code == 415
        ):
            raise _Refused(str(error))
        raise error

    async def delete(self, key: str) -> bool:
        remote = _remote(key)
        if remote is None:
            return False
        with self._op("DELETE") as where:
            response = await self._request("DELETE", wire.object_path(remote))
        if response.status_code in (200, 204):
            return True
        if response.status_code == 404:
            return False
        raise error_for(response, where)

    # -- lifecycle ---------------------------------------------------------------------------

    async def ping(self) -> bool:
        with self._op("GET /healthz") as where:
            response = await self._request("GET", "/healthz")
        if response.status_code != 200:
            raise error_for(response, where)
        return True

    async def close(self) -> None:
        """Wait for requests in flight, then close the pool. Idempotent."""
        self._closed = True
        await self._in_flight.wait_idle()
        await self._client.aclose()


class _Refused(GatewayError):
    """The remote would not take these bytes as a frame (corrupt, or an unknown codec)."""


def _remote(key: str) -> str | None:
    if not key:
        raise InvalidKey("a key must not be empty")
    return wire.remote_key(key)


async def _stream(parts: Sequence[memoryview]) -> AsyncIterator[bytes]:
    # A fresh generator per request: a retried put streams the parts again.
    for part in parts:
        if part.nbytes:
            yield part  # type: ignore[misc]  # h11 writes any bytes-like object


def _new_client(endpoint: Endpoint, opts: GatewayOptions) -> httpx.AsyncClient:
    headers = {"user-agent": "kvgate-gateway-connector"}
    if opts.token is not None:
        headers["authorization"] = f"Bearer {opts.token.get_secret_value()}"
    limits = httpx.Limits(
        max_connections=opts.max_connections, max_keepalive_connections=opts.max_connections
    )
    timeout = httpx.Timeout(opts.timeout, connect=opts.connect_timeout)
    return httpx.AsyncClient(
        base_url=endpoint.base_url,
        headers=headers,
        limits=limits,
        timeout=timeout,
        verify=tls_verify(opts) if endpoint.tls else True,
        http1=True,
        http2=False,
        follow_redirects=False,
    )
