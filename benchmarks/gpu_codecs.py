"""Encode speed of the lossy codecs for a KV chunk on a GPU, next to the same chunk on the host.

For each codec: the wall time of ``encode_frame`` (what a tier does before bytes leave the host:
the CUDA kernels, the copy of the payload to the host, the frame header and its checksum) on a
CUDA tensor and on a host tensor (the numba kernels), and the baselines measured in the same
run: a device-to-host copy of the whole chunk (``tensor.to("cpu")``, what storing it raw costs)
and a host memcpy. Then the kernels alone, on the device, for fp8 and KIVI (encode to a device
payload, decode back to a device tensor) next to a device-to-device memcpy of the chunk.
Input GB/s = chunk bytes / median wall time.

    python benchmarks/gpu_codecs.py [--tokens 256] [--layers 32] [--hidden 1024] [--repeat 7]
                                    [--json PATH]

Needs torch with CUDA and cupy (the codecs fall back to the torch reference without cupy, which
this script reports as the backend in use).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch

from gateway.codec import encode_frame
from gateway.objects import to_object_data
from gateway.registry import load_codec
from gateway.types import MemoryFormat
from gpu import dispatch
from gpu.reference import kivi as kivi_ref
from serde.layout import layout_of

POINTS: tuple[tuple[str, dict[str, object]], ...] = (
    ("fp8", {}),
    ("kivi", {"bits": 2, "group": 32}),
    ("kivi", {"bits": 4, "group": 32}),
    ("cachegen", {}),
)


def median_seconds(fn: Callable[[], object], repeat: int, sync: bool) -> float:
    fn()  # warm-up: kernel compilation, allocator
    times = []
    for _ in range(repeat):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=1024, help="kv heads x head dim")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    report: dict[str, object] = {}

    g = torch.Generator().manual_seed(0)
    host = (torch.randn((2, args.layers, args.tokens, args.hidden), generator=g) * 0.5).to(
        torch.bfloat16
    )
    dev = host.cuda()
    nbytes = host.numel() * host.element_size()
    gb = nbytes / 1e9
    print(f"chunk: KV_2LTD {tuple(host.shape)} bf16, {nbytes / 2**20:.1f} MiB")
    print(f"device: {torch.cuda.get_device_name()}; cupy: {dispatch.has_cupy()}")
    report.update(
        chunk_shape=list(host.shape), chunk_bytes=nbytes, device=torch.cuda.get_device_name()
    )

    out = torch.empty_like(host)
    pinned = torch.empty_like(host).pin_memory()
    d2h = median_seconds(lambda: host.copy_(dev), args.repeat, sync=True)
    d2h_pinned = median_seconds(lambda: pinned.copy_(dev), args.repeat, sync=True)
    memcpy = median_seconds(lambda: out.copy_(host), args.repeat, sync=False)
    print(f"{'baseline':<24} {'GB/s':>8}")
    print(f"{'D2H copy (pageable)':<24} {gb / d2h:8.2f}")
    print(f"{'D2H copy (pinned)':<24} {gb / d2h_pinned:8.2f}")
    print(f"{'host memcpy':<24} {gb / memcpy:8.2f}")
    print()
    report["baselines_gbps"] = {
        "d2h_pageable": gb / d2h,
        "d2h_pinned": gb / d2h_pinned,
        "host_memcpy": gb / memcpy,
    }
    rows: list[dict[str, object]] = []
    head_row = f"{'codec':<28} {'ratio':>6} {'GPU GB/s':>9} {'host GB/s':>9} {'GPU/host':>9}"
    print(f"{head_row} {'GPU backend':>12}")
    for name, options in POINTS:
        codec = load_codec(name, **options)
        label = name + (
            "" if not options else " " + " ".join(f"{k}={v}" for k, v in options.items())
        )
        dev_data = to_object_data(dev, fmt=MemoryFormat.KV_2LTD)
        host_data = to_object_data(host, fmt=MemoryFormat.KV_2LTD)
        head, parts, _ = encode_frame(codec, dev_data)
        stored = len(head) + sum(len(p) for p in parts)
        on_dev = functools.partial(encode_frame, codec, dev_data)
        on_host = functools.partial(encode_frame, codec, host_data)
        t_dev = median_seconds(on_dev, args.repeat, sync=True)
        t_host = median_seconds(on_host, args.repeat, sync=False)
        print(
            f"{label:<28} {nbytes / stored:6.2f} {gb / t_dev:9.2f} {gb / t_host:9.2f} "
            f"{t_host / t_dev:9.1f} {dispatch.backend_for(dev):>12}"
        )
        rows.append(
            {
                "codec": label,
                "ratio": nbytes / stored,
                "encode_frame_gpu_gbps": gb / t_dev,
                "encode_frame_host_gbps": gb / t_host,
                "gpu_backend": dispatch.backend_for(dev),
            }
        )
    report["encode_frame"] = rows
    report["kernels"] = kernels_alone(dev, args.repeat)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def kernels_alone(dev: torch.Tensor, repeat: int) -> dict[str, float]:
    """Device-only GB/s of the fp8 and KIVI kernels, next to a device memcpy of the chunk."""
    from gpu.cuda import fp8 as cuda_fp8
    from gpu.cuda import kivi as cuda_kivi

    gb = dev.numel() * dev.element_size() / 1e9
    canon = layout_of(MemoryFormat.KV_2LTD, tuple(dev.shape)).to_canonical(dev)
    copy = torch.empty_like(dev)
    figures = {"d2d_memcpy": gb / median_seconds(lambda: copy.copy_(dev), repeat, sync=True)}
    scales, codes = cuda_fp8.encode(canon)
    figures["fp8_encode"] = gb / median_seconds(lambda: cuda_fp8.encode(canon), repeat, True)
    figures["fp8_decode"] = gb / median_seconds(
        lambda: cuda_fp8.decode(scales, codes, dev.dtype), repeat, sync=True
    )
    for bits in (2, 4):
        planes, layers, tokens, channels = canon.shape
        geom = kivi_ref.geometry((planes, layers, tokens, channels), dev.dtype, bits, 32, 0)
        payload = cuda_kivi.encode_device(canon, geom)
        assert payload is not None
        figures[f"kivi{bits}_encode"] = gb / median_seconds(
            functools.partial(cuda_kivi.encode_device, canon, geom), repeat, sync=True
        )
        figures[f"kivi{bits}_decode"] = gb / median_seconds(
            functools.partial(cuda_kivi.decode, payload, geom, dev.dtype), repeat, sync=True
        )
    print()
    print(f"{'kernel (device only)':<24} {'GB/s':>8} {'vs memcpy':>10}")
    for name, value in figures.items():
        print(f"{name:<24} {value:8.1f} {value / figures['d2d_memcpy']:10.2f}")
    return figures


if __name__ == "__main__":
    main()
