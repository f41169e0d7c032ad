"""Real Redis servers on loopback: standalone (TCP, TLS, unix socket, password), Cluster, Sentinel.

Every server is Debian's ``redis-server`` (7.0) started with no persistence in a directory of
the test's temp dir; ``redis-cli`` builds the cluster. Session fixtures are shared by the tests
(each test uses its own key prefix); tests that kill, fill or fail over a server make their own
with ``redis_factory`` / ``sentinel_factory``, which stop everything they started.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from servers.proc import ServerProcess, free_port, port_open, require_binary
from servers.tls import Certificates, make_certificates

HINT = "apt-get install redis-server redis-tools"
PASSWORD = "kvgate-test-pa55word"
SERVICE = "mymaster"
BASE_ARGS = ("--save", "", "--appendonly", "no", "--protected-mode", "no")
# Full syncs start at once (the default waits 5 s for more replicas to join).
QUICK_SYNC = ("--repl-diskless-sync-delay", "0")
__all__ = [  # the fixtures, for tests/conftest.py
    "redis_auth_server",
    "redis_cluster",
    "redis_factory",
    "redis_sentinel",
    "redis_server",
    "redis_tls_server",
    "redis_unix_server",
    "sentinel_factory",
]


def redis_binaries() -> tuple[str, str]:
    return require_binary("redis-server", HINT), require_binary("redis-cli", HINT)


def _answers(path: str | None, port: int) -> bool:
    """The server accepts connections (on its unix socket, or its TCP port)."""
    if path is None:
        return port_open(port)
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(0.2)
            s.connect(path)
        return True
    except OSError:
        return False


@dataclass
class RedisNode:
    """One redis-server process; ``cli`` runs redis-cli against it."""

    directory: Path
    port: int  # 0: no TCP port (unix socket only)
    unix_path: str | None = None
    tls: Certificates | None = None
    password: str | None = None
    proc: ServerProcess | None = None

    @property
    def url(self) -> str:
        """The connector URL (without the password, which tests pass as they test it)."""
        if self.unix_path is not None:
            return f"unix://{self.unix_path}"
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"ssl_ca_certs": str(self.tls.ca)} if self.tls else {}
        if self.password:
            opts["password"] = self.password
        return opts

    def cli(self, *args: str, check: bool = True) -> str:
        _, cli = redis_binaries()
        argv = [cli, "--no-auth-warning"]
        if self.unix_path is not None:
            argv += ["-s", self.unix_path]
        else:
            argv += ["-h", "127.0.0.1", "-p", str(self.port)]
        if self.tls is not None:
            argv += ["--tls", "--cacert", str(self.tls.ca)]
        if self.password:
            argv += ["-a", self.password]
        out = subprocess.run(
            [*argv, *args], check=check, capture_output=True, timeout=30, text=True
        )
        return out.stdout.strip()

    def client(self) -> Any:
        """A plain synchronous redis-py client, for reaching around the connector."""
        import redis

        if self.unix_path is not None:
            return redis.Redis(unix_socket_path=self.unix_path, password=self.password)
        tls: dict[str, Any] = {}
        if self.tls is not None:
            tls = {"ssl": True, "ssl_ca_certs": str(self.tls.ca)}
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, **tls)

    def start(self) -> RedisNode:
        """Start (or restart on the same port) and check that the server answering there is
        ours: a port freed by ``kill`` can be taken by another test's server meanwhile."""
        assert self.proc is not None
        self.proc.start()
        proc = self.proc.proc
        info = self.cli("info", "server", check=False)
        if proc is None or f"process_id:{proc.pid}" not in info:
            self.stop()
            raise RuntimeError(f"another process answers on {self.url}; the port was taken")
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def start_redis(
    directory: Path,
    *,
    unix: bool = False,
    tls: Certificates | None = None,
    password: str | None = None,
    extra: Sequence[str] = (),
    port: int | None = None,
) -> RedisNode:
    """Start one redis-server in ``directory`` (made if absent)."""
    server, _ = redis_binaries()
    directory.mkdir(parents=True, exist_ok=True)
    argv = [server, *BASE_ARGS, "--dir", str(directory), "--bind", "127.0.0.1"]
    unix_path = str(directory / "redis.sock") if unix else None
    if unix_path is not None:
        if len(unix_path) > 100:
            pytest.skip(f"unix socket path too long: {unix_path}")
        argv += ["--unixsocket", unix_path, "--unixsocketperm", "700", "--port", "0"]
        port = 0
    else:
        port = port or free_port()
        if tls is not None:
            argv += ["--port", "0", "--tls-port", str(port)]
            argv += ["--tls-cert-file", str(tls.server_cert), "--tls-key-file", str(tls.server_key)]
            argv += ["--tls-ca-cert-file", str(tls.ca), "--tls-auth-clients", "no"]
        else:
            argv += ["--port", str(port)]
    if password:
        argv += ["--requirepass", password]
    argv += list(extra)
    node = RedisNode(directory, port, unix_path, tls, password)
    node.proc = ServerProcess(
        argv,
        ready=lambda: _answers(unix_path, port),
        log_path=directory / "redis.log",
        cwd=directory,
    )
    return node.start()


# -- cluster --------------------------------------------------------------------------------


