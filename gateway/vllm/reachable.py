"""Whether a vLLM worker's gateway answers when the worker starts.

An unreachable ``kvgate_url`` does not stop vLLM: it starts and serves, computing every chunk,
which is right for a cache but invisible unless the log says so once, at start.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.store import Store

log = logging.getLogger("kvgate.vllm")


async def say_if_unreachable(store: Store, seconds: float) -> None:
    """One warning at start when the gateway does not answer: vLLM starts and serves anyway
    (every chunk is computed until the gateway answers), so the log is where it shows."""
    tier = store.tiers[-1]
    try:
        async with asyncio.timeout(seconds):
            why = None if await tier.connector.ping() else "its ping failed"
    except TimeoutError:
        why = f"no answer within {seconds:g} s"
    except Exception as exc:  # any failure: the same advice
        why = str(exc) or type(exc).__name__
    if why is not None:
        log.warning(
            "kvgate: the gateway (tier %s) does not answer at start (%s): chunks are computed, "
            "not loaded or saved, until it does",
            tier.name,
            why,
        )
