"""compose.yaml and the Dockerfile, checked offline (no Docker engine runs here).

Debian's ``docker-compose`` validates the file (interpolation, schema, profiles); the rest
loads the YAML and checks what the deployment promises: the services and their healthchecks,
the bucket made before kvgate starts, the profiles, and kvgate's tier order, validated by
kvgate's own config loader.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from servers.proc import require_binary

from gateway.config import load_config

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
HINT = "apt-get install -y docker-compose"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = compose["services"]
    return out


def tiers_of(service: dict[str, Any]) -> list[dict[str, Any]]:
    tiers: list[dict[str, Any]] = json.loads(service["environment"]["KVGATE_TIERS"])
    return tiers


def run_compose(*args: str, token: str | None = "test-token") -> subprocess.CompletedProcess[str]:
    binary = require_binary("docker-compose", HINT)
    env = {k: v for k, v in os.environ.items() if k != "KVGATE_TOKEN"}
    if token is not None:
        env["KVGATE_TOKEN"] = token
    return subprocess.run(
        [binary, "-f", str(COMPOSE), *args],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )  # fmt: skip


def test_docker_compose_validates_the_file_with_every_profile() -> None:
    for profiles in (
        [],
        ["--profile", "valkey"],
        ["--profile", "valkey", "--profile", "mooncake"],
        ["--profile", "azure"],
    ):
        done = run_compose(*profiles, "config", "-q")
        assert done.returncode == 0, done.stderr


def test_kvgate_will_not_start_without_a_token() -> None:
    done = run_compose("config", "-q", token=None)
    assert done.returncode != 0
    assert "KVGATE_TOKEN" in done.stderr


def test_every_long_running_service_has_a_healthcheck(compose: dict[str, Any]) -> None:
    for name, svc in services(compose).items():
        if name == "minio-bucket":
            assert svc["restart"] == "no"  # a one-shot job
            continue
        assert "test" in svc.get("healthcheck", {}), f"{name} has no healthcheck"
    probe = " ".join(services(compose)["kvgate"]["healthcheck"]["test"])
    assert "/healthz" in probe


def test_kvgate_starts_after_redis_and_the_bucket(compose: dict[str, Any]) -> None:
    svc = services(compose)
    assert svc["kvgate"]["depends_on"] == {
        "redis": {"condition": "service_healthy"},
        "minio-bucket": {"condition": "service_completed_successfully"},
    }
    assert svc["minio-bucket"]["depends_on"] == {"minio": {"condition": "service_healthy"}}
    bucket = urlsplit(tiers_of(svc["kvgate"])[-1]["url"]).netloc
    assert f"mc mb --ignore-existing local/{bucket}" in svc["minio-bucket"]["command"][0]


def test_kvgate_tiers_are_memory_disk_redis_s3_on_minio(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    kvgate = services(compose)["kvgate"]
    tiers = tiers_of(kvgate)
    assert [urlsplit(t["url"]).scheme for t in tiers] == ["memory", "file", "redis", "s3"]
    assert urlsplit(tiers[2]["url"]).hostname == "redis"
    s3 = tiers[3]["options"]
    assert s3 == {"endpoint_url": "http://minio:9000", "addressing_style": "path"}
    assert "secret" not in json.dumps(tiers)  # credentials come from AWS_* variables
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(kvgate["environment"])
    # The service's whole environment (KVGATE_TOKEN included) is a valid kvgate config, with
    # the tiers in this order.
    config = load_config(None, env=kvgate["environment"])
    assert [t.url for t in config.tiers] == [t["url"] for t in tiers]


def test_profiles(compose: dict[str, Any]) -> None:
    svc = services(compose)
    for name in ("redis", "minio", "minio-bucket", "kvgate"):
        assert "profiles" not in svc[name]
    assert svc["valkey"]["profiles"] == svc["kvgate-valkey"]["profiles"] == ["valkey"]
    assert [urlsplit(t["url"]).scheme for t in tiers_of(svc["kvgate-valkey"])] == [
        "memory", "valkey", "s3",
    ]  # fmt: skip
    for name in ("mooncake-master", "mooncake-store", "kvgate-mooncake"):
        assert svc[name]["profiles"] == ["mooncake"]
    assert svc["mooncake-master"]["command"][0] == "mooncake_master"
    for name in ("azurite", "kvgate-azure"):
        assert svc[name]["profiles"] == ["azure"]
    azure = tiers_of(svc["kvgate-azure"])
    assert [urlsplit(t["url"]).scheme for t in azure] == ["memory", "azure"]
    assert "key" not in json.dumps(azure)  # the account key comes from AZURE_STORAGE_KEY
    assert "AZURE_STORAGE_KEY" in svc["kvgate-azure"]["environment"]
    for tiers in (tiers_of(svc["kvgate-valkey"]), tiers_of(svc["kvgate-mooncake"]), azure):
        load_config(None, env={"KVGATE_TIERS": json.dumps(tiers)})


def test_dockerfile_installs_cpu_torch_first_and_serves_on_all_interfaces() -> None:
    text = (ROOT / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines()]
    assert lines[next(i for i, ln in enumerate(lines) if ln.startswith("FROM"))] == (
        "FROM python:3.11-slim"
    )
    torch_at = text.index("download.pytorch.org/whl/cpu")
    assert torch_at < text.index('pip install ".[all]"')
    final = [ln for ln in lines if ln.startswith("CMD [")][-1]  # not the HEALTHCHECK's CMD
    cmd = json.loads(final.removeprefix("CMD"))
    assert cmd[:2] == ["kvgate", "serve"]
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "tests"} <= set(ignored)
