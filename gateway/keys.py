"""Key strings (LMCache-compatible), key validation, and prefix-chained chunk hashing.

Key strings follow lmcache 0.5.6 ``lmcache/utils.py``: ``CacheEngineKey.to_string`` /
``from_string``, ``LayerCacheEngineKey.to_string`` / ``from_string`` and ``parse_cache_key``::

    model@world_size@worker_id@<chunk_hash>@<dtype>[@<layer_id>][@<tag>%<value>]...

The hash is written as ``f"{chunk_hash:x}"`` (lowercase hex, no ``0x``, a leading ``-`` for
the negative values of LMCache's default ``builtin`` hash). A layer key puts its layer id right
after the dtype, before the tags. LMCache parses leniently (``int(part, 16)`` takes ``0X1F``,
``_`` and spaces; ``str.isdigit`` takes non-ASCII digits); ``Key.parse`` accepts only what
``to_string`` writes, so every accepted string equals ``str(Key.parse(s))`` and one key never
has two spellings in a store.

Chunk hashing: see ``prefix_hashes`` (vLLM's chain) and ``lmcache_prefix_hashes`` (LMCache's).
"""

from __future__ import annotations

import hashlib
import operator
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeAlias

import cbor2

from gateway.errors import InvalidKey

MAX_KEY_BYTES = 1024
"""Longest plain key string, in UTF-8 bytes, that the system accepts."""

LMCACHE_DTYPES: frozenset[str] = frozenset(
    {
        "half", "bfloat16", "float", "double", "int8", "uint8", "int16", "int32", "int64",
        "bool", "fp8_e4m3fn", "fp8_e4m3fnuz", "fp8_e5m2", "fp8_e5m2fnuz",
    }
)  # fmt: skip
"""dtype names as LMCache writes them (``TORCH_DTYPE_TO_STR_DTYPE`` values)."""

# torch spells some dtypes differently from LMCache; both are accepted, LMCache's is stored.
_DTYPE_ALIASES: dict[str, str] = {name: name for name in LMCACHE_DTYPES} | {
    "float16": "half",
    "float32": "float",
    "float64": "double",
    "float8_e4m3fn": "fp8_e4m3fn",
    "float8_e4m3fnuz": "fp8_e4m3fnuz",
    "float8_e5m2": "fp8_e5m2",
    "float8_e5m2fnuz": "fp8_e5m2fnuz",
}

TagPairs: TypeAlias = tuple[tuple[str, str], ...]
TagsArg: TypeAlias = Mapping[str, str] | Iterable[tuple[str, str]] | None

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ASCII_DIGITS = re.compile(r"[0-9]+")
_CANONICAL_DECIMAL = re.compile(r"0|[1-9][0-9]*")
_CANONICAL_HEX = re.compile(r"0|-?[1-9a-f][0-9a-f]*")  # what f"{n:x}" writes, nothing else


def _shown(text: str) -> str:
    """``repr`` of user text, cut short so an error message stays readable."""
    return repr(text) if len(text) <= 120 else repr(text[:120]) + "..."


def _check_text(what: str, value: object, *, allow_empty: bool, forbidden: str) -> str:
    if not isinstance(value, str):
        raise InvalidKey(f"{what} must be a str, got {type(value).__name__}")
    if not value and not allow_empty:
        raise InvalidKey(f"{what} must not be empty")
    for char in forbidden:
        if char in value:
            raise InvalidKey(f"{what} {_shown(value)} must not contain {char!r}")
    if _CONTROL.search(value):
        raise InvalidKey(f"{what} {_shown(value)} contains a control character")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidKey(f"{what} {_shown(value)} is not encodable as UTF-8") from exc
    return str(value)  # a plain str even when given a subclass


def _check_int(what: str, value: object) -> int:
    if type(value) is int:  # fast path: isinstance() on a Protocol costs microseconds
        return value
    # bool is an int subclass but never a meaningful id or hash; numpy/torch ints are fine.
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidKey(f"{what} must be an int, got {type(value).__name__}")
    try:
        return operator.index(value)
    except TypeError as exc:  # e.g. a float tensor, which has __index__ but refuses it
        raise InvalidKey(f"{what} must be an int, got {type(value).__name__}") from exc


