"""A second kvgate (a Store in this process) with the deployed gateway as its gateway:// tier."""

from __future__ import annotations

import httpx
import pytest
from servers.proc import in_ci

from e2e.deployment import Deployment
from e2e.objects import bf16_tensor, unique
from gateway.errors import GatewayError
from gateway.store import Store

try:
    import torch
except ImportError:  # pragma: no cover - CI installs torch
    if in_ci():
        raise
    pytest.skip("the tensors come back as torch tensors", allow_module_level=True)


def downstream(deployment: Deployment) -> Store:
    return Store(
        {
            "tiers": [
                {"url": "memory://", "capacity": "32MiB"},
                {"url": f"gateway://127.0.0.1:{deployment.gateway.port}", "timeout": 30.0},
            ],
            "prefault": False,
        }
    )


async def test_a_second_kvgate_reads_and_writes_through_gateway_tier(
    deployment: Deployment, http: httpx.AsyncClient
) -> None:
    stem = unique("federated")
    held = bf16_tensor(f"{stem}-held", (2, 4, 64, 64), seed=11)
    await held.put(http)
    async with downstream(deployment) as store:
        got = await store.get(held.key)
        assert isinstance(got, torch.Tensor)
        assert got.dtype == torch.bfloat16
        assert tuple(got.shape) == held.shape
        assert got.view(torch.uint8).numpy().tobytes() == held.data
        assert await store.lookup([held.key, f"{stem}-absent"]) == 1
        # And the other way: a durable put through the second is in the first when it returns,
        # in every one of the first's tiers (the second asks it to write through: no flush).
        sent = torch.arange(4 * 256, dtype=torch.float32).reshape(4, 256).to(torch.bfloat16)
        await store.put(f"{stem}-sent", sent, durable=True)
        assert deployment.redis_main_key(f"{stem}-sent") in deployment.redis_keys()
        assert deployment.s3_name(f"{stem}-sent") in deployment.s3_names()
        # With the first's Redis stalled, that durable put fails (the first's Redis tier times
        # out after 5 s); a write-back one returns (the first's memory holds it).
        assert deployment.redis.proc is not None
        with deployment.redis.proc.paused():
            with pytest.raises(GatewayError):
                await store.put(f"{stem}-stalled", sent, durable=True)
            await store.put(f"{stem}-written-back", sent)
    answer = await http.get(f"/v1/objects/{stem}-sent")
    assert answer.status_code == 200
    assert answer.headers["x-kvgate-shape"] == "4,256"
    assert answer.content == sent.view(torch.uint8).numpy().tobytes()
