"""SIGKILL the deployed gateway, start it again on the same config and ports, and see what the
new process serves.

What a 204 promises (README, "What a returned put promises"): a durable put is in every tier,
so it survives; a write-back put survives once ``POST /v1/flush`` has answered. A write-back
put that was still queued when the process died may be lost: it is then a miss, never a wrong
or broken object.
"""

from __future__ import annotations

import httpx

from connectors.lm import LmConnector
from e2e.deployment import Deployment
from e2e.objects import Tensor, bf16_tensor, unique

SHAPES = ((2, 4, 16, 64), (2, 8, 256, 768))  # 16 KiB and 6 MiB (Redis parts)


def tensors(stem: str, count: int, seed: int) -> list[Tensor]:
    return [
        bf16_tensor(f"{stem}-{i}", SHAPES[i % len(SHAPES)], seed=seed + i) for i in range(count)
    ]


async def test_durable_and_flushed_objects_survive_sigkill(
    deployment: Deployment, http: httpx.AsyncClient
) -> None:
    gateway = deployment.gateway
    stem = unique("restart")
    durable = tensors(f"{stem}-durable", 6, seed=100)
    flushed = tensors(f"{stem}-flushed", 3, seed=200)
    unflushed = tensors(f"{stem}-unflushed", 8, seed=300)
    lm_key, lm_bytes = f"e2e@1@0@{stem[-10:]}@uint8", bytes(range(256)) * 1024
    for tensor in flushed:
        await tensor.put(http)
    async with LmConnector.from_url(f"lm://127.0.0.1:{gateway.lm_port}") as lm:
        await lm.put(lm_key, lm_bytes)
    assert (await http.post("/v1/flush")).status_code == 204
    for tensor in unflushed:
        await tensor.put(http)
    # The durable puts come last, the kill right after them: nothing but their own promise
    # (every tier holds them when the 204 comes) has them on disk, in Redis and in S3.
    for tensor in durable:
        await tensor.put(http, durable=True)
    await http.aclose()  # its connections die with the process

    old_pid = gateway.pid
    gateway.kill()
    gateway.start()
    assert gateway.pid != old_pid

    async with httpx.AsyncClient(base_url=gateway.url, timeout=30.0) as fresh:
        tiers = (await fresh.get("/v1/tiers")).json()["tiers"]
        assert tiers[0]["used_bytes"] == 0  # a new process: nothing in memory
        for tensor in (*durable, *flushed):
            answer = await fresh.get(f"/v1/objects/{tensor.key}")
            assert tensor.served_by(answer), (tensor.key, answer.status_code)
        for tensor in unflushed:
            answer = await fresh.get(f"/v1/objects/{tensor.key}")
            assert answer.status_code in (200, 404), answer.text
            if answer.status_code == 200:
                assert tensor.served_by(answer)
        tiers = (await fresh.get("/v1/tiers")).json()["tiers"]
        assert sum(t["hits"] for t in tiers[1:]) >= len(durable) + len(flushed)
    async with LmConnector.from_url(f"lm://127.0.0.1:{gateway.lm_port}") as lm:
        assert bytes(await lm.get(lm_key) or b"") == lm_bytes
