"""The HTTP object API of the deployed gateway, and what reaches Redis and S3 behind it."""

from __future__ import annotations

import httpx

from e2e.deployment import Deployment
from e2e.objects import bf16_tensor, unique

SMALL = (2, 4, 16, 64)  # 16 KiB: one Redis value
LARGE = (2, 8, 256, 768)  # 6 MiB: over the Redis connector's 4 MiB inline limit, so parts


async def test_tensors_round_trip_and_land_in_redis_and_s3(
    deployment: Deployment, http: httpx.AsyncClient
) -> None:
    stem = unique("http")
    errors_before = {t["name"]: t["errors"] for t in (await http.get("/v1/tiers")).json()["tiers"]}
    small = [bf16_tensor(f"{stem}-{i}", SMALL, seed=i) for i in range(3)]
    large = bf16_tensor(f"{stem}-large", LARGE, seed=7)
    for tensor in (*small, large):
        await tensor.put(http)
    for tensor in (*small, large):
        assert tensor.served_by(await http.get(f"/v1/objects/{tensor.key}"))
        head = await http.head(f"/v1/objects/{tensor.key}")
        assert head.status_code == 200
        assert int(head.headers["content-length"]) == len(tensor.data)
        assert head.headers["x-kvgate-dtype"] == "bfloat16"
        assert head.content == b""
    keys = [small[0].key, small[1].key, f"{stem}-absent", small[2].key]
    lookup = await http.post("/v1/lookup", json={"keys": keys})
    assert lookup.status_code == 200
    assert lookup.json()["prefix"] == 2  # LMCache's rule: leading keys only

    assert (await http.post("/v1/flush")).status_code == 204
    tiers = (await http.get("/v1/tiers")).json()["tiers"]
    assert [t["name"] for t in tiers] == ["memory", "file", "redis", "s3"]
    for tier in tiers:  # the deployment is shared: errors other tests caused are theirs
        assert tier["state"] == "up", tier
        assert tier["errors"] == errors_before[tier["name"]], tier
    redis_keys = deployment.redis_keys()
    s3_names = deployment.s3_names()
    for tensor in (*small, large):
        assert deployment.redis_main_key(tensor.key) in redis_keys
        assert deployment.s3_name(tensor.key) in s3_names
    parts = [k for k in redis_keys if k.startswith(f"{deployment.namespace}p:".encode())]
    assert len(parts) >= 2  # the large object's parts (6 MiB in 4 MiB parts)

    gone = small[0]
    assert (await http.delete(f"/v1/objects/{gone.key}")).status_code == 204
    assert (await http.get(f"/v1/objects/{gone.key}")).status_code == 404
    assert (await http.head(f"/v1/objects/{gone.key}")).status_code == 404
    assert (await http.delete(f"/v1/objects/{gone.key}")).status_code == 404
    assert deployment.redis_main_key(gone.key) not in deployment.redis_keys()
    assert deployment.s3_name(gone.key) not in deployment.s3_names()
    assert small[1].served_by(await http.get(f"/v1/objects/{small[1].key}"))


async def test_a_durable_put_is_in_redis_and_s3_when_it_answers(
    deployment: Deployment, http: httpx.AsyncClient
) -> None:
    tensors = [
        bf16_tensor(unique("durable"), shape, seed=i) for i, shape in enumerate((SMALL, LARGE))
    ]
    for tensor in tensors:
        await tensor.put(http, durable=True)
        # No flush: the 204 itself promises every tier.
        assert deployment.redis_main_key(tensor.key) in deployment.redis_keys()
        assert deployment.s3_name(tensor.key) in deployment.s3_names()


async def test_the_gateway_runs_on_uvloop_and_shows_no_secret(
    deployment: Deployment, http: httpx.AsyncClient
) -> None:
    # The premise of this suite: the shipped command picks uvloop (the serve extra has it),
    # whose transports are not asyncio's; the tests above ran against it.
    assert "uvloop" in deployment.gateway.loaded_libraries()
    secret = deployment.s3.secret_key
    for route in ("/v1/tiers", "/metrics", "/openapi.json"):
        assert secret not in (await http.get(route)).text
    assert secret not in deployment.gateway.log()
