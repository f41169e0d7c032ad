"""Throw-away TLS certificates for the test servers (Redis, Valkey), made with the openssl CLI."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from servers.proc import require_binary


@dataclass(frozen=True)
class Certificates:
    """A throw-away CA, a server certificate it signed (127.0.0.1/localhost) and a client one."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certificates(directory: Path) -> Certificates:
    """Certificates for a TLS test server (and a client, for mutual TLS), in ``directory``."""
    openssl = require_binary("openssl", "apt-get install openssl")
    directory.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca, ca_key = directory / "ca.crt", directory / "ca.key"
    subprocess.run(
        [openssl, "req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
         "-subj", "/CN=kvgate-test-ca"],
        check=True, capture_output=True,
    )  # fmt: skip
    signed = {}
    for name, usage, alt in (
        ("server", "serverAuth", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"),
        ("client", "clientAuth", ""),
    ):
        key, csr, cert = (directory / f"{name}.{ext}" for ext in ("key", "csr", "crt"))
        extfile = directory / f"{name}.ext"
        extfile.write_text(f"{alt}basicConstraints=CA:FALSE\nextendedKeyUsage={usage}\n")
        for argv in (
            [openssl, "req", *ec, "-keyout", key, "-out", csr, "-subj", f"/CN=kvgate-{name}"],
            [openssl, "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key,
             "-CAcreateserial", "-out", cert, "-days", "2", "-extfile", extfile],
        ):  # fmt: skip
            subprocess.run([str(a) for a in argv], check=True, capture_output=True)
        signed[name] = (cert, key)
    return Certificates(ca, *signed["server"], *signed["client"])
