"""The PNG of ``kvgate bench scale --plot``: one panel per measure, log-log axes, so that a
curve's slope is its growth exponent (flat: constant; a 45-degree rise: linear)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def draw_scale(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    panels: list[str] = []
    if "objects" in report:
        panels += ["latency", "memory"]
    if "clients" in report:
        panels += ["throughput", "p99"]
    if not panels:
        return
    cols = min(2, len(panels))  # two by two when both curves are drawn
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6.2 * cols, 4.6 * nrows), squeeze=False)
    ax_of = dict(zip(panels, axes.flat, strict=False))
    if "objects" in report:
        pts = report["objects"]["points"]
        n = [p["objects"] for p in pts]
        ax = ax_of["latency"]
        for name, style in (("put", "o-"), ("get", "s-")):
            ax.plot(n, [p[f"{name}_p50_ms"] for p in pts], style, label=f"{name} p50")
            ax.plot(n, [p[f"{name}_p99_ms"] for p in pts], style + "-", label=f"{name} p99")
        ax.set(xscale="log", yscale="log", xlabel="objects in the disk tier", ylabel="ms")
        ax.set_title(f"disk tier latency ({report['objects']['object_size']:,} B objects)")
        ax.legend(fontsize=8)
        ax = ax_of["memory"]
        ax.plot(
            n,
            [p["index_bytes_per_object"] * p["objects"] / 2**20 for p in pts],
            "o-",
            label="index RSS (MiB)",
        )
        ax.plot(n, [p["open_s"] for p in pts], "s-", label="start, scanning (s)")
        saved = [p.get("snapshot_open_s") for p in pts]
        if all(v is not None for v in saved):
            ax.plot(n, saved, "s--", label="start, saved index (s)")
        ax.set(xscale="log", yscale="log", xlabel="objects in the disk tier")
        ax.set_title("index memory and start-up time")
        ax.legend(fontsize=8)
    if "clients" in report:
        pts = report["clients"]["points"]
        for size in sorted({p["size"] for p in pts}):
            rows = [p for p in pts if p["size"] == size]
            c = [p["clients"] for p in rows]
            label = f"{size / 2**20:g} MiB" if size >= 2**20 else f"{size / 2**10:g} KiB"
            for phase, style in (("put", "o-"), ("get", "s--")):
                ax_of["throughput"].plot(
                    c, [p[phase]["ops_per_s"] for p in rows], style, label=f"{phase} {label}"
                )
                ax_of["p99"].plot(
                    c, [p[phase]["p99_ms"] for p in rows], style, label=f"{phase} {label}"
                )
        ax_of["throughput"].set(
            xscale="log", yscale="log", xlabel="concurrent clients", ylabel="requests/s"
        )
        ax_of["throughput"].set_title("kvgate serve throughput")
        ax_of["p99"].set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="p99 ms")
        ax_of["p99"].set_title("kvgate serve p99 latency")
        for name in ("throughput", "p99"):
            ax_of[name].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