def _dtype_name(dtype: object) -> str:
    if not isinstance(dtype, str):
        raise InvalidKey(f"dtype must be a str, got {type(dtype).__name__}")
    if "@" in dtype:
        raise InvalidKey(f"dtype {_shown(dtype)} must not contain '@'")
    name = _DTYPE_ALIASES.get(dtype.removeprefix("torch."))
    if name is None:
        raise InvalidKey(
            f"unknown dtype {_shown(dtype)}; known: {', '.join(sorted(LMCACHE_DTYPES))}"
        )
    return name


def _normalize_tags(tags: TagsArg) -> TagPairs:
    if tags is None:
        return ()
    items = tags.items() if isinstance(tags, Mapping) else tags
    pairs: list[tuple[str, str]] = []
    seen: set[str] = set()
    try:
        for item in items:
            # A 2-character str would unpack into a pair: demand real pairs.
            if not isinstance(item, tuple | list) or len(item) != 2:
                raise InvalidKey(f"tags must be (name, value) pairs, got {item!r}")
            name, value = item
            name = _check_text("tag name", name, allow_empty=True, forbidden="@%")
            value = _check_text(f"tag {name!r} value", value, allow_empty=True, forbidden="@")
            if name in seen:
                raise InvalidKey(f"duplicate tag {name!r}")
            seen.add(name)
            pairs.append((name, value))
    except InvalidKey:
        raise
    except TypeError as exc:  # not iterable
        raise InvalidKey("tags must be a mapping of str to str, or (name, value) pairs") from exc
    return tuple(pairs)


@dataclass(frozen=True, slots=True, init=False)
class Key:
    """One KV chunk's identity; ``str(key)`` is LMCache 0.5.6's key string.

    ``tags`` is stored as (name, value) pairs in the order given, as LMCache writes them.
    A key with ``layer_id`` is LMCache's ``LayerCacheEngineKey``.
    """

    model: str
    world_size: int
    worker_id: int
    chunk_hash: int
    dtype: str
    tags: TagPairs
    layer_id: int | None
    _text: str = field(init=False, repr=False, compare=False)  # str(key), built once

    def __init__(
        self,
        model: str,
        world_size: int,
        worker_id: int,
        chunk_hash: int,
        dtype: str,
        tags: TagsArg = None,
        *,
        layer_id: int | None = None,
    ) -> None:
        model = _check_text("model", model, allow_empty=False, forbidden="@")
        world_size = _check_int("world_size", world_size)
        worker_id = _check_int("worker_id", worker_id)
        if world_size < 1:
            raise InvalidKey(f"world_size must be >= 1, got {world_size}")
        if not 0 <= worker_id < world_size:
            raise InvalidKey(f"worker_id must be in [0, {world_size}), got {worker_id}")
        chunk_hash = _check_int("chunk_hash", chunk_hash)
        dtype = _dtype_name(dtype)
        pairs = _normalize_tags(tags)
        if layer_id is not None:
            layer_id = _check_int("layer_id", layer_id)
            if layer_id < 0:
                raise InvalidKey(f"layer_id must be >= 0, got {layer_id}")
        text = f"{model}@{world_size}@{worker_id}@{chunk_hash:x}@{dtype}"
        if layer_id is not None:
            text += f"@{layer_id}"
        for name, value in pairs:
            text += f"@{name}%{value}"
        init = object.__setattr__  # frozen: the only way to set fields once
        init(self, "model", model)
        init(self, "world_size", world_size)
        init(self, "worker_id", worker_id)
        init(self, "chunk_hash", chunk_hash)
        init(self, "dtype", dtype)
        init(self, "tags", pairs)
        init(self, "layer_id", layer_id)
        init(self, "_text", text)

    def __str__(self) -> str:
        return self._text

    @classmethod
    def parse(cls, text: str) -> Key:
        """Read a key string back; raises ``InvalidKey`` for anything ``str(Key)`` can't write."""
        if not isinstance(text, str):
            raise InvalidKey(f"key string must be a str, got {type(text).__name__}")
        parts = text.split("@")
        if len(parts) < 5:
            raise InvalidKey(
                f"key string {_shown(text)} has {len(parts)} '@'-separated parts; "
                "expected model@world_size@worker_id@chunk_hash@dtype[@layer][@tag%value]..."
            )
        model, world_size, worker_id, chunk_hash, dtype = parts[:5]
        rest = parts[5:]
        layer_id: int | None = None
        if rest and _ASCII_DIGITS.fullmatch(rest[0]):
            layer_id = _parse_decimal("layer_id", rest[0])
            rest = rest[1:]
        if dtype not in LMCACHE_DTYPES:  # aliases are for callers; a stored key has one spelling
            raise InvalidKey(f"unknown dtype {_shown(dtype)} in key string {_shown(text)}")
        if not _CANONICAL_HEX.fullmatch(chunk_hash):
            raise InvalidKey(
                f"chunk hash {_shown(chunk_hash)} is not lowercase hex without leading zeros"
            )
        tags: list[tuple[str, str]] = []
        for part in rest:
            name, percent, value = part.partition("%")
            if not percent:
                raise InvalidKey(f"tag {_shown(part)} in key string has no '%' (name%value)")
            tags.append((name, value))
        return cls(
            model,
            _parse_decimal("world_size", world_size),
            _parse_decimal("worker_id", worker_id),
            int(chunk_hash, 16),  # base 16 is exempt from int()'s digit limit
            dtype,
            tags,
            layer_id=layer_id,
        )


