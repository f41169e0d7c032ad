"""Codec chains: several codecs applied in order (``[bytesplit, aesgcm]``, ``[kvtc, aesgcm]``).

Configured as a list (``codec: [bytesplit, aesgcm]``, ``codec_options: [{...}, {...}]``), a
chain encodes the object with its first codec, the payload of that with the next (as plain
bytes), and so on; decoding runs the stages backwards. A frame stays self-describing:

- the frame's ``codec`` is the stage names joined by ``+`` (``bytesplit+aesgcm``), so any
  reader knows what to undo, whatever its own tier is configured with; ``load_codec`` builds
  a chain from such a name. A codec name never contains ``+``.
- the frame's ``params`` hold each stage's params under ``<index>.<name>`` (``0.planes``,
  ``1.kid``; a frame's params are flat) and ``sizes``: the length of every stage's output but
  the last (that one is the payload), which is the next stage's input length.

A single codec is not a chain: ``[zstd]`` writes the same frame as ``zstd``. Only the first
stage sees the object (dtype, shape, memory format); later stages see bytes, which lossy
codecs store exactly, so a chain loses at most what its first stage loses.

A keyed stage (``aesgcm``) authenticates, besides the frame binding (key and header,
``gateway.codec.frame_binding``), its position and the params and sizes of the stages before
it: rewriting ``0.planes`` in the header would otherwise decode authentic bytes wrongly. Stages
after it work on the ciphertext, so tampering with theirs fails its tag.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import msgspec

from gateway.codec import Codec, KeyedCodec, is_keyed
from gateway.connector import as_parts
from gateway.errors import ConfigError, CorruptObject, Unsupported
from gateway.frame import FrameInfo
from gateway.objects import ObjectData, ObjectMeta
from gateway.types import Buffer, BufferParts, MemoryFormat, ParamValue

SEPARATOR = "+"
SIZES = "sizes"
# More stages than anyone configures; a frame naming more is refused before anything is built.
MAX_STAGES = 8
# A stage may make its input a little larger (a header, a tag, incompressible pieces): the
# same slack the tiers allow a whole frame (``frame_limit``), plus room for small objects.
_GROWTH_DIVISOR = 64
_GROWTH_FIXED = 1 << 16

_stage_encoder = msgspec.msgpack.Encoder()


def chain_name(names: Sequence[str]) -> str:
    return SEPARATOR.join(names)


def stage_names(name: str) -> list[str]:
    return name.split(SEPARATOR)


class ChainCodec:
    """Its stages applied in order; see the module docstring for the frame it writes."""

    def __init__(self, stages: Sequence[Codec]) -> None:
        if not 2 <= len(stages) <= MAX_STAGES:
            raise ConfigError(
                f"a codec chain has 2 to {MAX_STAGES} codecs, not {len(stages)} (one codec is "
                "just that codec)"
            )
        for stage in stages:
            if SEPARATOR in stage.name:
                raise ConfigError(f"a codec chain cannot contain a chain ({stage.name!r})")
        self.stages = list(stages)
        self.name = chain_name([s.name for s in stages])
        self.lossless = all(s.lossless for s in stages)
        self.keyed = any(is_keyed(s) for s in stages)
        if not self.lossless:
            # Only the first stage sees floats; later ones store their input exactly.
            self.documented_rel_error = max(
                float(getattr(s, "documented_rel_error", 0.0)) for s in stages if not s.lossless
            )

    def __repr__(self) -> str:
        return f"ChainCodec({self.name})"

    # -- encode ------------------------------------------------------------------------------

    def encode(self, obj: ObjectData) -> tuple[BufferParts, dict[str, ParamValue]]:
        if self.keyed:
            raise Unsupported(f"codec chain {self.name!r} has a keyed stage: it needs the key")
        return self._encode(obj, None)

    def encode_bound(
        self, obj: ObjectData, binding: bytes
    ) -> tuple[BufferParts, dict[str, ParamValue]]:
        return self._encode(obj, binding)

    def _encode(
        self, obj: ObjectData, binding: bytes | None
    ) -> tuple[BufferParts, dict[str, ParamValue]]:
        params: dict[str, ParamValue] = {}
        sizes: list[int] = []
        current = obj
        payload: BufferParts = b""
        for index, stage in enumerate(self.stages):
            if index:
                current = _bytes_object(_joined(payload))
            if is_keyed(stage):
                assert binding is not None  # self.keyed: encode() refused
                stage_binding = binding + _stage_context(index, params, sizes)
                payload, own = _keyed(stage).encode_bound(current, stage_binding)
            else:
                payload, own = stage.encode(current)
            for name, value in own.items():
                params[f"{index}.{name}"] = value
            if index < len(self.stages) - 1:
                sizes.append(sum(p.nbytes for p in as_parts(payload)))
        params[SIZES] = list(sizes)
        return payload, params

    # -- decode ------------------------------------------------------------------------------

    def decode(self, payload: memoryview, info: FrameInfo, out: memoryview | None) -> Buffer:
        if self.keyed:
            raise CorruptObject(f"a {self.name!r} frame cannot be verified without its key")
        return self._decode(payload, info, out, None)

    def decode_bound(
        self, payload: memoryview, info: FrameInfo, out: memoryview | None, binding: bytes
    ) -> Buffer:
        return self._decode(payload, info, out, binding)

    def _decode(
        self, payload: memoryview, info: FrameInfo, out: memoryview | None, binding: bytes | None
    ) -> Buffer:
        if info.codec != self.name:
            raise CorruptObject(f"a {info.codec!r} frame given to codec chain {self.name!r}")
        sizes = self._sizes(info)
        own = _stage_params(info.params, len(self.stages))
        inputs = [info.raw_len, *sizes]  # what each stage encoded
        outputs = [*sizes, payload.nbytes]  # what each stage wrote
        data: Buffer = payload
        for index in range(len(self.stages) - 1, -1, -1):
            stage = self.stages[index]
            if index:
                stage_info = msgspec.structs.replace(
                    info,
                    codec=stage.name,
                    kind="bytes",
                    dtype="uint8",
                    shape=[inputs[index]],
                    fmt=int(MemoryFormat.UNDEFINED),
                    raw_len=inputs[index],
                    payload_len=outputs[index],
                    params=own[index],
                )
            else:
                stage_info = msgspec.structs.replace(
                    info, codec=stage.name, payload_len=outputs[0], params=own[0]
                )
            view = memoryview(data).cast("B")
            if view.nbytes != outputs[index]:
                raise CorruptObject(
                    f"stage {index} ({stage.name}) of {self.name}: {view.nbytes} bytes, "
                    f"not the {outputs[index]} recorded"
                )
            stage_out = out if index == 0 else None
            if is_keyed(stage):
                if binding is None:  # pragma: no cover - self.keyed: decode() refused
                    raise CorruptObject(f"{self.name}: a keyed stage without a binding")
                prior = {k: v for k, v in info.params.items() if 0 <= _stage_of(k) < index}
                stage_binding = binding + _stage_context(index, prior, sizes[:index])
                data = _keyed(stage).decode_bound(view, stage_info, stage_out, stage_binding)
            else:
                data = stage.decode(view, stage_info, stage_out)
            if memoryview(data).nbytes != inputs[index]:
                raise CorruptObject(f"stage {index} ({stage.name}) returned the wrong length")
        return data

    def _sizes(self, info: FrameInfo) -> list[int]:
        sizes = info.params.get(SIZES)
        count = len(self.stages) - 1
        if (
            not isinstance(sizes, list)
            or len(sizes) != count
            or not all(type(n) is int for n in sizes)
        ):
            raise CorruptObject(f"{self.name}: bad {SIZES!r} param {sizes!r}")
        # A hostile header must not make a stage allocate more than the object could grow to.
        limit = info.raw_len + len(self.stages) * (info.raw_len // _GROWTH_DIVISOR + _GROWTH_FIXED)
        for n in sizes:
            if not 0 <= int(n) <= limit:
                raise CorruptObject(f"{self.name}: a stage size of {n} bytes is out of bounds")
        return [int(n) for n in sizes]


def _keyed(stage: Codec) -> KeyedCodec:
    return stage  # type: ignore[return-value]  # is_keyed(stage) was checked


def _stage_of(param: str) -> int:
    """The stage a chain param belongs to (``1.kid`` -> 1); ``sizes`` and others: -1."""
    index, dot, _ = param.partition(".")
    return int(index) if dot and index.isdigit() else -1


def _stage_params(params: Mapping[str, ParamValue], count: int) -> list[dict[str, ParamValue]]:
    own: list[dict[str, ParamValue]] = [{} for _ in range(count)]
    for name, value in params.items():
        index = _stage_of(name)
        if index == -1:
            if name != SIZES:
                raise CorruptObject(f"unknown codec chain param {name!r}")
            continue
        if index >= count:
            raise CorruptObject(f"codec chain param {name!r} names no stage")
        own[index][name.partition(".")[2]] = value
    return own


def _stage_context(index: int, prior: Mapping[str, ParamValue], sizes: Sequence[int]) -> bytes:
    """A keyed stage's position and what the stages before it recorded (canonical order)."""
    return _stage_encoder.encode([index, sorted(prior.items()), [int(n) for n in sizes]])


def _joined(payload: BufferParts) -> memoryview:
    parts = as_parts(payload)
    if len(parts) == 1:
        return parts[0]
    return memoryview(b"".join(parts))


def _bytes_object(view: memoryview) -> ObjectData:
    n = view.nbytes
    return ObjectData(ObjectMeta("bytes", "uint8", (n,), n, MemoryFormat.UNDEFINED), view)


def build_chain(stages: Sequence[Codec]) -> Codec:
    """One codec as itself, several as a ``ChainCodec``."""
    if len(stages) == 1:
        return stages[0]
    return ChainCodec(stages)


def with_known_stages(name: str, known: Mapping[str, Codec], load: Callable[[str], Codec]) -> Codec:
    """The codec for a frame's ``codec`` name, using the instances in ``known`` for the stages
    they name (so a frame's ``aesgcm`` stage decrypts with the tier's configured keys) and
    ``load(stage)`` for the others (defaults: decoding needs no options but keys)."""
    names = stage_names(name)
    if len(names) > MAX_STAGES:
        raise CorruptObject(f"a frame names a chain of {len(names)} codecs")
    stages = [known[n] if n in known else load(n) for n in names]
    return build_chain(stages)
