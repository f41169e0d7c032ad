"""The aesgcm codec on its own: keys and their sources, rotation, and every kind of tampering
(payload bytes, header fields, the key a frame is stored under) is a CorruptObject, never
wrong bytes. The frames here are forged the way a writer to the backend could forge them: the
frame's own checksums are recomputed, so only the cipher stands between them and the reader.
"""

from __future__ import annotations

import base64
import logging
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from keyed_codecs import OBJECT_KEY, OTHER_KEY, SHARED_KEY, build, write_key_file

from gateway.codec import Codec, decode_payload, encode_frame
from gateway.codec_chain import ChainCodec
from gateway.config import TierConfig
from gateway.errors import ConfigError, CorruptObject, KeyUnavailable, Unsupported
from gateway.frame import FrameHeader, FrameInfo, decode_frame, encode_header
from gateway.objects import ObjectData, to_object_data
from gateway.registry import build_codec, load_codec
from gateway.types import Buffer, BufferParts, ParamValue
from serde.aes_keys import key_id

torch = pytest.importorskip("torch")
pytest.importorskip("cryptography")
# The payload layout (serde/aesgcm.py, which imports cryptography): salt, nonce, ..., tag.
SALT, HEAD, OVERHEAD = 16, 16 + 12, 16 + 12 + 16

MARKER = b"PLAINTEXT-MARKER-"
NEW_KEY = bytes(range(200, 232))


def kv() -> Any:
    g = torch.Generator().manual_seed(0)
    return torch.randn((2, 4, 37, 64), generator=g).to(torch.float16)


def frame_of(codec: Codec, obj: object, key: str = OBJECT_KEY, fmt: int = 1) -> bytes:
    head, parts, _ = encode_frame(codec, to_object_data(obj, fmt=fmt), key)
    return head + b"".join(bytes(p) for p in parts)


def read(codec: Codec, blob: bytes, key: str = OBJECT_KEY) -> bytes:
    header, payload = decode_frame(blob, key=key)
    return bytes(memoryview(decode_payload(codec, payload, header, None, key)))


def forge(
    blob: bytes, key: str = OBJECT_KEY, payload: bytes | None = None, **changes: Any
) -> bytes:
    """``blob`` with another payload or header fields, its checksums made right again."""
    header, body = decode_frame(blob)
    new: FrameHeader = msgspec.structs.replace(header, **changes)
    data = bytes(body) if payload is None else payload
    head, _ = encode_header(
        codec=new.codec,
        kind=new.kind,
        dtype=new.dtype,
        shape=new.shape,
        raw_len=new.raw_len,
        payload=data,
        fmt=new.fmt,
        params=new.params,
        key=key,
    )
    return head + data


