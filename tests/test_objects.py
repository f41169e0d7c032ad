"""User objects to bytes and back, for every kind and dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from gateway.errors import Unsupported
from gateway.objects import ITEMSIZE, to_object, to_object_data

TORCH_DTYPES = [getattr(torch, n) for n in ITEMSIZE if hasattr(torch, n)]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_tensor_round_trip(dtype: torch.dtype) -> None:
    src = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(dtype)
    data = to_object_data(src)
    out = to_object(data.meta, bytearray(data.host()))
    assert isinstance(out, torch.Tensor)
    assert out.dtype == dtype
    assert out.shape == src.shape
    assert torch.equal(out.view(torch.uint8), src.view(torch.uint8))


def test_strided_tensor_is_made_contiguous() -> None:
    src = torch.arange(100, dtype=torch.float16).reshape(10, 10).T
    data = to_object_data(src)
    dst = bytearray(data.meta.nbytes)
    data.copy_into(memoryview(dst))
    out = to_object(data.meta, dst)
    assert torch.equal(out, src)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float16", "float32", "int64", "uint8", "bool", "complex64"])
def test_ndarray_round_trip(dtype: str) -> None:
    src = (np.arange(12) % 2).astype(dtype).reshape(3, 4)
    data = to_object_data(src)
    out = to_object(data.meta, bytes(data.host()))
    assert isinstance(out, np.ndarray)
    assert out.dtype == src.dtype
    np.testing.assert_array_equal(out, src)


def test_bytes_like_kinds() -> None:
    for obj in (b"abc", bytearray(b"abc"), memoryview(b"abc")):
        data = to_object_data(obj)
        out = to_object(data.meta, bytes(data.host()))
        assert type(out) is type(obj)
        assert bytes(out) == b"abc"


def test_empty_and_scalar_tensors() -> None:
    for src in (torch.empty(0, 5, dtype=torch.bfloat16), torch.tensor(3.5)):
        data = to_object_data(src)
        out = to_object(data.meta, bytearray(data.host()))
        assert torch.equal(out, src)  # type: ignore[arg-type]


def test_unsupported_objects() -> None:
    with pytest.raises(Unsupported):
        to_object_data("a string")
    with pytest.raises(Unsupported):
        to_object_data(np.array([object()]))


COPY_HASHED_CASES = {
    "bytes": lambda: bytes(range(256)) * 3000,
    "bytearray": lambda: bytearray(b"x" * 1000),
    "memoryview": lambda: memoryview(b"y" * 10),
    "empty": lambda: b"",
    "ndarray": lambda: np.arange(300_001, dtype=np.int32),
    "strided ndarray": lambda: np.arange(400, dtype=np.float64).reshape(20, 20).T,
    "tensor": lambda: torch.arange(600_007, dtype=torch.float32).to(torch.bfloat16),
    "strided tensor": lambda: torch.arange(100, dtype=torch.float16).reshape(10, 10).T,
}


@pytest.mark.parametrize("case", COPY_HASHED_CASES)
def test_copy_hashed_copies_and_hashes_the_copy(case: str) -> None:
    """Sizes that are not a multiple of the hash step, and strided objects (copied, then
    hashed), give the object's bytes and their xxh3."""
    data = to_object_data(COPY_HASHED_CASES[case]())
    expected = bytearray(data.meta.nbytes)
    data.copy_into(memoryview(expected))
    dst = bytearray(b"\xab" * data.meta.nbytes)
    digest = data.copy_hashed(memoryview(dst))
    assert dst == expected
    assert digest == xxhash.xxh3_64_intdigest(bytes(expected))
