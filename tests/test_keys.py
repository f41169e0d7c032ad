"""Key strings (LMCache 0.5.6 format), key validation, and prefix-chained chunk hashing."""

from __future__ import annotations

import dataclasses
import hashlib
import pickle

import cbor2
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import InvalidKey
from gateway.keys import (
    LMCACHE_DTYPES,
    MAX_KEY_BYTES,
    Chunker,
    Key,
    chunk_ranges,
    hash_to_int,
    lmcache_prefix_hashes,
    none_hash,
    normalize_key,
    prefix_hashes,
)

# --- Key strings -----------------------------------------------------------------------------

# Strings as LMCache 0.5.6's CacheEngineKey / LayerCacheEngineKey.to_string() writes them
# (checked against lmcache/utils.py of the 0.5.6 wheel).
LMCACHE_WRITTEN = [
    "llama@4@1@-1f@half@user%a%b@x%",
    "org/m-1@1@0@8000000000000005@bfloat16",
    "m@2@1@0@fp8_e4m3fn",
    "m@2@1@abc@float@7@t%v",
    "m@2@0@-5@uint8@0",
]


@pytest.mark.parametrize("text", LMCACHE_WRITTEN)
def test_parse_then_str_gives_back_lmcache_string(text: str) -> None:
    assert str(Key.parse(text)) == text


def test_str_format_plain_key() -> None:
    key = Key("llama-3-8b", 2, 1, 0xDEADBEEF, "bfloat16")
    assert str(key) == "llama-3-8b@2@1@deadbeef@bfloat16"
    assert f"{key}" == str(key)


def test_negative_hash_has_leading_minus() -> None:
    key = Key("m", 1, 0, -0x1F, "half")
    assert str(key) == "m@1@0@-1f@half"
    assert Key.parse("m@1@0@-1f@half") == key


def test_layer_id_comes_after_dtype_and_before_tags() -> None:
    key = Key("m", 1, 0, 255, "half", {"a": "1", "b": "x%y"}, layer_id=3)
    assert str(key) == "m@1@0@ff@half@3@a%1@b%x%y"
    parsed = Key.parse(str(key))
    assert parsed == key
    assert parsed.layer_id == 3
    assert parsed.tags == (("a", "1"), ("b", "x%y"))


def test_tags_keep_insertion_order() -> None:
    key = Key("m", 1, 0, 1, "half", {"z": "1", "a": "2"})
    assert key.tags == (("z", "1"), ("a", "2"))
    assert str(key).endswith("@z%1@a%2")
    assert key != Key("m", 1, 0, 1, "half", {"a": "2", "z": "1"})


def test_tags_accept_pairs_and_none_equals_empty() -> None:
    assert Key("m", 1, 0, 1, "half", [("k", "v")]) == Key("m", 1, 0, 1, "half", {"k": "v"})
    assert Key("m", 1, 0, 1, "half", None) == Key("m", 1, 0, 1, "half", {})
    assert Key("m", 1, 0, 1, "half").tags == ()


def test_dataclasses_replace_revalidates_and_rebuilds_the_string() -> None:
    key = Key("m", 1, 0, 1, "half", {"t": "v"})
    layer = dataclasses.replace(key, layer_id=2)
    assert str(layer) == "m@1@0@1@half@2@t%v"
    with pytest.raises(InvalidKey):
        dataclasses.replace(key, model="a@b")


def test_layer_key_differs_from_plain_key() -> None:
    assert Key("m", 1, 0, 1, "half", layer_id=0) != Key("m", 1, 0, 1, "half")


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("float16", "half"),
        ("float32", "float"),
        ("float64", "double"),
        ("torch.bfloat16", "bfloat16"),
        ("torch.float16", "half"),
        ("float8_e4m3fn", "fp8_e4m3fn"),
        ("float8_e4m3fnuz", "fp8_e4m3fnuz"),
        ("float8_e5m2", "fp8_e5m2"),
        ("float8_e5m2fnuz", "fp8_e5m2fnuz"),
        *((name, name) for name in sorted(LMCACHE_DTYPES)),
    ],
)
def test_dtype_names_normalize_to_lmcache(given: str, stored: str) -> None:
    assert Key("m", 1, 0, 1, given).dtype == stored


