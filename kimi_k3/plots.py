"""Plots written straight to PNG: line plots (one line per series) and heat maps.

Uses matplotlib's object API (``Figure``), never pyplot: no global state, no display needed,
safe under pytest-xdist and on headless machines.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def tokens_label(x: float, _pos=None) -> str:
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
        ax.xaxis.set_major_formatter(FuncFormatter(tokens_label))
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


def heatmap(
    path: str | os.PathLike,
    values_RxC: Sequence[Sequence[float]],
    *,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    title: str,
    xlabel: str,
    ylabel: str,
    vmin: float = 0.0,
    vmax: float = 1.0,
    colorbar_label: str = "",
    annotate: bool = True,
    note: str | None = None,
) -> str:
    """Write a PNG of ``values_RxC`` as coloured cells (row 0 at the top) and return its path.

    Cells that are None or not finite are left blank (grey). ``annotate`` prints each value in
    its cell; the colour scale runs from ``vmin`` to ``vmax``.
    """
    grid = np.array([[np.nan if v is None else float(v) for v in row] for row in values_RxC],
                    np.float64).reshape(len(values_RxC), -1)
    R, C = grid.shape
    if R == 0 or C == 0:
        raise ValueError(f"heatmap({path}): values are empty ({R} x {C}), nothing to plot")
    if len(row_labels) != R or len(col_labels) != C:
        raise ValueError(f"heatmap({path}): values are {R} x {C} but there are "
                         f"{len(row_labels)} row labels and {len(col_labels)} column labels")
    fig = Figure(figsize=(max(4.5, 1.0 + 0.9 * C), max(3.0, 1.4 + 0.45 * R)), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_facecolor("0.85")  # the blank cells
    image = ax.imshow(np.ma.masked_invalid(grid), vmin=vmin, vmax=vmax, cmap="viridis",
                      aspect="auto", interpolation="nearest")
    bar = fig.colorbar(image, ax=ax)
    if colorbar_label:
        bar.set_label(colorbar_label)
    ax.set_xticks(range(C), [str(c) for c in col_labels])
    ax.set_yticks(range(R), [str(r) for r in row_labels])
    if annotate:
        middle = (vmin + vmax) / 2
        for r in range(R):
            for c in range(C):
                v = grid[r, c]
                if math.isfinite(v):
                    ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=8,
                            color="black" if v > middle else "white")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
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
