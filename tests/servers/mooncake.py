"""Real Mooncake Store clusters on loopback: a ``mooncake_master`` plus a segment holder.

The master (with its built-in HTTP metadata server) keeps the metadata; a separate
``mooncake_client`` process contributes the memory (``-global_segment_size``). The connectors
under test contribute none (``global_segment_size=0``), so every object they write lives in
the holder's segment and crosses TCP both ways. TCP only: RDMA cannot be tested here (no RDMA
device on these machines).

The master's lease TTL is 2 s, not Mooncake's default 10 s: a delete must wait for the leases
that reads and existence checks take, and 2 s still covers a 256 MiB read on a busy 2-core
machine (with a shorter TTL large reads fail with LEASE_EXPIRED, the read having taken longer
than the lease that protected it: at 100 ms even 20 MiB reads do).

``mooncake_cluster``: one session-wide cluster whose 2 GiB segment holds the conformance
suite's 256 MiB objects and the old values of recent overwrites. ``mooncake_factory``:
clusters for one test (a small segment to fill).
Binaries come with the ``mooncake-transfer-engine-non-cuda`` wheel (into the venv's bin).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from servers.proc import ServerProcess, free_port, in_ci, port_open, require_binary

_HINT = "pip install mooncake-transfer-engine-non-cuda (and apt-get install libibverbs1)"
BIND = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
LEASE_TTL_MS = 2000


@dataclass
class MooncakeCluster:
    master: ServerProcess
    holder: ServerProcess
    rpc_port: int
    metadata_port: int
    metrics_port: int
    segment_size: int
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.rpc_port}"

    def stop(self) -> None:
        self.holder.stop()
        self.master.stop()


def require_mooncake() -> None:
    """Skip locally, fail in CI, when Mooncake's Python API cannot load (no wheel, or no
    libibverbs: the wheel's binaries and store module link it even for TCP)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        message = f"Mooncake's store module does not load: {exc} ({_HINT})"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)


def start_mooncake(log_dir: Path, *, segment_size: int = 2 << 30) -> MooncakeCluster:
    require_mooncake()
    master_bin = require_binary("mooncake_master", _HINT)
    holder_bin = require_binary("mooncake_client", _HINT)
    rpc, metadata, metrics, holder_port = (free_port() for _ in range(4))
    master = ServerProcess(
        [
            master_bin,
            f"-rpc_port={rpc}",
            "-rpc_address=127.0.0.1",
            "-enable_http_metadata_server=true",
            "-http_metadata_server_host=127.0.0.1",
            f"-http_metadata_server_port={metadata}",
            "-metrics_host=127.0.0.1",
            f"-metrics_port={metrics}",
            f"-default_kv_lease_ttl={LEASE_TTL_MS}",
            # An overwrite parks the old value's memory until this release timeout (600 s by
            # default; it must exceed the discard timeout of unfinished puts, 30 s): the
            # tests overwrite hundreds of MiB and would fill the segment for ten minutes.
            "-put_start_discard_timeout_sec=5",
            "-put_start_release_timeout_sec=10",
        ],
        ready=lambda: port_open(rpc) and port_open(metadata),
        log_path=log_dir / f"mooncake-master-{rpc}.log",
        env=BIND,
        cwd=log_dir,
    ).start()
    metadata_url = f"http://127.0.0.1:{metadata}/metadata"
    try:
        holder = ServerProcess(
            [
                holder_bin,
                "-host=127.0.0.1",
                f"-port={holder_port}",
                f"-master_server_address=127.0.0.1:{rpc}",
                f"-metadata_server={metadata_url}",
                f"-global_segment_size={segment_size}",
                "-protocol=tcp",
            ],
            ready=lambda: port_open(holder_port),
            log_path=log_dir / f"mooncake-holder-{holder_port}.log",
            env=BIND,
            cwd=log_dir,
        ).start()
    except BaseException:
        master.stop()
        raise
    return MooncakeCluster(
        master,
        holder,
        rpc,
        metadata,
        metrics,
        segment_size,
        options={"metadata_server": metadata_url, "timeout": 30.0},
    )


@pytest.fixture(scope="session")
def mooncake_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    """A session-wide master + 2 GiB segment holder; connectors take ``url`` and ``options``."""
    saved = os.environ.get("MC_TCP_BIND_ADDRESS")
    os.environ.update(BIND)  # for the transfer engines of the connectors in this process
    cluster = start_mooncake(tmp_path_factory.mktemp("mooncake"))
    try:
        yield cluster
    finally:
        cluster.stop()
        if saved is None:
            os.environ.pop("MC_TCP_BIND_ADDRESS", None)
        else:
            os.environ["MC_TCP_BIND_ADDRESS"] = saved


@pytest.fixture
def mooncake_factory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., MooncakeCluster]]:
    """Starts clusters for this test only (``start_mooncake``'s keywords); stops them all."""
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    started: list[MooncakeCluster] = []

    def start(*, segment_size: int = 2 << 30) -> MooncakeCluster:
        cluster = start_mooncake(tmp_path, segment_size=segment_size)
        started.append(cluster)
        return cluster

    try:
        yield start
    finally:
        for cluster in started:
            cluster.stop()