def test_torch_dtype_strings_are_accepted() -> None:
    assert Key("m", 1, 0, 1, str(torch.float16)).dtype == "half"


def test_numpy_and_torch_ints_are_accepted_as_ints() -> None:
    key = Key("m", np.int64(2), np.int32(1), torch.tensor(7), "half")  # type: ignore[arg-type]
    assert (key.world_size, key.worker_id, key.chunk_hash) == (2, 1, 7)
    assert type(key.chunk_hash) is int


def test_key_is_frozen_hashable_and_picklable() -> None:
    key = Key("m", 1, 0, -3, "half", {"t": "v"}, layer_id=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        key.model = "other"  # type: ignore[misc]
    assert {key: 1}[Key("m", 1, 0, -3, "half", {"t": "v"}, layer_id=2)] == 1
    copy = pickle.loads(pickle.dumps(key))
    assert copy == key
    assert str(copy) == str(key)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("a@b", 1, 0, 1, "half"), {}, "'@'"),
        (("", 1, 0, 1, "half"), {}, "empty"),
        (("m\n", 1, 0, 1, "half"), {}, "control"),
        (("m\ud800", 1, 0, 1, "half"), {}, "UTF-8"),
        ((b"m", 1, 0, 1, "half"), {}, "str"),
        (("m", -1, 0, 1, "half"), {}, "world_size"),
        (("m", 0, 0, 1, "half"), {}, "world_size"),
        (("m", 2, -1, 1, "half"), {}, "worker_id"),
        (("m", 2, 2, 1, "half"), {}, "worker_id"),
        (("m", 1.0, 0, 1, "half"), {}, "world_size"),
        (("m", 1, 0, 1, "float16@x"), {}, "'@'"),
        (("m", 1, 0, 1, "complex64"), {}, "unknown dtype"),
        (("m", 1, 0, 1, None), {}, "dtype"),
        (("m", 1, 0, 1.0, "half"), {}, "chunk_hash"),
        (("m", 1, 0, "ff", "half"), {}, "chunk_hash"),
        (("m", 1, 0, True, "half"), {}, "chunk_hash"),
        (("m", 1, 0, None, "half"), {}, "chunk_hash"),
        (("m", 1, 0, torch.tensor(1.5), "half"), {}, "chunk_hash"),
        (("m", 1, 0, 1, "half", {"a@b": "v"}), {}, "'@'"),
        (("m", 1, 0, 1, "half", {"a%b": "v"}), {}, "'%'"),
        (("m", 1, 0, 1, "half", {"k": "v@w"}), {}, "'@'"),
        (("m", 1, 0, 1, "half", {"k": 1}), {}, "str"),
        (("m", 1, 0, 1, "half", {"k": "\x00"}), {}, "control"),
        (("m", 1, 0, 1, "half", [("k", "1"), ("k", "2")]), {}, "duplicate"),
        (("m", 1, 0, 1, "half", ["kv"]), {}, "pairs"),
        (("m", 1, 0, 1, "half", [("k", "v", "w")]), {}, "pairs"),
        (("m", 1, 0, 1, "half", 5), {}, "tags"),
        (("m", 1, 0, 1, "half"), {"layer_id": -1}, "layer_id"),
        (("m", 1, 0, 1, "half"), {"layer_id": "1"}, "layer_id"),
    ],
)
def test_constructor_rejects(
    args: tuple[object, ...], kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidKey, match=message):
        Key(*args, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "m@1@0@ff",  # four parts
        "m@x@0@ff@half",  # non-integer world_size
        "m@1@y@ff@half",  # non-integer worker_id
        "m@01@0@ff@half",  # leading zero
        "m@+1@0@ff@half",
        "m@1@0@xyz@half",  # bad hex
        "m@1@0@@half",  # empty hash
        "m@1@0@FF@half",  # LMCache writes lowercase
        "m@1@0@0xff@half",
        "m@1@0@0ff@half",
        "m@1@0@-0@half",
        "m@1@0@f_f@half",
        "m@1@0@ ff@half",
        "m@1@0@ff@float16",  # an alias is not a stored spelling
        "m@1@0@ff@complex64",
        "m@1@0@ff@half@tag",  # tag without '%'
        "m@1@0@ff@half@007",  # non-canonical layer id
        "m@1@0@ff@half@3@4",  # a second layer id is not a tag
        "m@1@0@ff@half@a%1@a%2",  # duplicate tag
        "m@1@0@ff@half@a%b%c@",  # empty trailing part
        "m@1@1@ff@half",  # worker_id >= world_size
        "m@0@0@ff@half",
        "@1@0@ff@half",  # empty model
        "m\n@1@0@ff@half",
        "m@1@0@ff@half@k%\x7f",
        "m@1@0@ff@half@\ud800%v",
        "m@1@0@ff@half@²",  # str.isdigit() is true, but it is no layer id
        "m@" + "9" * 5000 + "@0@ff@half",  # beyond int()'s digit limit
    ],
)
def test_parse_rejects(text: str) -> None:
    with pytest.raises(InvalidKey):
        Key.parse(text)