@dataclass
class RedisClusterGroup:
    nodes: list[RedisNode]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def start_cluster(directory: Path, size: int = 3) -> RedisClusterGroup:
    _, cli = redis_binaries()
    group = RedisClusterGroup([])
    try:
        for i in range(size):
            port = free_port(also_free=(10000,))
            d = directory / f"node{i}"
            extra = ["--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf")]
            extra += ["--cluster-node-timeout", "2000"]
            group.nodes.append(start_redis(d, port=port, extra=extra))
        addresses = [f"127.0.0.1:{n.port}" for n in group.nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        wait_for(
            lambda: all("cluster_state:ok" in n.cli("cluster", "info") for n in group.nodes),
            "cluster_state:ok on every node",
        )
    except BaseException:
        group.stop()
        raise
    return group


# -- sentinel -------------------------------------------------------------------------------


@dataclass
class SentinelGroup:
    """A master, one replica and one sentinel watching them as ``mymaster``."""

    master: RedisNode
    replica: RedisNode
    sentinel: RedisNode
    nodes: list[RedisNode] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{SERVICE}/0"

    def master_port(self) -> int:
        addr = self.sentinel.cli("sentinel", "get-master-addr-by-name", SERVICE).split()
        return int(addr[1])

    def stop(self) -> None:
        for node in reversed(self.nodes):  # the sentinel first, then the data nodes
            node.stop()

    def add_replica(self, directory: Path) -> RedisNode:
        """A new replica of the current master (on a new port), stopped with the group."""
        replica = start_redis(
            directory, extra=[*QUICK_SYNC, "--replicaof", "127.0.0.1", str(self.master_port())]
        )
        self.nodes.insert(0, replica)
        wait_for(
            lambda: "master_link_status:up" in replica.cli("info", "replication"),
            "the new replica in sync",
        )
        return replica


def start_sentinel_group(directory: Path, down_after_ms: int = 500) -> SentinelGroup:
    """``down_after_ms``: how long the master may not answer before it is failed over."""
    quick_sync = list(QUICK_SYNC)
    master = start_redis(directory / "master", extra=quick_sync)
    nodes = [master]
    try:
        replica = start_redis(
            directory / "replica",
            extra=[*quick_sync, "--replicaof", "127.0.0.1", str(master.port)],
        )
        nodes.append(replica)
        wait_for(
            lambda: "master_link_status:up" in replica.cli("info", "replication"),
            "the replica in sync",
        )
        sdir = directory / "sentinel"
        sdir.mkdir(parents=True)
        sport = free_port()
        conf = sdir / "sentinel.conf"  # sentinel rewrites its conf: it must be writable
        conf.write_text(
            f"port {sport}\nbind 127.0.0.1\nprotected-mode no\ndir {sdir}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {master.port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} 2000\n"
        )
        server, _ = redis_binaries()
        sentinel = RedisNode(sdir, sport)
        sentinel.proc = ServerProcess(
            [server, str(conf), "--sentinel"],
            ready=lambda: port_open(sport),
            log_path=sdir / "sentinel.log",
            cwd=sdir,
        )
        sentinel.start()
        nodes.append(sentinel)
        wait_for(
            lambda: str(replica.port) in sentinel.cli("sentinel", "replicas", SERVICE),
            "the sentinel to see the replica",
        )
    except BaseException:
        for node in reversed(nodes):
            node.stop()
        raise
    return SentinelGroup(master, replica, sentinel, nodes)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except subprocess.SubprocessError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisNode]:
    node = start_redis(tmp_path_factory.mktemp("redis"))
    yield node
    node.stop()


@pytest.fixture(scope="session")
def redis_unix_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisNode]:
    node = start_redis(tmp_path_factory.mktemp("redis-unix"), unix=True)
    yield node
    node.stop()


@pytest.fixture(scope="session")
def redis_tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisNode]:
    directory = tmp_path_factory.mktemp("redis-tls")
    node = start_redis(directory, tls=make_certificates(directory / "tls"))
    yield node
    node.stop()


@pytest.fixture(scope="session")
def redis_auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisNode]:
    node = start_redis(tmp_path_factory.mktemp("redis-auth"), password=PASSWORD)
    yield node
    node.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterGroup]:
    group = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield group
    group.stop()


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    # Shared by many tests on a busy machine: no failover for a master slowed down by load.
    group = start_sentinel_group(tmp_path_factory.mktemp("redis-sentinel"), down_after_ms=10_000)
    yield group
    group.stop()


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[Callable[..., RedisNode]]:
    """Start servers of the test's own (``start_redis`` keywords); all stopped at the end."""
    started: list[RedisNode] = []

    def make(**kwargs: Any) -> RedisNode:
        node = start_redis(tmp_path / f"redis{len(started)}", **kwargs)
        started.append(node)
        return node

    yield make
    for node in started:
        node.stop()


@pytest.fixture
def sentinel_factory(tmp_path: Path) -> Iterator[Callable[[], SentinelGroup]]:
    """Start a sentinel group of the test's own; stopped at the end."""
    started: list[SentinelGroup] = []

    def make() -> SentinelGroup:
        group = start_sentinel_group(tmp_path / f"sentinel{len(started)}")
        started.append(group)
        return group

    yield make
    for group in started:
        group.stop()
