"""The rate-distortion plot of ``kvgate bench codecs``: bits per element against the error of
attention outputs, one panel per sample, one colour and marker per codec; a sample measured end
to end (smollm2) gets a second panel with the KL of the model's next-token distributions.

It draws from the ``--json`` form of the report (sample name -> rows), so a saved run can be
plotted again. The error axis is logarithmic and cannot show 0, so exact (lossless) points sit
on a dashed baseline below the lowest lossy error, labelled as error 0. Only matplotlib's
object API is used (``Figure`` renders PNG through Agg): no pyplot, no display, no global
backend switch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway.errors import MissingDependency

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")
Rows = Sequence[Mapping[str, Any]]


# The y axis of a panel: a row field and how to name it.
METRICS = {
    "attention_error": "attention-output relative error",
    "kl": "end-to-end KL(exact || decoded), nats",
}


def _valid(rows: Rows, metric: str = "attention_error") -> list[Mapping[str, Any]]:
    return [
        r
        for r in rows
        if r.get("error") is None
        and r.get("bits_per_element") is not None
        and r.get(metric) is not None
    ]


def _baseline(samples: Mapping[str, Rows], metric: str = "attention_error") -> float:
    """A y value a decade below the smallest non-zero error anywhere (shared by the panels of
    a metric, so the baseline sits at the same height in each)."""
    errors = [r[metric] for rows in samples.values() for r in _valid(rows, metric)]
    positive = [e for e in errors if e > 0]
    if not positive:
        return 1e-4
    return float(10 ** (math.floor(math.log10(min(positive))) - 1))


def draw_rate_distortion(
    samples: Mapping[str, Rows],
    path: str | Path,
    *,
    input_bits: int = 16,
    title: str = "kvgate codecs: rate vs distortion",
) -> Path:
    """Write the PNG to ``path`` and return it. ``samples``: name -> rows as in ``--json``."""
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        raise MissingDependency("the plot needs matplotlib: pip install 'kvgate[bench]'") from None

    codecs = sorted({r["codec"] for rows in samples.values() for r in _valid(rows)})
    style = {c: (f"C{i % 10}", MARKERS[i % len(MARKERS)]) for i, c in enumerate(codecs)}
    floors = {m: _baseline(samples, m) for m in METRICS}
    panels = [(name, rows, "attention_error") for name, rows in samples.items()]
    panels += [
        (f"{name}: end to end", rows, "kl") for name, rows in samples.items() if _valid(rows, "kl")
    ]
    n = max(len(panels), 1)
    fig = Figure(figsize=(6.4 * n, 5.0), layout="constrained")
    axes = fig.subplots(1, n, squeeze=False)[0]
    for ax, (name, rows, metric) in zip(axes, panels, strict=False):
        _panel(ax, name, _valid(rows, metric), style, floors[metric], input_bits, metric)
    if codecs:
        handles, labels = axes[0].get_legend_handles_labels()
        for ax in axes[1:]:  # a codec may appear in a later panel only
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
        fig.legend(handles, labels, loc="outside right center", title="codec")
    fig.suptitle(title)
    out = Path(path)
    fig.savefig(out, format="png", dpi=110)
    return out


def _panel(
    ax: Any,
    name: str,
    rows: list[Mapping[str, Any]],
    style: Mapping[str, tuple[str, str]],
    floor: float,
    input_bits: int,
    metric: str = "attention_error",
) -> None:
    ax.set_yscale("log")
    ax.set_title(name)
    ax.set_xlabel(f"bits per element (input: {input_bits})")
    ax.set_ylabel(METRICS[metric])
    ax.grid(True, which="major", alpha=0.4)
    ax.grid(True, which="minor", alpha=0.12)
    ax.axvline(input_bits, color="grey", linestyle=":", linewidth=1)
    ax.axhline(floor, color="grey", linestyle="--", linewidth=1)
    ax.annotate(
        "error 0 (exact)",
        (0.01, floor),
        xycoords=("axes fraction", "data"),
        xytext=(0, 3),
        textcoords="offset points",
        fontsize=8,
        color="grey",
    )
    for codec in sorted({r["codec"] for r in rows}):
        color, marker = style[codec]
        mine = sorted(
            (r for r in rows if r["codec"] == codec), key=lambda r: float(r["bits_per_element"])
        )
        xs = [float(r["bits_per_element"]) for r in mine]
        ys = [float(r[metric]) or floor for r in mine]
        ax.plot(xs, ys, color=color, marker=marker, markersize=7, linewidth=1, label=codec)
        if len(mine) < 2:
            continue
        for r, x, y in zip(mine, xs, ys, strict=True):  # name a codec's operating points
            text = r.get("label") or " ".join(f"{k}={v}" for k, v in r["options"].items())
            ax.annotate(text, (x, y), xytext=(4, 4), textcoords="offset points", fontsize=7)
    _name_exact_points(ax, rows, floor, metric)
    xs = [float(r["bits_per_element"]) for r in rows]
    ys = [float(r[metric]) for r in rows]
    ax.set_xlim(left=0, right=max([input_bits + 1.0, *(x + 1 for x in xs)]))
    # Room above the largest error, and at least two decades when all points are exact.
    ax.set_ylim(bottom=floor / 3, top=max([floor * 100, *(y * 3 for y in ys)]))


def _name_exact_points(
    ax: Any, rows: list[Mapping[str, Any]], floor: float, metric: str = "attention_error"
) -> None:
    """Name the codecs on the baseline, stacking names of points that (nearly) coincide:
    lossless codecs that do not compress (raw, lz4 on fp16) all sit at the input's bits."""
    exact = sorted((float(r["bits_per_element"]), str(r["codec"])) for r in rows if not r[metric])
    level, last = 0, -1e9
    for x, codec in exact:
        level = level + 1 if x - last < 0.6 else 0
        last = x
        ax.annotate(
            codec,
            (x, floor),
            xytext=(-4, 6 + 9 * level),
            textcoords="offset points",
            fontsize=7,
            ha="right",
        )