def test_parse_rejects_non_str() -> None:
    with pytest.raises(InvalidKey):
        Key.parse(b"m@1@0@ff@half")  # type: ignore[arg-type]


# --- Key properties ---------------------------------------------------------------------------

# Characters that stress the format: separators, digits, hex letters, non-ASCII.
_FIELD_TEXT = st.text(alphabet=st.sampled_from("ab%-_/.0é中 "), max_size=8)
_TAG_NAMES = st.text(alphabet=st.sampled_from("ab-_/.0é "), max_size=6)


@st.composite
def keys(draw: st.DrawFn) -> Key:
    world_size = draw(st.integers(1, 64))
    return Key(
        draw(_FIELD_TEXT.filter(bool)),
        world_size,
        draw(st.integers(0, world_size - 1)),
        draw(st.integers(-(2**64), 2**64)),
        draw(st.sampled_from(sorted(LMCACHE_DTYPES))),
        draw(st.dictionaries(_TAG_NAMES, _FIELD_TEXT, max_size=3)),
        layer_id=draw(st.none() | st.integers(0, 100)),
    )


@given(keys())
def test_any_key_round_trips(key: Key) -> None:
    assert Key.parse(str(key)) == key
    assert str(Key.parse(str(key))) == str(key)


def _key_like_text() -> st.SearchStrategy[str]:
    part = st.text(alphabet=st.sampled_from("0123456789abcdefxAF-%é\n"), max_size=5)
    dtype = st.sampled_from([*sorted(LMCACHE_DTYPES), "float16", "x"])
    structured = st.tuples(
        st.lists(part, min_size=0, max_size=4), dtype, st.lists(part, max_size=4)
    ).map(lambda t: "@".join([*t[0], t[1], *t[2]]))
    return st.one_of(st.text(max_size=30), structured)


@given(_key_like_text())
def test_parse_returns_a_round_tripping_key_or_raises_invalid_key(text: str) -> None:
    try:
        key = Key.parse(text)
    except InvalidKey:
        return
    assert str(key) == text
    assert Key.parse(str(key)) == key


# --- normalize_key ----------------------------------------------------------------------------


