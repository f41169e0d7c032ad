"""User objects <-> (metadata, raw bytes), with as few copies as possible.

A stored object is its raw bytes plus ``ObjectMeta`` (kind, dtype, shape, memory format).
Torch tensors of any dtype (bfloat16 and fp8 included) travel as their bytes viewed as uint8;
``to_object`` rebuilds the same kind of object as a zero-copy view over a buffer.
torch is optional: without it, ndarray and bytes-like objects still work.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from gateway.errors import Unsupported
from gateway.object_meta import ITEMSIZE as ITEMSIZE  # re-exported: where callers find them
from gateway.object_meta import ObjectMeta as ObjectMeta
from gateway.object_meta import check_format, check_meta, numpy_dtype
from gateway.types import Buffer, MemoryFormat

if TYPE_CHECKING:
    import torch

HAS_TORCH = importlib.util.find_spec("torch") is not None
HASH_STEP = 256 << 10  # fits the L2 cache with room
COPIED_KINDS = ("bytes", "bytearray")
"""Kinds that own their bytes: ``to_object`` copies them out of the buffer it is given."""


def _torch() -> Any:
    import torch

    return torch


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(_torch(), name, None)
    if dtype is None or name not in ITEMSIZE:
        raise Unsupported(f"dtype {name!r} is not supported by this torch build")
    return dtype  # type: ignore[no-any-return]


def _is_tensor(obj: object) -> bool:
    return HAS_TORCH and type(obj).__module__.startswith("torch") and _is_torch_tensor(obj)


def _is_torch_tensor(obj: object) -> bool:
    return isinstance(obj, _torch().Tensor)


class ObjectData:
    """A user object seen as metadata plus bytes. Cheap to build: nothing is copied here."""

    __slots__ = ("_array", "_host", "checksum", "meta", "position", "tensor")

    def __init__(
        self,
        meta: ObjectMeta,
        host: memoryview | None,
        tensor: Any = None,
        *,
        array: np.ndarray[Any, Any] | None = None,
        checksum: int | None = None,
        position: int | None = None,
    ) -> None:
        self.meta = meta
        self._host = host
        self.tensor = tensor  # the torch tensor (possibly on a GPU) when kind == "tensor"
        self._array = array  # a strided ndarray, made contiguous only when needed
        # xxh3_64 of the raw bytes when already known (hashed while the store copied them):
        # the payload checksum of a raw frame, so that no tier hashes the object again.
        self.checksum = checksum
        # Where the object (a KV chunk) starts in its token sequence, when the caller said
        # (``Store.put(..., position=)``): codecs that undo RoPE on keys need it. Not stored.
        self.position = position

    @property
    def host_ready(self) -> bool:
        """Whether ``host()`` is free (no copy from a GPU or of a strided object)."""
        if self._host is not None:
            return True
        if self._array is not None:
            return bool(self._array.flags.c_contiguous)
        t = self.tensor
        return self.on_host and bool(t.is_contiguous()) and not (t.is_conj() or t.is_neg())

    @property
    def on_host(self) -> bool:
        """False for a tensor on a GPU (copying it out waits for the device)."""
        return self.tensor is None or self.tensor.device.type == "cpu"

    def host(self) -> memoryview:
        """The raw bytes on the host, contiguous (copies only for GPU or strided tensors)."""
        if self._host is None and self._array is not None:
            self._host = np.ascontiguousarray(self._array).reshape(-1).view(np.uint8).data
        if self._host is None:
            t = self.tensor.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            # A conjugate or negative view cannot be viewed as bytes: its values are made first.
            t = t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(_torch().uint8)
            self._host = t.numpy().data.cast("B")
        return self._host

    def copy_into(self, dst: memoryview) -> None:
        """Copy the raw bytes into ``dst`` (exactly ``meta.nbytes`` long) at memcpy speed."""
        if self.meta.nbytes == 0:
            return
        if self.tensor is not None:
            torch = _torch()
            out = torch.from_numpy(np.frombuffer(dst, dtype=np.uint8))
            src = self.tensor.detach().resolve_conj().resolve_neg()  # no-ops unless views
            if not src.is_contiguous():
                src = src.contiguous()
            out.copy_(src.reshape(-1).view(torch.uint8))
            return
        if self._array is not None:  # strided: one pass, straight into the destination
            out = np.frombuffer(dst, dtype=self._array.dtype).reshape(self._array.shape)
            np.copyto(out, self._array)
            return
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(self.host(), np.uint8))

    def copy_hashed(self, dst: memoryview) -> int:
        """``copy_into(dst)`` and return the xxh3_64 of the bytes, in one pass when possible.

        Each HASH_STEP is hashed right after it is copied, while it is in the CPU cache: a
        separate hash pass over a 32 MiB object costs more than the copy itself (measured:
        copy 18 GB/s, copy then hash 10, copy and hash by 256 KiB steps 15).
        """
        if not self.host_ready:
            self.copy_into(dst)
            return xxhash.xxh3_64_intdigest(dst)
        src = np.frombuffer(self.host(), np.uint8)
        out = np.frombuffer(dst, dtype=np.uint8)
        digest = xxhash.xxh3_64()
        for start in range(0, src.nbytes, HASH_STEP):
            stop = start + HASH_STEP
            np.copyto(out[start:stop], src[start:stop])
            digest.update(dst[start:stop])
        return digest.intdigest()


def to_object_data(obj: object, fmt: int = MemoryFormat.UNDEFINED) -> ObjectData:
    """Describe a user object, checked like every object (``check_meta``).

    ``Unsupported`` for anything but the supported kinds (and for tensors without dense data
    on a real device); ``InvalidObject`` for a shape, format or size out of kvgate's limits.
    """
    data = _describe(obj, check_format(fmt))
    meta = data.meta
    check_meta(meta.kind, meta.dtype, meta.shape, meta.nbytes, meta.fmt)
    return data


def _describe(obj: object, fmt: int) -> ObjectData:
    if isinstance(obj, bytes):
        return ObjectData(ObjectMeta("bytes", "uint8", (len(obj),), len(obj), fmt), memoryview(obj))
    if isinstance(obj, bytearray):
        return ObjectData(
            ObjectMeta("bytearray", "uint8", (len(obj),), len(obj), fmt), memoryview(obj)
        )
    if isinstance(obj, memoryview):
        if not obj.c_contiguous:
            raise Unsupported("a non-contiguous memoryview: pass np.asarray(view) instead")
        view = obj.cast("B")
        return ObjectData(ObjectMeta("memoryview", "uint8", (view.nbytes,), view.nbytes, fmt), view)
    if isinstance(obj, np.ndarray):
        return _ndarray_data(obj, fmt)
    if _is_tensor(obj):
        return _tensor_data(obj, fmt)  # type: ignore[arg-type]  # checked by _is_tensor
    raise Unsupported(
        f"cannot store a {type(obj).__name__}: use a torch tensor, numpy array, bytes, "
        "bytearray or memoryview"
    )


@functools.lru_cache(maxsize=64)
def _ndarray_dtype_name(dtype: np.dtype[Any]) -> str:
    """The ITEMSIZE name of a numpy dtype kvgate stores (``Unsupported`` otherwise); cached,
    since ``dtype.name`` builds a new string on every call (~6 us of each put)."""
    if dtype.name not in ITEMSIZE or dtype.fields is not None or dtype.hasobject:
        raise Unsupported(f"numpy dtype {dtype} is not supported")
    if not dtype.isnative:
        raise Unsupported(f"numpy dtype {dtype.str} is not in native byte order")
    return dtype.name


def _ndarray_data(arr: np.ndarray[Any, Any], fmt: int) -> ObjectData:
    meta = ObjectMeta("ndarray", _ndarray_dtype_name(arr.dtype), tuple(arr.shape), arr.nbytes, fmt)
    if arr.flags.c_contiguous:
        return ObjectData(meta, arr.reshape(-1).view(np.uint8).data)
    # Strided: copied later, straight into its destination (off the event loop).
    return ObjectData(meta, None, array=arr)


def _tensor_data(t: torch.Tensor, fmt: int) -> ObjectData:
    # Checked before anything reads its shape or bytes: torch raises NotImplementedError or
    # RuntimeError from deep inside a copy for these.
    if t.is_nested:
        raise Unsupported("a nested tensor has no single shape: store its tensors one by one")
    if t.layout != _torch().strided:
        raise Unsupported(f"a {t.layout} tensor: only dense tensors can be stored (.to_dense())")
    if t.device.type == "meta":
        raise Unsupported("a tensor on the meta device has no data to store")
    name = str(t.dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise Unsupported(f"torch dtype {t.dtype} is not supported")
    meta = ObjectMeta("tensor", name, tuple(t.shape), t.numel() * t.element_size(), fmt)
    return ObjectData(meta, None, t)


def to_object(meta: ObjectMeta, buf: Buffer) -> object:
    """Rebuild the user's kind of object over ``buf`` (zero-copy for tensors and arrays).

    ``buf`` must stay valid as long as the result lives; leases from the buffer pool do.
    """
    view = memoryview(buf).cast("B")
    kind = meta.kind
    if kind == "bytes":
        return bytes(view)
    if kind == "bytearray":
        return bytearray(view)
    if kind == "memoryview":
        return view
    if kind == "ndarray":
        arr = np.frombuffer(view, dtype=numpy_dtype(meta.dtype))
        return arr.reshape(meta.shape)
    if kind == "tensor":
        torch = _torch()
        if view.readonly:  # torch cannot wrap read-only memory without a warning
            view = memoryview(bytearray(view))
        if view.nbytes == 0:
            return torch.empty(meta.shape, dtype=torch_dtype(meta.dtype))
        flat = torch.from_numpy(np.frombuffer(view, dtype=np.uint8))
        return flat.view(torch_dtype(meta.dtype)).reshape(meta.shape)
    raise Unsupported(f"unknown object kind {kind!r}")
