"""What ``kv_connector_extra_config`` may say (``gateway.vllm.settings``)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import ConfigError
from gateway.vllm.settings import VllmSettings


def test_defaults_and_a_gateway() -> None:
    plain = VllmSettings.from_extra({})
    assert (plain.config, plain.url, plain.chunk_size, plain.seed) == (None, None, 256, "0")
    assert (plain.timeout, plain.lookup_timeout) == (30.0, 5.0)
    assert VllmSettings.from_extra({"lookup_timeout": 0.5}).lookup_timeout == 0.5
    remote = VllmSettings.from_extra({"kvgate_url": "gateway://h:1", "token": "s3cr3t"})
    assert remote.url == "gateway://h:1"
    assert "s3cr3t" not in repr(remote)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"chunk_sise": 256}, "did you mean 'chunk_size'"),
        ({"kvgate_config": {}, "kvgate_url": "gateway://h:1"}, "not both"),
        ({"kvgate_url": "redis://h"}, "gateway://"),
        ({"kvgate_config": 3}, "config dict"),
        ({"token": "t"}, "only with kvgate_url"),
        ({"chunk_size": 0}, "positive integer"),
        ({"chunk_size": True}, "positive integer"),
        ({"timeout": float("nan")}, "positive number"),
        ({"timeout": float("inf")}, "finite"),
        ({"lookup_timeout": 0}, "positive number"),
        ({"max_pending_saves": -1}, "positive integer"),
        ({"local_memory": "1GiB"}, "only with kvgate_url"),
        ({"model_id": 7}, "model_id"),
    ],
)
def test_mistakes_are_named(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        VllmSettings.from_extra(extra)


def test_chunks_are_whole_blocks() -> None:
    VllmSettings.from_extra({"chunk_size": 256}).check_block_size(128)
    with pytest.raises(ConfigError, match="multiple of vLLM's block size 128"):
        VllmSettings.from_extra({"chunk_size": 192}).check_block_size(128)
