"""aesgcm alone and in chains on one 32 MiB fp16 KV chunk, next to a memcpy in the same run.

Each spec goes through the path a tier takes: ``encode_frame`` (payload checksum included) ->
``decode_frame`` (checksum verified) -> ``decode_payload`` into a preallocated buffer. GB/s of
input bytes, the median of ``--repeat`` runs. A throwaway key is written to a temporary file.

    python benchmarks/aesgcm_chain.py [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gateway.codec import Codec, decode_payload, encode_frame
from gateway.codec_chain import stage_names
from gateway.frame import decode_frame
from gateway.objects import to_object_data
from gateway.registry import build_codec, codec_class

SPECS = ["raw", "aesgcm", "bytesplit", "bytesplit+aesgcm", "fp8+aesgcm"]
KEY = "bench/chunk"


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm: numba kernels, page faults of the output buffers
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build(spec: str, key_file: Path) -> Codec:
    names = stage_names(spec)
    options: list[dict[str, Any]] = [
        {"key_file": str(key_file)} if getattr(codec_class(s), "keyed", False) else {}
        for s in names
    ]
    return build_codec(names[0], options[0]) if len(names) == 1 else build_codec(names, options)


def decode(codec: Codec, blob: bytes, out: memoryview) -> None:
    header, payload = decode_frame(blob, key=KEY)
    decode_payload(codec, payload, header, out, KEY)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    chunk = (torch.randn((2, 32, 256, 1024), generator=g) * 0.5).to(torch.float16)
    n = chunk.numel() * chunk.element_size()
    src = chunk.view(torch.uint8).reshape(-1).numpy()
    dst = np.empty_like(src)
    memcpy = median_seconds(functools.partial(np.copyto, dst, src), args.repeat)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        key_file = Path(tmp) / "key"
        key_file.write_text(os.urandom(32).hex() + "\n")
        key_file.chmod(0o600)
        data = to_object_data(chunk, fmt=1)
        for spec in SPECS:
            codec = build(spec, key_file)
            head, parts, _ = encode_frame(codec, data, KEY)
            blob = head + b"".join(bytes(p) for p in parts)
            out = memoryview(bytearray(n))
            enc = median_seconds(functools.partial(encode_frame, codec, data, KEY), args.repeat)
            dec = median_seconds(functools.partial(decode, codec, blob, out), args.repeat)
            rows.append(
                {
                    "codec": spec,
                    "ratio": round(n / len(blob), 3),
                    "encode_gbps": round(n / enc / 1e9, 2),
                    "decode_gbps": round(n / dec / 1e9, 2),
                }
            )
    report = {"bytes": n, "memcpy_gbps": round(n / memcpy / 1e9, 2), "codecs": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"32 MiB fp16 chunk; memcpy {report['memcpy_gbps']} GB/s in the same run")
    for row in rows:
        print(
            f"{row['codec']:<18} ratio {row['ratio']:>6}  encode {row['encode_gbps']:>6} GB/s"
            f"  decode {row['decode_gbps']:>6} GB/s"
        )


if __name__ == "__main__":
    main()
