"""A vLLM worker says once, at start, when its gateway does not answer."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest
from servers.gateway_server import gateway_server_at
from servers.proc import free_port

from gateway.store import Store
from gateway.vllm.reachable import say_if_unreachable


async def _said(url: str, seconds: float, caplog: pytest.LogCaptureFixture) -> list[str]:
    """What ``say_if_unreachable`` logs for a worker's store whose gateway is ``url``."""
    memory = {"url": "memory://", "capacity": "8MiB"}
    config = {"tiers": [memory, {"url": url, "timeout": 2.0}], "prefault": False}
    async with Store(config) as store:
        with caplog.at_level(logging.WARNING, logger="kvgate.vllm"):
            await say_if_unreachable(store, seconds)
    return [r.message for r in caplog.records if r.name == "kvgate.vllm"]


async def test_a_refused_gateway_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    said = await _said(f"gateway://127.0.0.1:{free_port()}", 2.0, caplog)
    assert len(said) == 1
    assert "does not answer at start" in said[0]


async def test_a_silent_gateway_is_one_warning_after_the_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        said = await _said(f"gateway://127.0.0.1:{silent.getsockname()[1]}", 0.5, caplog)
    assert len(said) == 1
    assert "no answer within 0.5 s" in said[0]


async def test_a_gateway_that_answers_is_not_mentioned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for server in gateway_server_at(tmp_path):
        assert await _said(server.url, 5.0, caplog) == []
