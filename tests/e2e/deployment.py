"""compose.yaml's topology as processes: ``kvgate serve`` over memory -> file -> redis -> s3.

Redis and SeaweedFS are the session's servers (``tests/servers``); this deployment keeps to
its own Redis namespace and S3 prefix, so it shares them with every other test. ``redis_keys``
and ``s3_names`` read the backends directly, around the gateway, to see what got there.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from servers.redis import RedisNode
from servers.s3 import S3Server

from connectors.object_names import Naming
from e2e.serve import Kvgate, kvgate_serve


@dataclass
class Deployment:
    gateway: Kvgate
    redis: RedisNode
    s3: S3Server
    namespace: str
    """The Redis connector's namespace: an object's main key is ``{namespace}o:{key}``."""
    prefix: str
    """The S3 tier's prefix in the bucket (no trailing slash)."""
    data_dir: Path

    def redis_keys(self) -> set[bytes]:
        with self.redis.client() as client:
            return set(client.scan_iter(match=f"{self.namespace}*", count=1000))

    def redis_main_key(self, key: str) -> bytes:
        return f"{self.namespace}o:{key}".encode()

    def s3_names(self) -> set[str]:
        client = self.s3.client()
        try:
            pages = client.get_paginator("list_objects_v2").paginate(
                Bucket=self.s3.bucket, Prefix=f"{self.prefix}/"
            )
            return {item["Key"] for page in pages for item in page.get("Contents", [])}
        finally:
            client.close()

    def s3_name(self, key: str) -> str:
        """The object name the S3 tier gives ``key`` (the connector's own naming)."""
        return Naming(f"{self.prefix}/").object_name(key)


def tiers(root: Path, redis: RedisNode, s3: S3Server, namespace: str, prefix: str) -> list[Any]:
    """compose.yaml's tier list (same order, evictions and timeouts) on loopback servers."""
    return [
        {"url": "memory://", "capacity": "64MiB", "eviction": "lru"},
        {"url": f"file://{root / 'data'}", "capacity": "1GiB", "eviction": "lru"},
        {"url": redis.url, "timeout": 5.0, "options": {"namespace": namespace}},
        {"url": s3.url(prefix), "timeout": 30.0, "options": s3.options()},
    ]


def deploy(root: Path, redis: RedisNode, s3: S3Server) -> Iterator[Deployment]:
    """Write the config, start ``kvgate serve`` on it; stop it and remove its data at the end."""
    tag = uuid.uuid4().hex[:8]
    namespace, prefix = f"e2e-{tag}:", f"e2e-{tag}"
    config = root / "kvgate.yaml"
    config.write_text(yaml.safe_dump({"tiers": tiers(root, redis, s3, namespace, prefix)}))
    gateway = kvgate_serve(root, config=config)
    try:
        gateway.start()
        yield Deployment(gateway, redis, s3, namespace, prefix, root / "data")
    finally:
        gateway.stop()
        shutil.rmtree(root / "data", ignore_errors=True)
