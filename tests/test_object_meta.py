"""One check for every object: what a put accepts, every tier stores and reads back.

``Store.put`` refuses what a lower tier could not keep (too many dimensions, a format code
LMCache does not have, a TTL that never or always expires) and tensors without dense data,
with kvgate errors; a property test checks that every description the check accepts builds
with numpy and torch and survives a frame, and a file-only store shows the read side agrees.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import InvalidObject, MissingDependency, Store, Unsupported
from gateway.frame import decode_frame, encode_header, parse_header
from gateway.object_meta import (
    HAS_ML_DTYPES,
    INT64_MAX,
    ITEMSIZE,
    MAX_DIMS,
    ObjectMeta,
    check_meta,
    meta_of_frame,
    numpy_dtype,
)
from gateway.objects import to_object
from gateway.types import MemoryFormat


def file_store(tmp_path: Path) -> Store:
    # No memory tier: every get reads the frame back from disk.
    return Store({"tiers": [{"url": f"file://{tmp_path}"}]})


@pytest.mark.parametrize(
    ("obj", "options"),
    [
        (torch.zeros([1] * 70), {}),  # more dimensions than numpy (and a frame) can carry
        (np.zeros([1] * 33, np.uint8), {}),
        (b"x", {"fmt": 2**70}),  # not a memory format; not even a msgpack integer
        (b"x", {"fmt": 99}),
        (b"x", {"fmt": -1}),
        (b"x", {"fmt": 1.0}),
        (b"x", {"ttl": float("nan")}),  # would never expire
        (b"x", {"ttl": float("inf")}),
        (b"x", {"ttl": -1.0}),
        (b"x", {"ttl": 0}),
        (b"x", {"ttl": "60"}),
    ],
    ids=str,
)
async def test_put_refuses_what_no_tier_can_keep(
    tmp_path: Path, obj: object, options: dict[str, Any]
) -> None:
    async with file_store(tmp_path) as store:
        with pytest.raises(InvalidObject):
            await store.put("k", obj, **options)
        assert await store.get("k") is None


TENSORS_WITHOUT_DENSE_DATA: dict[str, Callable[[], torch.Tensor]] = {
    "meta": lambda: torch.empty(4, device="meta"),
    "sparse_coo": lambda: torch.eye(3).to_sparse(),
    "sparse_csr": lambda: torch.eye(3).to_sparse_csr(),
    "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    "mkldnn": lambda: torch.ones(2, 2).to_mkldnn(),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # sparse CSR and nested are "beta"
@pytest.mark.parametrize("name", TENSORS_WITHOUT_DENSE_DATA)
async def test_tensors_without_dense_data_are_unsupported(tmp_path: Path, name: str) -> None:
    async with file_store(tmp_path) as store:
        with pytest.raises(Unsupported, match=r"dense|meta device|nested"):
            await store.put("k", TENSORS_WITHOUT_DENSE_DATA[name]())


async def test_conjugate_and_negative_views_are_stored_as_their_values(tmp_path: Path) -> None:
    conj = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    neg = torch._neg_view(torch.arange(4.0))
    async with file_store(tmp_path) as store:
        for key, view in (("conj", conj), ("neg", neg)):
            await store.put(key, view)
            await store.flush()
            back = await store.get(key)
            assert isinstance(back, torch.Tensor)
            assert torch.equal(back, view.resolve_conj().resolve_neg())


async def test_the_largest_accepted_rank_reads_back_from_disk(tmp_path: Path) -> None:
    src = torch.arange(6, dtype=torch.float16).reshape([1] * (MAX_DIMS - 2) + [2, 3])
    async with file_store(tmp_path) as store:
        await store.put("k", src, fmt=MemoryFormat.KV_2TD, ttl=3600)
        await store.flush()
        back, meta = await store.get_with_meta("k")  # type: ignore[misc]
        assert torch.equal(back, src)
        assert meta.fmt == MemoryFormat.KV_2TD
        assert store.stats()["file"].corrupt == 0


def test_a_dtype_numpy_lacks_names_what_is_missing() -> None:
    if HAS_ML_DTYPES:
        assert numpy_dtype("bfloat16").itemsize == 2
        return
    with pytest.raises(MissingDependency, match="ml_dtypes") as info:
        numpy_dtype("bfloat16")
    assert "torch" in str(info.value)  # the way that works without it
    with pytest.raises(MissingDependency, match="ml_dtypes"):
        check_meta("ndarray", "float8_e4m3fn", (2,), 2)
    check_meta("tensor", "bfloat16", (2,), 4)  # a tensor does not need numpy's dtype


# Dimensions around the edges: zero (an empty object with huge other dimensions), small
# ones, and powers of two up to past int64.
DIMS = st.one_of(
    st.integers(0, 4), st.sampled_from([2**k for k in (20, 31, 32, 40, 61, 62, 63, 64)])
)
NUMPY_DTYPES = [n for n in ITEMSIZE if hasattr(np, n)]


@settings(max_examples=400, deadline=None, database=None)
@given(
    kind=st.sampled_from(["tensor", "ndarray"]),
    dtype=st.sampled_from([*NUMPY_DTYPES, "bfloat16", "float8_e5m2"]),
    shape=st.lists(DIMS, max_size=MAX_DIMS + 2).map(tuple),
    fmt=st.integers(-1, 10),
    ttl=st.one_of(st.none(), st.floats(min_value=1e-3, allow_infinity=False)),
)
def test_what_the_check_accepts_builds_and_survives_a_frame(
    kind: str, dtype: str, shape: tuple[int, ...], fmt: int, ttl: float | None
) -> None:
    if kind == "ndarray" and not hasattr(np, dtype) and not HAS_ML_DTYPES:
        kind = "tensor"  # covered by test_a_dtype_numpy_lacks_names_what_is_missing
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    try:
        check_meta(kind, dtype, shape, nbytes, fmt)
    except InvalidObject:
        assert (
            len(shape) > MAX_DIMS
            or fmt not in range(9)
            or math.prod(d or 1 for d in shape) * ITEMSIZE[dtype] > INT64_MAX
        )
        return
    meta = ObjectMeta(kind, dtype, shape, nbytes, fmt)  # type: ignore[arg-type]
    if nbytes <= 1 << 20:  # numpy or torch builds it (larger ones are not built here)
        obj: Any = to_object(meta, bytearray(nbytes))
        assert tuple(obj.shape) == shape
    # The frame a tier writes for it is accepted back: the read side agrees with the write.
    head, _ = encode_header(
        codec="raw",
        kind=meta.kind,
        dtype=dtype,
        shape=shape,
        raw_len=nbytes,
        payload=b"",
        fmt=fmt,
        ttl=ttl,
    )
    header, _ = decode_frame(head)  # an empty payload: the header is what is checked
    assert meta_of_frame(header) == meta


@pytest.mark.parametrize(
    "fields",
    [
        {"fmt": 99},
        {"ttl": float("nan")},
        {"ttl": -5.0},
        {"ttl": float("inf")},
        {"shape": [2**63, 0], "raw_len": 0},
        {"shape": [1] * 33},
        {"kind": "bytes", "dtype": "uint8", "shape": [2, 1]},
    ],
    ids=str,
)
def test_frames_out_of_the_limits_are_refused(fields: dict[str, Any]) -> None:
    base: dict[str, Any] = {
        "codec": "raw",
        "kind": "tensor",
        "dtype": "uint8",
        "shape": [2],
        "raw_len": 2,
        "payload": b"ab",
    }
    head, _ = encode_header(**(base | fields))
    with pytest.raises(InvalidObject):
        meta_of_frame(parse_header(head)[0])
