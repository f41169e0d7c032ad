"""LMCache 0.5.6's own lm:// client (from its own venv) against the deployed gateway."""

from __future__ import annotations

import httpx
from servers.lmcache import run_lmcache_client

from e2e.deployment import Deployment

LMCACHE_LIMIT_S = 120.0  # its interpreter imports torch and LMCache


async def test_lmcache_chunks_round_trip_and_reach_redis_and_s3(
    deployment: Deployment, http: httpx.AsyncClient
) -> None:
    # 6 MiB bfloat16 chunk: over Redis' inline limit, so the lm:// put is striped into parts.
    port = str(deployment.gateway.lm_port)
    result = await run_lmcache_client(
        ["check", "--port", port, "--size-mib", "6", "--dtype", "bfloat16"], LMCACHE_LIMIT_S
    )
    assert result["exists"] is True
    assert result["missing_exists"] is False
    assert result["missing_get"] is True
    assert result["equal"] is True  # byte-exact, as LMCache compares it
    assert result["dtype"] == "torch.bfloat16"
    key = result["key"]
    # The same chunk over HTTP: a tensor of the shape LMCache declared.
    head = await http.head(f"/v1/objects/{key}")
    assert head.status_code == 200
    assert head.headers["x-kvgate-dtype"] == "bfloat16"
    assert [int(d) for d in head.headers["x-kvgate-shape"].split(",")] == result["shape"]
    assert (await http.post("/v1/flush")).status_code == 204
    assert deployment.redis_main_key(key) in deployment.redis_keys()
    assert deployment.s3_name(key) in deployment.s3_names()
