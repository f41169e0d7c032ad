"""Stop the deployed gateway (SIGKILL, or SIGTERM as an orchestrator does), start it again on
the same config and ports, and see what the new process serves.

What a 204 promises (README, "What a returned put promises"): a durable put is in every tier,
so it survives; a write-back put survives once ``POST /v1/flush`` has answered. A write-back
put that was still queued when the process died may be lost: it is then a miss, never a wrong
or broken object. A clean stop (SIGTERM) closes the store, which writes every queued put down
first.
"""

from __future__ import annotations

import signal

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
    # Dead before anything else could run: what the durable puts promised is already there.
    redis_keys, s3_names = deployment.redis_keys(), deployment.s3_names()
    for tensor in durable:
        assert deployment.redis_main_key(tensor.key) in redis_keys, tensor.key
        assert deployment.s3_name(tensor.key) in s3_names, tensor.key
    gateway.start()
    assert gateway.pid != old_pid

    async with httpx.AsyncClient(base_url=gateway.url, timeout=30.0) as fresh:
        tiers = (await fresh.get("/v1/tiers")).json()["tiers"]
        assert tiers[0]["used_bytes"] == 0  # a new process: nothing in memory
        # Before any get promotes them: the lower tiers alone answer for every key.
        keys = [t.key for t in (*durable, *flushed)]
        lookup = await fresh.post("/v1/lookup", json={"keys": keys})
        assert lookup.json()["prefix"] == len(keys)
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


async def test_a_clean_stop_writes_every_queued_put_down(
    deployment: Deployment, http: httpx.AsyncClient
) -> None:
    gateway = deployment.gateway
    queued = tensors(unique("sigterm"), 8, seed=400)
    for tensor in queued:
        await tensor.put(http)  # write-back, no flush
    await http.aclose()
    pid = gateway.pid
    # uvicorn shuts down, then re-raises the signal it caught: a clean stop exits by SIGTERM.
    assert gateway.terminate() in (0, -signal.SIGTERM)
    log = gateway.log()
    assert "Application shutdown complete." in log[log.index(f"Started server process [{pid}]") :]
    gateway.start()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30.0) as fresh:
        for tensor in queued:
            answer = await fresh.get(f"/v1/objects/{tensor.key}")
            assert tensor.served_by(answer), (tensor.key, answer.status_code)
    # Every tier, not only the first below memory: Redis and S3 have them all.
    redis_keys, s3_names = deployment.redis_keys(), deployment.s3_names()
    for tensor in queued:
        assert deployment.redis_main_key(tensor.key) in redis_keys
        assert deployment.s3_name(tensor.key) in s3_names
