"""``kvgate serve`` as shipped over each cloud-style tier: Azure Blob (azurite), Google Cloud
Storage (gcp-storage-emulator), an OpenDAL service (WebDAV on wsgidav) and the separately
packaged sqlite plugin.

Each deployment is memory -> that tier. A durable PUT answers once the tier holds the object;
the gateway is then SIGKILLed and started again (the memory tier is gone), and the GET must be
served by the tier, byte for byte, with the tier's hit counted in ``/v1/tiers``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from servers.proc import in_ci

from e2e.serve import kvgate_serve

SIZE = 3 << 20  # several parts or blocks where the tier splits objects


def payload(seed: int) -> bytes:
    return bytes((i * 131 + seed) % 251 for i in range(4096)) * (SIZE // 4096)


def tier_of(name: str, request: pytest.FixtureRequest, root: Path) -> dict[str, Any]:
    """The tier entry of a deployment over ``name``'s real server (started by its fixture)."""
    if name == "azure":
        azure = request.getfixturevalue("azurite_server")
        return {"url": azure.url("e2e-serve"), "options": azure.options(), "timeout": 30.0}
    if name == "gs":
        gcs = request.getfixturevalue("gcs_server")
        return {"url": gcs.url("e2e-serve"), "options": gcs.options(), "timeout": 30.0}
    if name == "opendal+webdav":
        dav = request.getfixturevalue("webdav_server")
        return {"url": "opendal+webdav:///e2e-serve", "options": dav.options(), "timeout": 30.0}
    if importlib.util.find_spec("kvgate_sqlite") is None:
        message = "the kvgate-sqlite plugin is not installed (bash .ci/plugins)"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    return {"url": f"sqlite://{root / 'tier.db'}", "timeout": 30.0}


@pytest.mark.parametrize("name", ["azure", "gs", "opendal+webdav", "sqlite"])
async def test_a_durable_put_survives_a_restart_in_the_tier(
    name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    tier = tier_of(name, request, tmp_path)
    config = tmp_path / "kvgate.yaml"
    tiers = [{"url": "memory://", "capacity": "64MiB"}, tier]
    config.write_text(yaml.safe_dump({"tiers": tiers}))
    gateway = kvgate_serve(tmp_path, config=config, args=["--log-level", "warning"])
    key = f"cloud-{name}-{os.getpid()}"
    data = payload(len(name))
    try:
        gateway.start()
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            put = await http.put(
                f"/v1/objects/{key}", content=data, headers={"x-kvgate-durable": "true"}
            )
            assert put.status_code == 204, put.text
        gateway.kill()  # no flush, no close: only what the tier holds is left
        gateway.start()
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            got = await http.get(f"/v1/objects/{key}")
            assert got.status_code == 200, got.text
            assert got.content == data
            states = (await http.get("/v1/tiers")).json()["tiers"]
            below = states[1]
            assert below["hits"] >= 1, states
            assert (await http.delete(f"/v1/objects/{key}")).status_code == 204
            assert (await http.get(f"/v1/objects/{key}")).status_code == 404
    except BaseException:
        print(gateway.log()[-4000:])
        raise
    finally:
        gateway.stop()