def _parse_decimal(what: str, part: str) -> int:
    if not _CANONICAL_DECIMAL.fullmatch(part):
        raise InvalidKey(f"{what} {_shown(part)} is not a decimal integer without leading zeros")
    try:
        return int(part)
    except ValueError as exc:  # more digits than int() converts (sys.get_int_max_str_digits)
        raise InvalidKey(f"{what} {_shown(part)} is too long") from exc


def normalize_key(key: Key | str) -> str:
    """The string every layer of the system uses for ``key``; raises ``InvalidKey``.

    A plain str must be non-empty, at most ``MAX_KEY_BYTES`` UTF-8 bytes, free of control
    characters (below 0x20, and 0x7f) and encodable as UTF-8 (no lone surrogates).
    """
    if type(key) is str:
        # Hot path: for ASCII text, isprintable() is False exactly for 0x00-0x1f and 0x7f,
        # and the byte length is the character count.
        if key.isascii() and 0 < len(key) <= MAX_KEY_BYTES and key.isprintable():
            return key
        return _check_key_text(key)
    if isinstance(key, Key):
        text = key._text
        if len(text) <= MAX_KEY_BYTES and text.isascii():
            return text
        return _check_key_text(text)
    if isinstance(key, str):
        return _check_key_text(str(key))
    raise InvalidKey(f"a key must be a Key or str, got {type(key).__name__}")


def _check_key_text(text: str) -> str:
    if not text:
        raise InvalidKey("key must not be empty")
    control = _CONTROL.search(text)
    if control:
        raise InvalidKey(
            f"key {_shown(text)} contains control character {control.group()!r} "
            f"at index {control.start()}"
        )
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidKey(f"key {_shown(text)} is not encodable as UTF-8") from exc
    if size > MAX_KEY_BYTES:
        raise InvalidKey(f"key is {size} UTF-8 bytes; the limit is {MAX_KEY_BYTES}")
    return text


