"""URL and options of the Mooncake Store connector.

``mooncake://MASTER_HOST[:RPC_PORT]`` names the cluster's ``mooncake_master`` (RPC port 50051 by
default); everything else is a keyword option, checked by ``MooncakeOptions`` (unknown options
are errors, so a tier's ``capacity``/``eviction`` is refused: Mooncake evicts on its own).

- ``metadata_server``: the transfer engine's metadata service, e.g. the master's built-in one
  ``http://HOST:8080/metadata`` (the default, on the master's host) or ``P2PHANDSHAKE``.
- ``local_hostname``: the address this process's transfer engine is reached at (127.0.0.1).
- ``protocol``: ``tcp`` (default) or ``rdma`` with ``device_name`` (e.g. ``mlx5_0``). RDMA is
  accepted but untested here: the test machines have no RDMA device.
- ``global_segment_size``: bytes of memory this process contributes to the cluster (0, the
  default: objects live in other processes' segments, e.g. a ``mooncake_client``).
- ``local_buffer_size``: bytes of staging memory registered with the transfer engine; every
  object passes through it, so it bounds the largest object (``max_object_size``) and the
  bytes in flight at once.
- ``timeout``: seconds one call may take, retries and waits included (a 256 MiB object at
  0.3 GB/s needs about 1 s).
- ``threads``: worker threads for the blocking Mooncake calls (calls in flight at once).
- ``replica_num`` / ``preferred_segment``: Mooncake's replication config for every put.
- ``namespace``: prefix of every Mooncake key this connector writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from connectors._options import StrictOptions, split_url
from gateway.config import redact_url
from gateway.errors import ConfigError

MiB = 1 << 20
GiB = 1 << 30
SCHEME = "mooncake"
DEFAULT_RPC_PORT = 50051
DEFAULT_METADATA_PORT = 8080


class MooncakeOptions(StrictOptions):
    metadata_server: str | None = Field(
        default=None, description="default: http://<master host>:8080/metadata"
    )
    local_hostname: str = "127.0.0.1"
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = Field(default="", description="RDMA device(s), e.g. mlx5_0")
    global_segment_size: int = Field(default=0, ge=0, description="bytes contributed")
    local_buffer_size: int = Field(default=512 * MiB, ge=MiB, description="staging bytes")
    timeout: float = Field(default=30.0, gt=0, description="seconds per call")
    threads: int = Field(default=4, ge=1, le=64, description="blocking calls in flight")
    replica_num: int = Field(default=1, ge=1)
    preferred_segment: str | None = None
    namespace: str = "kvgate/"

    @model_validator(mode="after")
    def _check(self) -> MooncakeOptions:
        if self.protocol == "rdma" and not self.device_name:
            raise ValueError("protocol 'rdma' needs device_name (e.g. 'mlx5_0')")
        if self.protocol == "tcp" and self.device_name:
            raise ValueError("device_name is for protocol 'rdma' only")
        return self


@dataclass(frozen=True, slots=True)
class Target:
    """Where the URL and options point: the master and the metadata service."""

    master: str  # host:port of mooncake_master's RPC service
    metadata_server: str
    shown: str  # the URL as it may appear in messages


def resolve(url: str, options: MooncakeOptions) -> Target:
    parts = split_url(url, SCHEME)
    shown = redact_url(url)
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"{shown}: mooncake:// takes no credentials")
    if parts.path not in ("", "/"):
        raise ConfigError(f"{shown}: expected mooncake://master-host[:rpc-port], no path")
    host = parts.hostname
    if not host:
        raise ConfigError(f"{shown}: the URL names no master host")
    try:
        port = parts.port or DEFAULT_RPC_PORT
    except ValueError:
        raise ConfigError(f"{shown}: bad port") from None
    address = f"[{host}]" if ":" in host else host
    metadata = options.metadata_server
    if metadata is None:
        metadata = f"http://{address}:{DEFAULT_METADATA_PORT}/metadata"
    return Target(master=f"{address}:{port}", metadata_server=metadata, shown=shown)