def test_normalize_key_plain_strings() -> None:
    assert normalize_key("some/key:1") == "some/key:1"
    assert normalize_key("a" * MAX_KEY_BYTES) == "a" * MAX_KEY_BYTES
    assert normalize_key("é" * (MAX_KEY_BYTES // 2)) == "é" * (MAX_KEY_BYTES // 2)
    assert normalize_key("tab-free unicode: 中文 ✓") == "tab-free unicode: 中文 ✓"


def test_normalize_key_of_key_is_its_string() -> None:
    key = Key("m", 1, 0, -1, "half", {"t": "v"})
    assert normalize_key(key) == "m@1@0@-1@half@t%v"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\x00",
        "a\nb",
        "a\tb",
        "\x1f",
        "\x7f",
        "x\ud800",
        "a" * (MAX_KEY_BYTES + 1),
        "é" * (MAX_KEY_BYTES // 2 + 1),  # 2 bytes each: over by the UTF-8 count, not chars
        "中" * 342,  # 1026 bytes
    ],
)
def test_normalize_key_rejects(text: str) -> None:
    with pytest.raises(InvalidKey):
        normalize_key(text)


def test_normalize_key_rejects_other_types_and_long_keys() -> None:
    with pytest.raises(InvalidKey):
        normalize_key(b"abc")  # type: ignore[arg-type]
    with pytest.raises(InvalidKey):
        normalize_key(None)  # type: ignore[arg-type]
    with pytest.raises(InvalidKey, match="bytes"):
        normalize_key(Key("m" * MAX_KEY_BYTES, 1, 0, 1, "half"))


def _valid_plain_key(text: str) -> bool:
    """The rules, written out independently of the implementation."""
    if not text or any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        return False
    try:
        return len(text.encode("utf-8")) <= MAX_KEY_BYTES
    except UnicodeEncodeError:
        return False


_ANY_CHARS = st.characters() | st.characters(categories=["Cs", "Cc"])


@given(
    st.text(alphabet=_ANY_CHARS, max_size=40)
    | st.text(alphabet=st.sampled_from("aé中\x00"), min_size=300, max_size=1100)
)
def test_normalize_key_follows_the_rules(text: str) -> None:
    if _valid_plain_key(text):
        assert normalize_key(text) == text
    else:
        with pytest.raises(InvalidKey):
            normalize_key(text)


# --- Chunk hashing ----------------------------------------------------------------------------


def h(obj: object) -> bytes:
    """vLLM's sha256_cbor, restated from its definition."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def test_none_hash_is_sha256_of_cbor_seed_string() -> None:
    # CBOR text string "0": major type 3, length 1 (0x61), then b"0".
    assert none_hash("0") == hashlib.sha256(b"\x61\x30").digest()
    assert none_hash("12345") == h("12345")


def test_none_hash_default_follows_pythonhashseed_then_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert none_hash() == none_hash("42")
    monkeypatch.delenv("PYTHONHASHSEED")
    assert none_hash() == none_hash("0")


def test_vllm_chain_known_answer_hand_encoded_cbor() -> None:
    root = none_hash("7")
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    # (parent: 32-byte string, (4 small ints), None) as canonical CBOR, written by hand:
    # 0x83 array(3); 0x58 0x20 bytes(32); 0x84 array(4); 0x01.. small uints; 0xf6 null.
    first = hashlib.sha256(b"\x83\x58\x20" + root + b"\x84\x01\x02\x03\x04\xf6").digest()
    second = hashlib.sha256(b"\x83\x58\x20" + first + b"\x84\x05\x06\x07\x08\xf6").digest()
    assert prefix_hashes(tokens, 4, parent=root) == [first, second]
    partial = hashlib.sha256(b"\x83\x58\x20" + second + b"\x81\x09\xf6").digest()
    assert prefix_hashes(tokens, 4, parent=root, save_partial=True) == [first, second, partial]


def test_vllm_chain_from_definition_with_extra_keys() -> None:
    root = none_hash("0")
    tokens = list(range(1000, 1010))
    extra = ("lora-7", 3)
    first = h((root, tuple(tokens[:5]), extra))
    second = h((first, tuple(tokens[5:]), extra))
    assert prefix_hashes(tokens, 5, parent=root, extra_keys=extra) == [first, second]
    assert prefix_hashes(tokens, 5, parent=root) != [first, second]


def test_vllm_chain_starts_at_none_hash_when_parent_is_falsy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "99")
    expected = prefix_hashes([1, 2], 2, parent=none_hash("99"))
    assert prefix_hashes([1, 2], 2) == expected
    assert prefix_hashes([1, 2], 2, parent=b"") == expected


def test_lmcache_chain_from_definition() -> None:
    root = hash_to_int(none_hash("0"))
    tokens = list(range(100, 111))
    first = hash_to_int(h((root, tuple(tokens[:4]), ())))
    second = hash_to_int(h((first, tuple(tokens[4:8]), ())))
    assert lmcache_prefix_hashes(tokens, 4, parent=root) == [first, second]


def test_lmcache_chain_known_answer() -> None:
    # LMCache 0.5.6 ChunkedTokenDatabase (pre_caching_hash_algorithm: sha256_cbor,
    # PYTHONHASHSEED=0, chunk_size 4) gives these for tokens 100..110.
    tokens = list(range(100, 111))
    expected = [9022303884076447760, 8803788008135940425]
    assert lmcache_prefix_hashes(tokens, 4, parent=hash_to_int(none_hash("0"))) == expected


def test_lmcache_chain_extra_keys_none_is_empty_tuple() -> None:
    tokens = list(range(8))
    assert lmcache_prefix_hashes(tokens, 4, extra_keys=None) == lmcache_prefix_hashes(
        tokens, 4, extra_keys=[]
    )
    assert lmcache_prefix_hashes(tokens, 4, extra_keys=["x"]) != lmcache_prefix_hashes(tokens, 4)


def test_chains_differ() -> None:
    tokens = list(range(8))
    vllm_ints = [hash_to_int(d) for d in prefix_hashes(tokens, 4)]
    assert lmcache_prefix_hashes(tokens, 4) != vllm_ints


def test_hash_to_int_is_first_eight_bytes_big_endian_unsigned() -> None:
    assert hash_to_int(bytes(range(1, 33))) == 0x0102030405060708
    assert hash_to_int(b"\xff" * 32) == 2**64 - 1
    with pytest.raises(ValueError, match="8 bytes"):
        hash_to_int(b"\x00" * 7)


@pytest.mark.parametrize(
    ("num_tokens", "save_partial", "expected"),
    [
        (0, False, []),
        (0, True, []),
        (3, False, []),
        (3, True, [(0, 3)]),
        (8, False, [(0, 4), (4, 8)]),
        (8, True, [(0, 4), (4, 8)]),
        (10, False, [(0, 4), (4, 8)]),
        (10, True, [(0, 4), (4, 8), (8, 10)]),
    ],
)
def test_chunk_counts_with_and_without_partial(
    num_tokens: int, save_partial: bool, expected: list[tuple[int, int]]
) -> None:
    tokens = list(range(num_tokens))
    assert chunk_ranges(num_tokens, 4, save_partial=save_partial) == expected
    assert len(prefix_hashes(tokens, 4, save_partial=save_partial)) == len(expected)
    assert len(lmcache_prefix_hashes(tokens, 4, save_partial=save_partial)) == len(expected)
    chunker = Chunker("m", 1, 0, "half", 4, save_partial=save_partial)
    assert chunker.ranges(tokens) == expected
    assert len(chunker.keys(tokens)) == len(expected)


def test_default_chunk_size_is_256() -> None:
    assert len(prefix_hashes(list(range(600)))) == 2
    assert len(prefix_hashes(list(range(600)), save_partial=True)) == 3


_TOKENS = st.lists(st.integers(0, 200_000), max_size=40)


@settings(max_examples=60)
@given(_TOKENS, st.integers(0, 40), st.integers(1, 8))
def test_prefix_of_tokens_gives_leading_hashes(tokens: list[int], cut: int, size: int) -> None:
    prefix = tokens[:cut]
    full_vllm = prefix_hashes(tokens, size, save_partial=True)
    full_lmcache = lmcache_prefix_hashes(tokens, size, save_partial=True)
    whole = len(prefix) // size  # chunks of the prefix that are full chunks of the whole
    assert prefix_hashes(prefix, size)[:whole] == full_vllm[:whole]
    assert lmcache_prefix_hashes(prefix, size)[:whole] == full_lmcache[:whole]
    assert prefix_hashes(prefix, size, save_partial=True)[:whole] == full_vllm[:whole]


@settings(max_examples=60)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=40), st.data(), st.integers(1, 8))
def test_changing_one_token_changes_its_chunk_and_all_later(
    tokens: list[int], data: st.DataObject, size: int
) -> None:
    index = data.draw(st.integers(0, len(tokens) - 1))
    changed = [*tokens]
    changed[index] += 1
    chunk = index // size
    for chain in (prefix_hashes, lmcache_prefix_hashes):
        before = chain(tokens, size, save_partial=True)
        after = chain(changed, size, save_partial=True)
        assert before[:chunk] == after[:chunk]
        assert all(b != a for b, a in zip(before[chunk:], after[chunk:], strict=True))


def test_parent_continues_a_chain() -> None:
    tokens = list(range(12))
    vllm = prefix_hashes(tokens, 4)
    assert prefix_hashes(tokens[8:], 4, parent=vllm[1]) == vllm[2:]
    lmc = lmcache_prefix_hashes(tokens, 4)
    assert lmcache_prefix_hashes(tokens[8:], 4, parent=lmc[1]) == lmc[2:]


@pytest.mark.parametrize(
    "tokens",
    [tuple(range(10)), range(10), np.arange(10), torch.arange(10)],
    ids=["tuple", "range", "numpy", "torch"],
)
def test_token_containers_hash_like_lists(tokens: object) -> None:
    expected = prefix_hashes(list(range(10)), 4, save_partial=True)
    assert prefix_hashes(tokens, 4, save_partial=True) == expected  # type: ignore[arg-type]
    chunker = Chunker("m", 1, 0, "half", 4, save_partial=True)
    assert chunker.hashes(tokens) == chunker.hashes(list(range(10)))  # type: ignore[arg-type]
    assert chunker.ranges(tokens) == [(0, 4), (4, 8), (8, 10)]  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "4"])
def test_chunk_size_must_be_positive_int(size: object) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        prefix_hashes([1], size)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_size"):
        lmcache_prefix_hashes([1], size)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_size"):
        Chunker("m", 1, 0, "half", size)  # type: ignore[arg-type]


# --- Chunker ----------------------------------------------------------------------------------


def test_chunker_keys_use_lmcache_chain_by_default() -> None:
    chunker = Chunker("llama", 2, 1, "float16", 4, seed="0", tags={"user": "u1"})
    tokens = list(range(100, 111))
    keys = chunker.keys(tokens)
    assert [k.chunk_hash for k in keys] == [9022303884076447760, 8803788008135940425]
    assert str(keys[0]) == "llama@2@1@7d35a9949200f810@half@user%u1"
    assert all(
        (k.model, k.world_size, k.worker_id, k.dtype) == ("llama", 2, 1, "half") for k in keys
    )


def test_chunker_vllm_chain_is_int_form_of_vllm_digests() -> None:
    chunker = Chunker("m", 1, 0, "half", 4, seed="5", chain="vllm")
    tokens = list(range(9))
    digests = prefix_hashes(tokens, 4, parent=none_hash("5"))
    assert chunker.hashes(tokens) == [hash_to_int(d) for d in digests]


def test_chunker_resolves_seed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "1")
    chunker = Chunker("m", 1, 0, "half", 2)
    before = chunker.hashes([1, 2])
    monkeypatch.setenv("PYTHONHASHSEED", "2")
    assert chunker.hashes([1, 2]) == before
    assert Chunker("m", 1, 0, "half", 2).hashes([1, 2]) != before


def test_chunker_validates_at_construction() -> None:
    with pytest.raises(InvalidKey):
        Chunker("a@b", 1, 0, "half")
    with pytest.raises(InvalidKey):
        Chunker("m", 1, 1, "half")
    with pytest.raises(InvalidKey):
        Chunker("m", 1, 0, "complex64")
    with pytest.raises(ValueError, match="chain"):
        Chunker("m", 1, 0, "half", chain="xxhash")  # type: ignore[arg-type]
