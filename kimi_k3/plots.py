"""Line plots written straight to PNG, one line per series.

Uses matplotlib's object API (``Figure``), never pyplot: no global state, no display needed,
safe under pytest-xdist and on headless machines.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _tokens_label(x: float, _pos=None) -> str:
    """2048 -> '2K', 1048576 -> '1M': axis labels for token counts."""
    if x <= 0 or not math.isfinite(x):
        return ""
    for unit, div in (("M", 2**20), ("K", 2**10)):
        if x >= div and x % div == 0:
            return f"{int(x // div)}{unit}"
    return f"{x:g}"


def line_plot(
    path: str | os.PathLike,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    logy: bool = False,
    token_axis: bool = False,
    note: str | None = None,
) -> str:
    """Write a PNG with one line per ``series`` entry ({label: (xs, ys)}) and return its path.

    Points whose y is None or not finite are left out (a run that did not fit, say).
    ``token_axis`` labels x ticks as token counts (2K, 1M) at powers of two.
    """
    if not series:
        raise ValueError(f"line_plot({path}): series is empty, nothing to plot")
    fig = Figure(figsize=(7.0, 4.5), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    for label, (xs, ys) in series.items():
        if len(xs) != len(ys):
            raise ValueError(f"line_plot: series {label!r} has {len(xs)} x values but {len(ys)} y values")
        pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and math.isfinite(y)]
        if not pts:
            continue
        px, py = zip(*pts, strict=True)
        ax.plot(px, py, marker="o", markersize=3.5, linewidth=1.6, label=str(label))
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    if token_axis:
        ax.xaxis.set_major_formatter(FuncFormatter(_tokens_label))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.35)
    ax.legend(fontsize=8)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, alpha=0.7)
    fig.tight_layout()
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, format="png")
    return path


def is_png(path: str | os.PathLike) -> bool:
    """True when ``path`` starts with the PNG signature and holds an IHDR of non-zero size."""
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:8] != PNG_SIGNATURE or head[12:16] != b"IHDR":
        return False
    width = int.from_bytes(head[16:20], "big")
    height = int.from_bytes(head[20:24], "big")
    return width > 0 and height > 0
