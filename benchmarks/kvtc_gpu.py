"""kvtc on a CUDA tensor: encode on the GPU (the transform is a matmul there; the rANS coder
runs on the host), decode on the host; error and speed next to the same chunk from the host.

A SmolLM2-135M-shaped chunk (30 layers, 3 KV heads x 64, 256 tokens, RoPE theta 100000) of
synthetic low-rank K/V; the calibration is fitted here. ``python benchmarks/kvtc_gpu.py``.
"""

from __future__ import annotations

import statistics
import time

import torch

from gateway.codec import encode_frame
from gateway.frame import decode_frame
from gateway.objects import to_object_data
from gateway.types import MemoryFormat
from serde.kvtc import registry
from serde.kvtc import rope as rope_ops
from serde.kvtc.codec import KvtcCodec
from serde.kvtc.fit import Chunk, fit
from serde.kvtc.rope import Rope

LAYERS, HEADS, HEAD_DIM, RANK = 30, 3, 64, 48
ROPE = Rope(HEAD_DIM, 100000.0)
D = HEADS * HEAD_DIM


def chunk(tokens: int, position: int, seed: int) -> torch.Tensor:
    model = torch.Generator().manual_seed(1)
    mix = torch.randn(2, LAYERS, RANK, D, generator=model) / RANK**0.5
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(2, LAYERS, tokens, RANK, generator=g)
    for t in range(1, tokens):
        latent[:, :, t] = 0.8 * latent[:, :, t - 1] + 0.6 * latent[:, :, t]
    kv = latent @ mix + torch.randn(2, LAYERS, tokens, D, generator=g) * 0.05
    kv[0] = rope_ops.apply(kv[0], ROPE, torch.arange(position, position + tokens))
    return kv.half()


def timed(fn, repeat: int = 5) -> float:  # type: ignore[no-untyped-def]
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def main() -> None:
    chunks = [Chunk(chunk(256, 256 * i, 10 + i), 256 * i) for i in range(8)]
    start = time.perf_counter()
    loaded = fit(chunks, group=1, rel_error=0.04, rope=ROPE)
    print(f"fit {time.perf_counter() - start:.1f}s basis {loaded.cal.basis_bytes()} B")
    registry.register(loaded.data)
    codec = KvtcCodec(calibration=loaded.sha256)
    host = chunk(256, 4096, 99)
    nbytes = host.numel() * 2
    dev = host.cuda() if torch.cuda.is_available() else host
    print("device", dev.device, torch.cuda.get_device_name() if dev.is_cuda else "")
    for name, t in (("host", host), ("cuda", dev)):
        obj = to_object_data(t, MemoryFormat.KV_2LTD)
        obj.position = 4096
        head, parts, _ = encode_frame(codec, obj)
        blob = head + b"".join(bytes(p) for p in parts)
        header, body = decode_frame(blob)
        raw = codec.decode(body, header, None)
        got = torch.frombuffer(bytearray(raw), dtype=torch.float16).reshape(host.shape)
        err = [
            float((got[p].float() - host[p].float()).norm() / host[p].float().norm())
            for p in (0, 1)
        ]

        def enc(obj=obj):  # type: ignore[no-untyped-def]
            return encode_frame(codec, obj)

        def dec(body=body, header=header):  # type: ignore[no-untyped-def]
            return codec.decode(body, header, None)

        e, d = timed(enc), timed(dec)
        print(
            f"{name}: ratio {nbytes / len(blob):.2f} K/V error {err[0]:.4f}/{err[1]:.4f} "
            f"encode {nbytes / e / 1e9:.3f} GB/s decode (host) {nbytes / d / 1e9:.3f} GB/s"
        )
    if dev.is_cuda:
        arrays = loaded.arrays(dev.device)
        x = dev[0, 0].float()

        def matmul_only():  # type: ignore[no-untyped-def]
            for p in (0, 1):
                for j in range(LAYERS):
                    arrays[p][j].encode @ x.t()

        print(f"transform alone on the GPU: {nbytes / timed(matmul_only) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