# --- Chunk hashing -------------------------------------------------------------------------
#
# H is vLLM's ``sha256_cbor`` (vllm/utils/hashing.py): SHA-256 over ``cbor2.dumps(obj,
# canonical=True)``. Two chains are built on it:
#
# vLLM (vllm/v1/core/kv_cache_utils.py ``init_none_hash``, ``hash_block_tokens``):
#   NONE_HASH = H(os.environ["PYTHONHASHSEED"]) (the string), or os.urandom(32) when unset;
#   block_i = H((block_{i-1} or NONE_HASH, tuple(tokens_i), extra_keys)), extra_keys None by
#   default; the parent is the 32-byte digest. vLLM hashes full blocks only.
#
# LMCache 0.5.6 (lmcache/v1/token_database.py with pre_caching_hash_algorithm: sha256_cbor)
#   takes NONE_HASH from vLLM's init_none_hash but folds every digest to an int before it
#   enters the chain (``_normalize_hash_to_int``: first 8 bytes, big-endian, unsigned):
#   chunk_i = fold(H((chunk_{i-1}, tuple(tokens_i), tuple(extra_keys) or ()))), chunk_0's
#   parent being fold(NONE_HASH). So LMCache's chunk hash is NOT fold(vLLM's block hash):
#   the parents (int vs bytes) and the empty extra keys (() vs None) both differ.
#
# The seed: vLLM's random fallback makes every process's keys unique, which defeats a shared
# cache. With no seed given and PYTHONHASHSEED unset we use "0", the value LMCache's docs and
# warnings tell operators to export, so an unconfigured kvgate computes the same keys as an
# LMCache deployment that followed that advice. A given seed (or PYTHONHASHSEED) is used
# exactly as vLLM does: H(seed string).

DEFAULT_SEED = "0"
"""Seed used when none is given and ``PYTHONHASHSEED`` is unset (see the note above)."""

DEFAULT_CHUNK_SIZE = 256

HashChain: TypeAlias = Literal["lmcache", "vllm"]


class _HasToList(Protocol):
    """A numpy array or torch tensor of token ids."""

    def __len__(self) -> int: ...

    def tolist(self) -> object: ...


TokenIds: TypeAlias = Sequence[int] | _HasToList


def sha256_cbor(obj: object) -> bytes:
    """vLLM's ``sha256_cbor``: SHA-256 of the canonical CBOR encoding of ``obj``."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def none_hash(seed: str | None = None) -> bytes:
    """The chain's root digest: ``H(seed)``; ``seed`` defaults to ``$PYTHONHASHSEED``, then "0"."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)
    if not isinstance(seed, str):
        raise TypeError(f"seed must be a str, got {type(seed).__name__}")
    return sha256_cbor(seed)


def hash_to_int(digest: bytes) -> int:
    """LMCache's 64-bit form of a digest: its first 8 bytes, big-endian, unsigned."""
    if len(digest) < 8:
        raise ValueError(f"a digest has at least 8 bytes, got {len(digest)}")
    return int.from_bytes(digest[:8], "big")


def _check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _token_list(tokens: TokenIds) -> list[int]:
    if isinstance(tokens, list):
        return tokens
    if isinstance(tokens, Sequence):
        return list(tokens)
    ids = tokens.tolist()  # numpy / torch: Python ints, as LMCache's tolist() gives
    if not isinstance(ids, list):
        raise TypeError("tokens must be one-dimensional")
    return ids


def _chunk_starts(num_tokens: int, chunk_size: int, save_partial: bool) -> range:
    end = num_tokens if save_partial else num_tokens - num_tokens % chunk_size
    return range(0, end, chunk_size)


def chunk_ranges(
    num_tokens: int, chunk_size: int = DEFAULT_CHUNK_SIZE, *, save_partial: bool = False
) -> list[tuple[int, int]]:
    """Token [start, end) of each chunk, in order."""
    _check_chunk_size(chunk_size)
    return [
        (start, min(start + chunk_size, num_tokens))
        for start in _chunk_starts(num_tokens, chunk_size, save_partial)
    ]


