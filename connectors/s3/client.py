"""One aioboto3 S3 client per connector: created on first use, reused by every call, closed once.

Creating a botocore client parses about a megabyte of JSON service models; that parse runs in
a worker thread before the client is built, so the event loop does not stall on it.
The first use also checks the bucket (``HEAD``; created when ``create_bucket`` is set), so a
wrong bucket or secret fails at once with a ``ConfigError`` instead of as a stream of misses.
A check that fails because S3 is down is tried again by the next call.

The client is tuned for kvgate rather than for general use:

- botocore retries once at most (``max_attempts``): the tier's retry layer owns retrying, and
  two nested retry loops would multiply the time a dead server costs;
- no CRC32 request/response checksums unless S3 requires one: every kvgate object carries its
  own checksum in its frame, and over plain HTTP SigV4 already hashes the whole payload;
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import aioboto3  # type: ignore[import-untyped]
from aiobotocore.config import AioConfig  # type: ignore[import-untyped]
from botocore.exceptions import ClientError  # type: ignore[import-untyped]

from connectors.s3.config import S3Options
from connectors.s3.errors import code_of, s3_errors, status_of
from connectors.s3.signing import use_prehashed_signer
from connectors.s3_access import Location
from gateway.errors import ConfigError, GatewayError

log = logging.getLogger(__name__)


def client_config(options: S3Options) -> Any:
    return AioConfig(
        connect_timeout=options.connect_timeout,
        read_timeout=options.read_timeout,
        max_pool_connections=options.max_pool_connections,
        retries={"total_max_attempts": options.max_attempts, "mode": "standard"},
        s3={"addressing_style": options.addressing_style},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )


def new_session(options: S3Options) -> Any:
    """An aioboto3 session with the given credentials, or botocore's chain without them."""
    secret = options.secret_access_key
    token = options.session_token
    region = options.region
    if region is None and options.endpoint_url is not None:
        region = "us-east-1"  # S3-compatible servers accept any region; botocore wants one
    return aioboto3.Session(
        aws_access_key_id=options.access_key_id,
        aws_secret_access_key=secret.get_secret_value() if secret is not None else None,
        aws_session_token=token.get_secret_value() if token is not None else None,
        region_name=region,
    )


def _load_models(session: Any) -> None:
    """Parse S3's service models into the session's loader cache (in a worker thread)."""
    with contextlib.suppress(Exception):  # only a warm-up: the client loads what is missing
        loader = session._session.get_component("data_loader")
        for kind in ("service-2", "endpoint-rule-set-1", "paginators-1"):
            loader.load_service_model("s3", kind)
        for name in ("partitions", "endpoints", "sdk-default-configuration", "_retry"):
            loader.load_data(name)


def _no_expect_continue(params: dict[str, Any], **_: Any) -> None:
    # botocore asks for "Expect: 100-continue" on every file-like body. The body is in memory
    # here, so waiting for the server's go-ahead buys nothing but costs a round trip a request.
    params.get("headers", {}).pop("Expect", None)


async def open_client(session: Any, options: S3Options, stack: contextlib.AsyncExitStack) -> Any:
    await asyncio.to_thread(_load_models, session)
    verify: bool | str = options.ca_bundle or options.verify_tls
    client = await stack.enter_async_context(
        session.client(
            "s3", endpoint_url=options.endpoint_url, config=client_config(options), verify=verify
        )
    )
    # After botocore's own handler, which sits on the same event.
    client.meta.events.register_last("before-call.s3", _no_expect_continue)
    use_prehashed_signer(client)  # payload hashes computed in a thread (signing.py)
    return client


Janitor = Callable[["S3Client"], Coroutine[Any, Any, None]]


class S3Client:
    """The connector's client, its bucket and options, its background aborts, and its
    janitor: a task started once the client is ready (the sweep of stale uploads) and
    cancelled by ``close``."""

    def __init__(
        self, location: Location, options: S3Options, where: str, janitor: Janitor | None = None
    ) -> None:
        self.bucket = location.bucket
        self.options = options
        self.where = where
        self.uploads: set[str] = set()
        """Ids of this connector's multipart uploads in progress (or being aborted)."""
        self._janitor = janitor
        self._janitor_task: asyncio.Task[None] | None = None
        self._client: Any = None
        self._checked = not (options.check_bucket or options.create_bucket)
        self._lock = asyncio.Lock()
        self._stack = contextlib.AsyncExitStack()
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False
        self.slots = asyncio.Semaphore(options.max_concurrency)
        """Part uploads and range reads in flight, across all calls of the connector."""

    async def get(self) -> Any:
        """The client, built and the bucket checked on the first call."""
        if self._client is not None and self._checked:
            return self._client
        async with self._lock:
            if self._closed:
                raise GatewayError(f"{self.where} is closed")
            with s3_errors(self.where, self.bucket):
                if self._client is None:
                    self._client = await open_client(
                        new_session(self.options), self.options, self._stack
                    )
                if not self._checked:
                    async with asyncio.timeout(self.options.request_timeout):
                        await self._check_bucket(self._client)
                    self._checked = True
            if self._janitor is not None and self._janitor_task is None:
                self._janitor_task = asyncio.ensure_future(self._janitor(self))
        return self._client

    async def _check_bucket(self, client: Any) -> None:
        try:
            await client.head_bucket(Bucket=self.bucket)
            return
        except ClientError as exc:
            if status_of(exc) != 404 and code_of(exc) not in ("NoSuchBucket", "404", "NotFound"):
                raise
        if not self.options.create_bucket:
            raise ConfigError(
                f"{self.where}: bucket {self.bucket!r} does not exist "
                "(create it, or set create_bucket=True)"
            )
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        region = self.options.region
        if region and region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            await client.create_bucket(**kwargs)
            log.info("%s: created bucket %r", self.where, self.bucket)
        except ClientError as exc:  # another process created it first: fine
            if code_of(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    def spawn(self, job: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``job`` in the background; ``close`` waits for it."""
        task = asyncio.ensure_future(job)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        async with self._lock:  # under the lock: a get() building the client has started it
            if self._janitor_task is not None:
                self._janitor_task.cancel()
                # wait, not await: a cancellation of close() itself must not be swallowed here
                await asyncio.wait([self._janitor_task])
            self._client = None
            await self._stack.aclose()
