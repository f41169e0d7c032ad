"""``aesgcm``: authenticated encryption of the object's bytes (AES-GCM, the ``cryptography``
package), bound to the object's key and header.

Options: ``key_file`` (a path) or ``key_env`` (an environment variable's name), exactly one;
see ``serde.aes_keys`` for the format and rotation (the first key encrypts, every key
decrypts). Key material is never an option: the config text is printed, logged and committed.

Payload: ``salt (16) | nonce (12) | ciphertext (raw_len) | tag (16)``; params: ``kid``, the id
of the key it was written with. Each object is encrypted under its own subkey,
HMAC-SHA256(key, label | salt), with a random 96-bit nonce. Why not a random nonce under the
key itself: GCM with random nonces is limited to 2^32 messages per key (NIST SP 800-38D) and
a repeated nonce leaks the XOR of two plaintexts and the authentication key; a cache writing
10,000 chunks a second reaches 2^32 in five days. With a fresh subkey per object a collision
needs salt and nonce to repeat together (224 random bits), out of reach at any volume. The
subkey is 32 bytes, so the cipher is AES-256 whatever the size of the configured key (whose
own size still bounds the strength). Deriving it costs a few microseconds per object.

Associated data (authenticated, not stored): the frame binding (the object's key and the
header fields that decide what the bytes mean, ``gateway.codec.frame_binding``) and, in a
chain, what the stages before this one recorded. So a wrong key, an unknown key id, a flipped
bit anywhere in salt, nonce, ciphertext or tag, a frame moved to another key or a rewritten
header are all ``CorruptObject`` (a counted miss), never wrong bytes. A key id this process
does not hold is ``KeyUnavailable``: a miss that leaves the object in the backend.

Decoding writes into the caller's buffer before the tag is checked (no second copy of the
object); on a bad tag it raises, and the tier releases that buffer unread.
"""

from __future__ import annotations

import hmac
import os
from typing import Any

import numpy as np

from gateway.errors import (
    ConfigError,
    CorruptObject,
    KeyUnavailable,
    MissingDependency,
    Unsupported,
)
from gateway.frame import FrameInfo
from gateway.objects import ObjectData
from gateway.types import Buffer, BufferParts, ParamValue
from serde.aes_keys import KeyRing, read_key_env, read_key_file

try:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
except ModuleNotFoundError as exc:  # pragma: no cover - the crypto extra installs it
    raise MissingDependency(
        "codec 'aesgcm' needs cryptography: pip install 'kvgate[crypto]'"
    ) from exc

SALT = 16
NONCE = 12
TAG = 16
HEAD = SALT + NONCE
OVERHEAD = HEAD + TAG
_SUBKEY_LABEL = b"kvgate aesgcm subkey v1\x00"
# update_into wants room for a whole block beyond its input (it does not use it for GCM).
_SLACK = 15


def _subkey(key: bytes, salt: bytes) -> bytes:
    return hmac.digest(key, _SUBKEY_LABEL + salt, "sha256")


class AesGcmCodec:
    name = "aesgcm"
    lossless = True
    keyed = True

    def __init__(
        self, key_file: str | None = None, key_env: str | None = None, **options: Any
    ) -> None:
        if options:
            # Only names are echoed: a value may be the key someone tried to paste here.
            material = sorted(o for o in options if "key" in o.lower() or "secret" in o.lower())
            if material:
                raise ConfigError(
                    f"codec aesgcm: option {', '.join(material)} refused: keys come only from "
                    "key_file (a path) or key_env (a variable's name), never from the config"
                )
            raise ConfigError(f"codec aesgcm: unknown options {', '.join(sorted(options))}")
        if (key_file is None) == (key_env is None):
            raise ConfigError(
                "codec aesgcm needs exactly one of key_file (a file of keys) or key_env (the "
                "name of an environment variable holding them)"
            )
        if key_file is not None:
            self.keys: KeyRing = read_key_file(str(key_file))
        else:
            self.keys = read_key_env(str(key_env))

    def __repr__(self) -> str:
        return f"AesGcmCodec(key ids {list(self.keys.ids)})"

    # -- without a binding: refused ----------------------------------------------------------

    def encode(self, obj: ObjectData) -> tuple[BufferParts, dict[str, ParamValue]]:
        raise Unsupported("codec aesgcm binds each object to its key: use encode_frame with it")

    def decode(self, payload: memoryview, info: FrameInfo, out: memoryview | None) -> Buffer:
        raise CorruptObject("an aesgcm frame cannot be verified without its key")

    # -- bound -------------------------------------------------------------------------------

    def encode_bound(
        self, obj: ObjectData, binding: bytes
    ) -> tuple[BufferParts, dict[str, ParamValue]]:
        data = obj.host()
        n = data.nbytes
        kid = self.keys.first
        key = self.keys.key(kid)
        assert key is not None
        salt = os.urandom(SALT)
        nonce = os.urandom(NONCE)
        out = np.empty(OVERHEAD + n + _SLACK, dtype=np.uint8)
        view = out.data.cast("B")
        view[:SALT] = salt
        view[SALT:HEAD] = nonce
        cipher = Cipher(algorithms.AES(_subkey(key, salt)), modes.GCM(nonce)).encryptor()
        cipher.authenticate_additional_data(binding)
        written = cipher.update_into(data, view[HEAD:]) if n else 0
        cipher.finalize()
        if written != n:  # pragma: no cover - GCM is a stream mode
            raise Unsupported(f"aesgcm wrote {written} of {n} bytes")
        view[HEAD + n : OVERHEAD + n] = cipher.tag
        return view[: OVERHEAD + n], {"kid": kid}

    def decode_bound(
        self, payload: memoryview, info: FrameInfo, out: memoryview | None, binding: bytes
    ) -> Buffer:
        n = info.raw_len
        if payload.nbytes != OVERHEAD + n:
            raise CorruptObject(
                f"aesgcm payload of {payload.nbytes} bytes for {n}: expected {OVERHEAD + n}"
            )
        kid = info.params.get("kid")
        if not isinstance(kid, str) or set(info.params) != {"kid"}:
            raise CorruptObject(f"aesgcm frame params {sorted(info.params)}: expected kid only")
        key = self.keys.key(kid)
        if key is None:
            raise KeyUnavailable(
                f"aesgcm frame written with key {kid!r}; this reader holds {list(self.keys.ids)}"
            )
        salt = bytes(payload[:SALT])
        nonce = bytes(payload[SALT:HEAD])
        body = payload[HEAD : HEAD + n]
        tag = bytes(payload[HEAD + n :])
        if out is None or out.nbytes != n:
            out = np.empty(n, dtype=np.uint8).data.cast("B")
        cipher = Cipher(algorithms.AES(_subkey(key, salt)), modes.GCM(nonce)).decryptor()
        cipher.authenticate_additional_data(binding)
        # All but the last few bytes straight into ``out``; update_into needs 15 spare bytes.
        head = max(0, n - _SLACK)
        if head:
            cipher.update_into(body[:head], out)
        out[head:] = cipher.update(body[head:])
        try:
            cipher.finalize_with_tag(tag)
        except InvalidTag:
            raise CorruptObject(
                "aesgcm: authentication failed (tampered bytes or header, or another key "
                "under the same id)"
            ) from None
        return out
