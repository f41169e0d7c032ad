"""Bearer-token auth of the HTTP service, and ``kvgate serve``'s refusal to expose the cache.

Over a real socket (uvicorn on loopback); the CLI case runs the real command in a subprocess
with the token in its environment, and checks that the token never reaches its output.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from servers.asgi import serve
from servers.proc import free_port
from typer.testing import CliRunner

from gateway.cli.app import app as cli_app
from gateway.http.app import create_app

# Transports differ between asyncio's loop and uvloop (what `kvgate serve` runs on).
pytestmark = pytest.mark.both_loops

TOKEN = "s3cret-t0ken-for-tests"


@pytest_asyncio.fixture
async def base_url(tmp_path: Path) -> AsyncIterator[str]:
    app = create_app({"tiers": [{"url": "memory://", "capacity": 8 << 20}]}, token=TOKEN)
    async for url in serve(app):
        yield url


async def test_requests_without_the_token_are_refused(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url) as c:
        for headers in (
            {},
            {"authorization": "Bearer wrong"},
            {"authorization": f"Bearer {TOKEN}x"},
            {"authorization": f"Basic {TOKEN}"},
            {"authorization": TOKEN},
        ):
            for method, path in (
                ("PUT", "/v1/objects/k"),
                ("GET", "/v1/objects/k"),
                ("DELETE", "/v1/objects/k"),
                ("POST", "/v1/lookup"),
                ("POST", "/v1/exists"),
                ("POST", "/v1/batch/get"),
                ("POST", "/v1/batch/put"),
                ("POST", "/v1/flush"),
                ("GET", "/v1/tiers"),
                ("GET", "/metrics"),
            ):
                r = await c.request(method, path, headers=headers, content=b"x")
                assert r.status_code == 401, (method, path, headers)
                assert r.json()["error"] == "unauthorized"
                assert r.headers["www-authenticate"] == "Bearer"
                assert TOKEN not in r.text
        # Nothing was stored by the refused PUTs.
        auth = {"authorization": f"Bearer {TOKEN}"}
        assert (await c.get("/v1/objects/k", headers=auth)).status_code == 404


async def test_the_right_token_is_accepted_and_health_stays_open(base_url: str) -> None:
    auth = {"authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=base_url, headers=auth) as c:
        assert (await c.put("/v1/objects/k", content=b"v")).status_code == 204
        assert (await c.get("/v1/objects/k")).content == b"v"
        assert (await c.post("/v1/lookup", json={"keys": ["k"]})).json()["prefix"] == 1
        assert (await c.get("/metrics")).status_code == 200
    async with httpx.AsyncClient(base_url=base_url) as c:
        assert (await c.get("/healthz")).status_code == 200
        assert (await c.get("/readyz")).status_code == 200
        doc = (await c.get("/openapi.json")).json()
        assert "HTTPBearer" in doc["components"]["securitySchemes"]


def test_empty_token_is_not_a_token() -> None:
    with pytest.raises(ValueError, match="empty token"):
        create_app({"tiers": [{"url": "memory://"}]}, token="")


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "example.com"])
def test_cli_refuses_a_non_loopback_bind_without_a_token(
    host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVGATE_TOKEN", raising=False)
    result = CliRunner().invoke(cli_app, ["serve", "--host", host, "--port", "1"])
    assert result.exit_code == 2
    assert f"refusing to bind {host}" in result.output
    assert "token" in result.output


def test_cli_serves_with_the_token_from_the_environment(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "kvgate.yaml"
    config.write_text("tiers:\n  - url: 'memory://'\n    capacity: 8MiB\n")
    env = {**os.environ, "KVGATE_TOKEN": TOKEN}
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "serve",
                "-f",
                str(config),
                "--port",
                str(port),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90  # start-up: torch import, pool prefault (see e2e READY_S)
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "kvgate serve did not become ready"
            time.sleep(0.1)
        assert httpx.put(f"{base}/v1/objects/k", content=b"v").status_code == 401
        auth = {"authorization": f"Bearer {TOKEN}"}
        r = httpx.put(f"{base}/v1/objects/k", content=b"v", headers=auth)
        assert r.status_code == 204
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    text = log.read_text()
    assert "bearer token required" in text
    assert TOKEN not in text


def test_cli_logs_no_token_and_times_out_stalled_bodies(tmp_path: Path) -> None:
    """``kvgate serve`` as shipped, access log on: a token in a query string (any name) or in
    the Authorization header never reaches the log or an answer; a stalled body gets 408."""
    port = free_port()
    config = tmp_path / "kvgate.yaml"
    config.write_text("tiers:\n  - url: 'memory://'\n    capacity: 8MiB\n")
    env = {**os.environ, "KVGATE_TOKEN": TOKEN}
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "gateway.cli", "serve", "-f", str(config)]
    command += ["--port", str(port), "--log-level", "info", "--body-timeout", "0.5"]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    secret = "query-s3cret"
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_ready(base, proc, log)
        auth = {"authorization": f"Bearer {TOKEN}"}
        answers = [
            httpx.get(f"{base}/v1/objects/k?token={secret}", headers=auth),
            httpx.get(f"{base}/v1/objects/k?access_token={secret}&x=1", headers=auth),
            httpx.get(f"{base}/v1/objects/k?{secret}", headers=auth),
            httpx.get(f"{base}/v1/keys?prefix=p&api_key={secret}", headers=auth),
            httpx.get(f"{base}/v1/keys?limit=many", headers=auth),  # an error that would echo
            httpx.get(f"{base}/v1/objects/k?access_token={TOKEN}"),  # no header: refused
        ]
        assert [r.status_code for r in answers] == [404, 404, 404, 200, 400, 401]
        for r in answers:
            for word in (secret, TOKEN, "many"):
                assert word not in r.text
        head = (
            b"PUT /v1/objects/stalled HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
            b"Content-Length: 1000\r\n\r\n" % TOKEN.encode()
        )
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head + b"x" * 10)
            assert sock.recv(4096).startswith(b"HTTP/1.1 408 ")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    text = log.read_text()
    assert secret not in text
    assert TOKEN not in text
    # The requests were logged, their query strings redacted but for kvgate's own parameters.
    assert '"GET /v1/objects/k?<redacted> HTTP/1.1" 404' in text
    assert '"GET /v1/objects/k?<redacted>&<redacted> HTTP/1.1" 404' in text
    assert '"GET /v1/keys?prefix=p&<redacted> HTTP/1.1" 200' in text
    assert '"PUT /v1/objects/stalled HTTP/1.1" 408' in text


def _wait_ready(base: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 90  # start-up: torch import, pool prefault (see e2e READY_S)
    while True:
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "kvgate serve did not become ready"
        time.sleep(0.1)


@pytest.mark.parametrize("token", ["line\nbreak-S3CRET", "S3CRET-naïve", "two S3CRET"])
def test_a_token_no_client_could_send_is_refused_unshown(
    token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVGATE_TOKEN", raising=False)
    result = CliRunner().invoke(cli_app, ["serve", "--port", "1", "--token", token])
    assert result.exit_code == 2
    assert "visible ASCII" in result.output
    assert "S3CRET" not in result.output
    with pytest.raises(ValueError, match="visible ASCII"):
        create_app({"tiers": [{"url": "memory://"}]}, token=token)