def flipped(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x01
    return bytes(out)


@pytest.fixture
def codec() -> Codec:
    return build("aesgcm")


# -- round trips -----------------------------------------------------------------------------


def test_the_layout_is_the_codec_s() -> None:
    from serde import aesgcm

    assert (aesgcm.SALT, aesgcm.HEAD, aesgcm.OVERHEAD) == (SALT, HEAD, OVERHEAD)


def test_round_trip_hides_the_bytes_and_names_its_key(codec: Codec) -> None:
    src = MARKER * 1000
    blob = frame_of(codec, src, fmt=0)
    assert MARKER not in blob
    header, payload = decode_frame(blob)
    assert header.codec == "aesgcm"
    assert header.params == {"kid": key_id(SHARED_KEY)}
    assert payload.nbytes == len(src) + OVERHEAD
    assert read(codec, blob) == src


def test_every_object_gets_its_own_salt_and_nonce(codec: Codec) -> None:
    first, second = (decode_frame(frame_of(codec, MARKER * 10, fmt=0))[1] for _ in range(2))
    assert bytes(first[:HEAD]) != bytes(second[:HEAD])
    assert bytes(first[HEAD:]) != bytes(second[HEAD:])


def test_without_the_key_nothing_is_encoded_or_decoded(codec: Codec) -> None:
    data = to_object_data(b"abc")
    with pytest.raises(Unsupported, match="key"):
        encode_frame(codec, data)
    with pytest.raises(Unsupported):
        codec.encode(data)
    header, payload = decode_frame(frame_of(codec, b"abc", fmt=0))
    with pytest.raises(CorruptObject):
        decode_payload(codec, payload, header, None, None)
    with pytest.raises(CorruptObject):
        codec.decode(payload, header, None)


# -- tampering ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["aesgcm", "bytesplit+aesgcm", "aesgcm+zstd"])
def test_a_flipped_byte_anywhere_in_the_payload_is_corrupt(spec: str) -> None:
    codec = build(spec)
    blob = frame_of(codec, kv())
    _, payload = decode_frame(blob)
    n = payload.nbytes
    assert read(codec, forge(blob)) == read(codec, blob)  # forging alone changes nothing
    for at in (0, SALT - 1, SALT, HEAD - 1, HEAD, n // 2, n - 17, n - 16, n - 1):
        with pytest.raises(CorruptObject) as caught:
            read(codec, forge(blob, payload=flipped(bytes(payload), at)))
        assert not isinstance(caught.value, KeyUnavailable), at


def test_a_rewritten_header_is_corrupt(codec: Codec) -> None:
    src = kv()
    blob = frame_of(codec, src)
    n = src.numel() * 2
    for changes in [
        {"dtype": "bfloat16"},  # the same bytes read as another dtype
        {"shape": [4, 2, 37, 64]},  # or another shape
        {"fmt": 2, "shape": [37, 8, 64]},  # or another memory format
        {"kind": "bytes", "dtype": "uint8", "shape": [n]},  # or as plain bytes
        {"codec": "aesgcm+zstd", "params": {"0.kid": key_id(SHARED_KEY), "sizes": [n + 44]}},
    ]:
        with pytest.raises(CorruptObject):
            read(build(str(changes.get("codec", "aesgcm"))), forge(blob, **changes))


class XorCodec:
    """A stage that trusts its params entirely (any ``mask`` decodes): what a rewritten param
    of an earlier stage can do to a chain when nothing authenticates it."""

    name = "xor"
    lossless = True

    def encode(self, obj: ObjectData) -> tuple[BufferParts, dict[str, ParamValue]]:
        data = np.frombuffer(obj.host(), dtype=np.uint8) ^ np.uint8(0x5A)
        return data.tobytes(), {"mask": 0x5A}

    def decode(self, payload: memoryview, info: FrameInfo, out: memoryview | None) -> Buffer:
        mask = info.params.get("mask")
        assert isinstance(mask, int)
        return (np.frombuffer(payload, dtype=np.uint8) ^ np.uint8(mask)).tobytes()


def test_a_chain_authenticates_the_stages_before_it() -> None:
    chain = ChainCodec([XorCodec(), build("aesgcm")])
    blob = frame_of(chain, b"abc" * 100, fmt=0)
    header, _ = decode_frame(blob)
    assert header.codec == "xor+aesgcm"
    assert header.params["0.mask"] == 0x5A
    assert read(chain, blob) == b"abc" * 100
    with pytest.raises(CorruptObject):
        read(chain, forge(blob, params={**header.params, "0.mask": 0x5B}))
    # and what the binding prevents: the same rewrite of an unchained frame decodes wrongly
    alone = frame_of(XorCodec(), b"abc" * 100, fmt=0)
    assert read(XorCodec(), forge(alone, params={"mask": 0x5B})) != b"abc" * 100


def test_a_frame_moved_to_another_key_is_corrupt(codec: Codec) -> None:
    blob = frame_of(codec, b"value of a", fmt=0)
    moved = forge(blob, key="b")  # bound to b, as a backend writer could rebind it
    with pytest.raises(CorruptObject):
        read(codec, moved, key="b")
    with pytest.raises(CorruptObject):
        read(codec, blob, key="b")  # unforged: the frame's own key check


# -- keys ----------------------------------------------------------------------------------


def test_a_wrong_key_is_a_key_it_does_not_hold(tmp_path: Path) -> None:
    blob = frame_of(build("aesgcm"), b"abc", fmt=0)
    other = build("aesgcm", key_file=write_key_file(tmp_path / "other", OTHER_KEY))
    with pytest.raises(KeyUnavailable, match=key_id(SHARED_KEY)):
        read(other, blob)


def test_a_known_key_id_put_on_another_key_s_frame_is_corrupt(tmp_path: Path) -> None:
    both = build("aesgcm", key_file=write_key_file(tmp_path / "both", SHARED_KEY, OTHER_KEY))
    blob = frame_of(both, b"abc", fmt=0)
    forged = forge(blob, params={"kid": key_id(OTHER_KEY)})
    with pytest.raises(CorruptObject) as caught:
        read(both, forged)
    assert not isinstance(caught.value, KeyUnavailable)


def test_rotation_the_first_key_encrypts_every_key_decrypts(tmp_path: Path) -> None:
    old = build("aesgcm", key_file=write_key_file(tmp_path / "old", SHARED_KEY))
    rotated = build("aesgcm", key_file=write_key_file(tmp_path / "new", NEW_KEY, SHARED_KEY))
    written_before = frame_of(old, b"old object", fmt=0)
    written_after = frame_of(rotated, b"new object", fmt=0)
    assert decode_frame(written_after)[0].params["kid"] == key_id(NEW_KEY)
    assert read(rotated, written_before) == b"old object"
    assert read(rotated, written_after) == b"new object"
    with pytest.raises(KeyUnavailable):
        read(old, written_after)


def test_key_sources_and_formats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blob = frame_of(build("aesgcm"), b"abc", fmt=0)
    path = tmp_path / "keys"
    b64 = base64.b64encode(SHARED_KEY).decode()
    path.write_text(f"# the current key first\n{NEW_KEY.hex()}\n\nbase64:{b64}\n")
    path.chmod(0o600)
    from_file = load_codec("aesgcm", key_file=str(path))
    assert read(from_file, blob) == b"abc"
    monkeypatch.setenv("TEST_AESGCM_KEYS", f"{NEW_KEY.hex()}, {SHARED_KEY.hex()}")
    from_env = load_codec("aesgcm", key_env="TEST_AESGCM_KEYS")
    assert read(from_env, blob) == b"abc"
    for size in (16, 24):
        monkeypatch.setenv("TEST_AESGCM_KEYS", bytes(size).hex())
        load_codec("aesgcm", key_env="TEST_AESGCM_KEYS")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no key"),
        ("# only a comment\n", "no key"),
        ("00" * 20 + "\n", "20 bytes"),
        ("not-hex-at-all\n", "neither hex"),
        ("base64:***\n", "neither hex"),
        (SHARED_KEY.hex() + "\n" + SHARED_KEY.hex() + "\n", "same as an earlier"),
    ],
)
def test_bad_key_files_are_config_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        load_codec("aesgcm", key_file=str(path))
    assert SHARED_KEY.hex() not in str(caught.value)


