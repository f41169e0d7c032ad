"""kvtc next to kivi-4 and cachegen on the bench's samples: ratio, errors, GB/s.

Calibrations are fitted here (``serde.kvtc.fit``) from other tokens of the same model:
synthetic: a longer sequence of the bench's synthetic model (seed 0); minilm: MiniLM over the
bench's text, 512 tokens (the bench chunk is its first 256 at a 256-token run: an encoder
model, so the K/V differ, but the text overlaps; read minilm's kvtc rows as optimistic).
kvtc is swept over ``rel_error`` so that its attention error can be read off next to
KIVI-4's. Run from the repository root: ``python benchmarks/kvtc_codec.py [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

from gateway.bench.codecs import Point, measure
from gateway.bench.kv_samples import minilm_kv, synthetic_kv
from gateway.cli.calibrate_sources import from_sample
from serde.kvtc.fit import fit


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--samples", default="minilm,synthetic")
    ap.add_argument("--errors", default="0.02,0.03,0.05,0.08")
    ap.add_argument("--group", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    tmp = Path(tempfile.mkdtemp())
    for name in args.samples.split(","):
        sample = minilm_kv(256) if name == "minilm" else synthetic_kv()
        chunks, rope = from_sample(name, 2 if name == "minilm" else 8, 256)
        points = [Point("kivi", {"bits": 4, "group": 32}), Point("cachegen", {})]
        points += [Point("cachegen", {"quality": q}) for q in (3.5, 7.0)]
        for e in (float(x) for x in args.errors.split(",")):
            start = time.perf_counter()
            loaded = fit(chunks, group=args.group, rel_error=e, rope=rope)
            seconds = time.perf_counter() - start
            path = tmp / f"{name}-{e}.kvtc"
            path.write_bytes(loaded.data)
            ranks = [sum(g.rank for g in p.groups) for p in loaded.cal.planes]
            print(
                f"# {name} rel_error={e}: fit {seconds:.1f}s, basis "
                f"{loaded.cal.basis_bytes()} B, components {ranks}"
            )
            points.append(Point("kvtc", {"calibration": str(path)}))
        for point in points:
            row = measure(sample, point, args.repeat)
            label = point.options_label
            if point.codec == "kvtc":
                label = Path(point.options["calibration"]).stem
            rows.append(
                {"sample": name, "codec": point.codec, "label": label, **dataclasses.asdict(row)}
            )
            if row.error:
                print(name, point.codec, label, row.error)
                continue
            print(
                f"{name:9} {point.codec:8} {label:24} ratio {row.ratio:6.2f} "
                f"attn {row.attention_error:.4f} K {row.k_rel_error:.4f} V {row.v_rel_error:.4f} "
                f"enc {row.encode_gbps:.3f} GB/s dec {row.decode_gbps:.3f} GB/s"
            )
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
