"""``kvgate serve`` with no config at all (the embedded default: memory + a disk tier under
``$KVGATE_DATA_DIR``) and ``--lm-port``: what a new user gets, served to LMCache's own client.

``HOME`` points at an empty directory too, so the test sees that nothing is written to ``~``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from servers.lmcache import run_lmcache_client

from e2e.objects import bf16_tensor, unique
from e2e.serve import Kvgate, kvgate_serve


@pytest.fixture(scope="module")
def default_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Kvgate, Path]]:
    root = tmp_path_factory.mktemp("e2e-default")
    data, home = root / "data", root / "home"
    home.mkdir()
    gateway = kvgate_serve(root, env={"KVGATE_DATA_DIR": str(data), "HOME": str(home)})
    try:
        yield gateway.start(), root
    finally:
        gateway.stop()
        shutil.rmtree(data, ignore_errors=True)


async def test_the_default_config_serves_http_and_lmcache(
    default_gateway: tuple[Kvgate, Path],
) -> None:
    gateway, root = default_gateway
    tensor = bf16_tensor(unique("default"), (2, 4, 64, 128), seed=21)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30.0) as http:
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        await tensor.put(http)
        assert tensor.served_by(await http.get(f"/v1/objects/{tensor.key}"))
        tiers = (await http.get("/v1/tiers")).json()["tiers"]
        assert [t["url"] for t in tiers] == ["memory://", f"file://{root / 'data'}"]
        result = await run_lmcache_client(
            ["check", "--port", str(gateway.lm_port), "--size-mib", "2", "--dtype", "bfloat16"]
        )
        assert result["exists"] is True
        assert result["missing_get"] is True
        assert result["equal"] is True
        assert (await http.post("/v1/flush")).status_code == 204
        head = await http.head(f"/v1/objects/{result['key']}")
        assert head.status_code == 200
    assert "uvloop" in gateway.loaded_libraries()
    assert any((root / "data").rglob("*")), "the disk tier wrote under KVGATE_DATA_DIR"
    assert not any((root / "home").iterdir()), "nothing is written to ~"
