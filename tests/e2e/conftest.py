"""The deployment every e2e test drives: one ``kvgate serve`` over memory -> file -> redis -> s3.

Session-wide, because starting it costs seconds; tests keep to their own keys. The restart test
SIGKILLs and restarts it on the same ports, so a test may rely only on what it put itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import pytest_asyncio
from servers.redis import RedisNode
from servers.s3 import S3Server

from e2e.deployment import Deployment, deploy

HTTP_TIMEOUT = 30.0


@pytest.fixture(scope="session")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisNode, s3_server: S3Server
) -> Iterator[Deployment]:
    yield from deploy(tmp_path_factory.mktemp("e2e"), redis_server, s3_server)


@pytest_asyncio.fixture
async def http(deployment: Deployment) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=deployment.gateway.url, timeout=HTTP_TIMEOUT) as client:
        yield client
