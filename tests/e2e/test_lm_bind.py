"""lm:// has no authentication, so ``kvgate serve`` keeps it on loopback even when HTTP is
public behind a token; the kernel's socket table says where it really listens."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.serve import Kvgate, kvgate_serve

TOKEN = "e2e-lm-bind-token-4f1c"


def listening_addresses(port: int) -> set[str]:
    """The local addresses of sockets listening on ``port`` (IPv4 and IPv6), as the kernel's
    /proc/net/tcp{,6} tables list them (hex, host byte order for IPv4)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.add(address)
    return found


@pytest.fixture(scope="module")
def public_http_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kvgate]:
    root = tmp_path_factory.mktemp("e2e-lm-bind")
    config = root / "kvgate.yaml"
    config.write_text("tiers:\n  - url: memory://\n    capacity: 64MiB\nprefault: false\n")
    gateway = kvgate_serve(
        root,
        config=config,
        args=["--host", "0.0.0.0"],
        env={"KVGATE_TOKEN": TOKEN, "KVGATE_DATA_DIR": str(root / "data")},
    )
    try:
        yield gateway.start()
    finally:
        gateway.stop()
        shutil.rmtree(root / "data", ignore_errors=True)


def test_lm_stays_on_loopback_while_http_is_public(public_http_gateway: Kvgate) -> None:
    gateway = public_http_gateway
    assert listening_addresses(gateway.port) == {"00000000"}  # HTTP: 0.0.0.0, with a token
    assert listening_addresses(gateway.lm_port) == {"0100007F"}  # lm://: 127.0.0.1 only
    assert TOKEN not in gateway.log()