def test_key_sources_must_exist_and_be_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TEST_AESGCM_UNSET", raising=False)
    with pytest.raises(ConfigError, match="not set"):
        load_codec("aesgcm", key_env="TEST_AESGCM_UNSET")
    with pytest.raises(ConfigError, match="cannot read"):
        load_codec("aesgcm", key_file=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="exactly one"):
        load_codec("aesgcm")
    with pytest.raises(ConfigError, match="exactly one"):
        load_codec("aesgcm", key_file="x", key_env="Y")


@pytest.mark.parametrize("option", ["key", "keys", "key_hex", "secret", "master_key"])
def test_key_material_in_the_config_is_refused_unechoed(option: str) -> None:
    secret = SHARED_KEY.hex()
    with pytest.raises(ConfigError, match="never from the config") as caught:
        load_codec("aesgcm", **{option: secret})
    assert secret not in str(caught.value)


def test_no_key_in_reprs_or_logs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys"
    path.write_text(SHARED_KEY.hex() + "\n")
    path.chmod(0o644)
    with caplog.at_level(logging.DEBUG):
        codec = load_codec("aesgcm", key_file=str(path))
    assert "other users" in caplog.text  # a world-readable key file is warned about
    shown = repr(codec) + str(codec) + repr(getattr(codec, "keys", None)) + caplog.text
    assert key_id(SHARED_KEY) in repr(codec)
    assert SHARED_KEY.hex() not in shown
    assert base64.b64encode(SHARED_KEY).decode() not in shown


# -- configuration of chains ---------------------------------------------------------------


def test_a_one_codec_chain_is_that_codec() -> None:
    assert type(build_codec(["zstd"], [{"level": 5}])) is type(load_codec("zstd"))
    tier = TierConfig.model_validate({"url": "memory://", "codec": ["zstd"], "codec_options": [{}]})
    assert tier.codec == "zstd"
    assert tier.codec_options == {}
    data = to_object_data(b"x" * 1000)
    single = decode_frame(frame_of(load_codec("zstd"), b"x" * 1000, fmt=0))[0]
    listed = decode_frame(frame_of(build_codec(["zstd"], {}), b"x" * 1000, fmt=0))[0]
    assert (single.codec, single.params) == (listed.codec, listed.params) == ("zstd", {"level": 3})
    assert data.meta.nbytes == single.raw_len


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        ({"codec": ["zstd", "aesgcm"], "codec_options": [{}]}, "1 mappings for the 2 codecs"),
        ({"codec": ["zstd", "aesgcm"], "codec_options": {"level": 3}}, "a list, one mapping"),
        ({"codec": "zstd+aesgcm"}, "a chain is a list"),
        ({"codec": "zstd", "codec_options": [{}, {}]}, "2 mappings for one codec"),
        ({"codec": []}, "at least 1"),
    ],
)
def test_bad_chain_configs(tier: dict[str, Any], message: str) -> None:
    from gateway.config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config({"tiers": [{"url": "file:///tmp/x", **tier}]}, env={})


def test_the_http_service_never_builds_a_keyed_codec_for_a_client() -> None:
    pytest.importorskip("fastapi")
    from gateway.http.body import BadRequest, Codecs

    codecs = Codecs()
    for name in ("aesgcm", "zstd+aesgcm"):
        with pytest.raises(BadRequest, match="holds keys"):
            codecs.get(name, '{"key_file": "/etc/hostname"}')
    assert codecs.get("zstd+lz4").name == "zstd+lz4"


def test_a_frame_cannot_name_an_endless_chain() -> None:
    from gateway.codec_chain import MAX_STAGES, with_known_stages

    longest = "+".join(["raw"] * MAX_STAGES)
    assert with_known_stages(longest, {}, load_codec).name == longest
    with pytest.raises(CorruptObject):
        with_known_stages(longest + "+raw", {}, load_codec)
    with pytest.raises(ConfigError, match="a list"):
        load_codec("zstd+lz4", level=1)
