"""Tensors as HTTP clients send them: raw bytes plus ``x-kvgate-dtype``/``x-kvgate-shape``."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

import httpx
import numpy as np

OCTETS = "application/octet-stream"


@dataclass(frozen=True)
class Tensor:
    key: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def headers(self, *, durable: bool = False) -> dict[str, str]:
        headers = {
            "content-type": OCTETS,
            "x-kvgate-dtype": self.dtype,
            "x-kvgate-shape": ",".join(map(str, self.shape)),
        }
        if durable:
            headers["x-kvgate-durable"] = "true"
        return headers

    async def put(self, http: httpx.AsyncClient, *, durable: bool = False) -> None:
        answer = await http.put(
            f"/v1/objects/{self.key}", content=self.data, headers=self.headers(durable=durable)
        )
        assert answer.status_code == 204, answer.text

    def served_by(self, answer: httpx.Response) -> bool:
        """``answer`` (a GET) is this tensor, byte for byte, with its dtype and shape."""
        return (
            answer.status_code == 200
            and answer.headers["x-kvgate-dtype"] == self.dtype
            and answer.headers["x-kvgate-shape"] == ",".join(map(str, self.shape))
            and answer.content == self.data
        )


def unique(stem: str) -> str:
    """A key of its own for one test (letters, digits and '-': the same name in S3)."""
    return f"{stem}-{uuid.uuid4().hex[:10]}"


def bf16_tensor(key: str, shape: tuple[int, ...], seed: int) -> Tensor:
    """Random bfloat16 bits (every bit pattern is a bfloat16: NaNs must survive too)."""
    nbytes = 2 * math.prod(shape)
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    return Tensor(key, "bfloat16", shape, data)