def prefix_hashes(
    tokens: TokenIds,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    save_partial: bool = False,
    parent: bytes | None = None,
    extra_keys: object = None,
) -> list[bytes]:
    """vLLM's chained block hashes (32-byte digests), one per chunk.

    ``parent`` continues a chain; when falsy the chain starts at ``none_hash()``, as vLLM's
    ``hash_block_tokens`` does. ``extra_keys`` goes into every chunk's hash unchanged.
    """
    _check_chunk_size(chunk_size)
    ids = _token_list(tokens)
    previous = parent or none_hash()
    digests: list[bytes] = []
    for start in _chunk_starts(len(ids), chunk_size, save_partial):
        previous = sha256_cbor((previous, tuple(ids[start : start + chunk_size]), extra_keys))
        digests.append(previous)
    return digests


def lmcache_prefix_hashes(
    tokens: TokenIds,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    save_partial: bool = False,
    parent: int | None = None,
    extra_keys: Sequence[object] | None = None,
) -> list[int]:
    """LMCache 0.5.6's chained chunk hashes (64-bit ints), one per chunk.

    ``parent`` continues a chain; ``None`` starts it at ``hash_to_int(none_hash())``.
    """
    _check_chunk_size(chunk_size)
    ids = _token_list(tokens)
    previous = hash_to_int(none_hash()) if parent is None else parent
    extra = () if extra_keys is None else tuple(extra_keys)
    hashes: list[int] = []
    for start in _chunk_starts(len(ids), chunk_size, save_partial):
        digest = sha256_cbor((previous, tuple(ids[start : start + chunk_size]), extra))
        previous = hash_to_int(digest)
        hashes.append(previous)
    return hashes


class Chunker:
    """Turns token ids into the keys of their chunks for one model, rank and dtype.

    ``chain="lmcache"`` (default) gives the chunk hashes LMCache 0.5.6 writes with
    ``pre_caching_hash_algorithm: sha256_cbor``, so keys match objects LMCache stored;
    ``chain="vllm"`` gives ``hash_to_int`` of vLLM's block hashes. The seed is resolved once,
    here, so one Chunker never changes its keys when the environment changes.
    """

    __slots__ = ("_root", "_template", "chain", "chunk_size", "save_partial")

    def __init__(
        self,
        model: str,
        world_size: int,
        worker_id: int,
        dtype: str,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        save_partial: bool = False,
        seed: str | None = None,
        tags: TagsArg = None,
        chain: HashChain = "lmcache",
    ) -> None:
        _check_chunk_size(chunk_size)
        if chain not in ("lmcache", "vllm"):
            raise ValueError(f"chain must be 'lmcache' or 'vllm', got {chain!r}")
        # A template key validates model, ranks, dtype and tags once, at construction.
        self._template = Key(model, world_size, worker_id, 0, dtype, tags)
        self._root = none_hash(seed)
        self.chunk_size = chunk_size
        self.save_partial = save_partial
        self.chain: HashChain = chain

    def __repr__(self) -> str:
        key = self._template
        return (
            f"Chunker(model={key.model!r}, world_size={key.world_size}, "
            f"worker_id={key.worker_id}, dtype={key.dtype!r}, chunk_size={self.chunk_size}, "
            f"save_partial={self.save_partial}, chain={self.chain!r})"
        )

    def ranges(self, tokens: TokenIds) -> list[tuple[int, int]]:
        """Token [start, end) of each chunk that ``keys`` returns a key for."""
        return chunk_ranges(len(tokens), self.chunk_size, save_partial=self.save_partial)

    def hashes(self, tokens: TokenIds) -> list[int]:
        """The chunk hashes of ``tokens``, one per chunk."""
        if self.chain == "vllm":
            digests = prefix_hashes(
                tokens, self.chunk_size, save_partial=self.save_partial, parent=self._root
            )
            return [hash_to_int(digest) for digest in digests]
        return lmcache_prefix_hashes(
            tokens,
            self.chunk_size,
            save_partial=self.save_partial,
            parent=hash_to_int(self._root),
        )

    def keys(self, tokens: TokenIds) -> list[Key]:
        """One key per chunk of ``tokens``, in order."""
        t = self._template
        return [
            Key(t.model, t.world_size, t.worker_id, chunk_hash, t.dtype, t.tags)
            for chunk_hash in self.hashes(tokens)
        ]
