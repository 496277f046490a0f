"""Plots written straight to PNG: line plots (one line per series, optional shaded intervals and
dashed reference lines such as a chance level) and heat maps (with a chance mark on the colour
bar). Each has a ``*_figure`` form returning the ``Figure``; a footer note is wrapped to the
figure's width and kept inside it (``finish``).

Uses matplotlib's object API (``Figure``), never pyplot: no global state, no display needed,
safe under pytest-xdist and on headless machines.
"""

from __future__ import annotations

import io
import math
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

# matplotlib is imported where a figure is made: an entry point that may plot at its end does
# not pay the import at its start.
if TYPE_CHECKING:
    from matplotlib.figure import Figure

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def warm_up() -> None:
    """Pays matplotlib's first-use costs: its imports, the Agg canvas and the font cache (a
    throwaway figure with text, rendered to memory). See ``warm_up_in_background``."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(2.0, 2.0), dpi=40)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([1, 2], [1, 2], label="warm-up")
    ax.xaxis.set_major_formatter(FuncFormatter(tokens_label))
    ax.legend()
    fig.savefig(io.BytesIO(), format="png")


def warm_up_in_background() -> threading.Thread:
    """``warm_up`` in a daemon thread, started now: an entry point that waits on the device
    (scoring, say) and plots at its end starts it meanwhile, so writing its figures does not
    wait on matplotlib's first use; ``join`` it before plotting. A failure is left to the
    figures themselves to report."""

    def run():
        try:
            warm_up()
        except Exception:  # the real figure raises its own error
            pass

    thread = threading.Thread(target=run, name="matplotlib warm-up", daemon=True)
    thread.start()
    return thread


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
    bands: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    hlines: Mapping[str, float] | None = None,
    references: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
) -> str:
    """Write a PNG with one line per ``series`` entry ({label: (xs, ys)}) and return its path
    (``line_figure`` draws it)."""
    return save(line_figure(series, title=title, xlabel=xlabel, ylabel=ylabel, logx=logx,
                            logy=logy, token_axis=token_axis, note=note, bands=bands,
                            hlines=hlines, references=references), path)


def line_figure(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    logy: bool = False,
    token_axis: bool = False,
    note: str | None = None,
    bands: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    hlines: Mapping[str, float] | None = None,
    references: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
) -> Figure:
    """One line per ``series`` entry ({label: (xs, ys)}).

    Points whose y is None or not finite are left out (a run that did not fit, say).
    ``token_axis`` labels x ticks as token counts (2K, 1M) at powers of two. ``bands``
    ({label: (lows, highs)}, at the xs of the series of that label) shade an interval in the
    line's colour where both ends are finite; ``hlines`` ({label: y}) draw dashed horizontal
    reference lines (a chance level, say), and ``references`` ({label: (xs, ys)}) dotted grey
    reference curves, neither drawn like a measured series. ``note`` is a footer, wrapped to
    the figure's width with room kept for it (``finish``).
    """
    if not series:
        raise ValueError("line_plot: series is empty, nothing to plot")
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(7.0, 4.5), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    for label, (xs, ys) in series.items():
        if len(xs) != len(ys):
            raise ValueError(f"line_plot: series {label!r} has {len(xs)} x values but {len(ys)} y values")
        pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and math.isfinite(y)]
        if not pts:
            continue
        px, py = zip(*pts, strict=True)
        (line,) = ax.plot(px, py, marker="o", markersize=3.5, linewidth=1.6, label=str(label))
        if bands and label in bands:
            lows, highs = bands[label]
            if not len(lows) == len(highs) == len(xs):
                raise ValueError(f"line_plot: band {label!r} has {len(lows)} lows and "
                                 f"{len(highs)} highs for {len(xs)} x values")
            band = [(x, lo, hi) for x, lo, hi in zip(xs, lows, highs, strict=True)
                    if lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi)]
            if band:
                bx, blo, bhi = zip(*band, strict=True)
                ax.fill_between(bx, blo, bhi, color=line.get_color(), alpha=0.2, linewidth=0)
    for label, y in (hlines or {}).items():
        ax.axhline(y, color="0.35", linestyle="--", linewidth=1.1, label=str(label))
    for label, (xs, ys) in (references or {}).items():
        ax.plot(xs, ys, color="0.35", linestyle=":", linewidth=1.3, label=str(label))
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
    finish(fig, note)
    return fig


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
    chance: float | None = None,
    figsize: tuple[float, float] | None = None,
) -> str:
    """Write a PNG of ``values_RxC`` as coloured cells (row 0 at the top) and return its path
    (``heatmap_figure`` draws it)."""
    return save(heatmap_figure(values_RxC, row_labels=row_labels, col_labels=col_labels,
                               title=title, xlabel=xlabel, ylabel=ylabel, vmin=vmin, vmax=vmax,
                               colorbar_label=colorbar_label, annotate=annotate, note=note,
                               chance=chance, figsize=figsize), path)


def heatmap_figure(
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
    chance: float | None = None,
    figsize: tuple[float, float] | None = None,
) -> Figure:
    """``values_RxC`` as coloured cells (row 0 at the top).

    Cells that are None or not finite are left blank (grey). ``annotate`` prints each value in
    its cell; the colour scale runs from ``vmin`` to ``vmax``. ``chance``: a dashed line at that
    value across the colour bar, named in its label. ``note``: a footer, as in ``line_figure``.
    ``figsize``: (width, height) in inches; default a size that grows with the cells.
    """
    grid = np.array([[np.nan if v is None else float(v) for v in row] for row in values_RxC],
                    np.float64).reshape(len(values_RxC), -1)
    R, C = grid.shape
    if R == 0 or C == 0:
        raise ValueError(f"heatmap: values are empty ({R} x {C}), nothing to plot")
    if len(row_labels) != R or len(col_labels) != C:
        raise ValueError(f"heatmap: values are {R} x {C} but there are "
                         f"{len(row_labels)} row labels and {len(col_labels)} column labels")
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize or (max(4.5, 1.0 + 0.9 * C), max(3.0, 1.4 + 0.45 * R)), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_facecolor("0.85")  # the blank cells
    image = ax.imshow(np.ma.masked_invalid(grid), vmin=vmin, vmax=vmax, cmap="viridis",
                      aspect="auto", interpolation="nearest")
    bar = fig.colorbar(image, ax=ax)
    label = colorbar_label
    if chance is not None and math.isfinite(chance):
        bar.ax.axhline(min(max(chance, vmin), vmax), color="red", linestyle="--", linewidth=1.5)
        label = f"{label} (dashed: chance {chance:.2g})".strip()
    if label:
        bar.set_label(label)
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
    finish(fig, note)
    return fig


NOTE_FONTSIZE = 7
NOTE_MARGIN = 0.01  # of the figure's width and height, around the footer


def _wrap(text: str, fits) -> str:
    """``text`` broken into lines at spaces (inside a word only when one word alone is too
    wide), each line the longest that ``fits(line)``."""
    lines = []
    for para in text.split("\n"):
        line = ""
        for word in para.split(" "):
            trial = f"{line} {word}" if line else word
            if fits(trial):
                line = trial
                continue
            if line:
                lines.append(line)
                line = ""
                if fits(word):
                    line = word
                    continue
            for ch in word:  # a word too wide for a line alone is cut
                if line and not fits(line + ch):
                    lines.append(line)
                    line = ""
                line += ch
        lines.append(line)
    return "\n".join(lines)


def finish(fig: Figure, note: str | None = None) -> None:
    """Lay ``fig`` out with ``note`` as a footer inside it: the note is wrapped to the figure's
    width (measured, not guessed) and the axes are laid out above it, so neither a long note
    nor the axis labels are cut off or overlap."""
    if not note:
        fig.tight_layout()
        return
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    text = fig.text(NOTE_MARGIN, NOTE_MARGIN, note, fontsize=NOTE_FONTSIZE, alpha=0.7,
                    ha="left", va="bottom")
    room = fig.bbox.width * (1 - 2 * NOTE_MARGIN)

    def fits(line: str) -> bool:
        text.set_text(line)
        return text.get_window_extent(renderer).width <= room

    text.set_text(_wrap(note, fits))
    height = text.get_window_extent(renderer).height / fig.bbox.height
    fig.tight_layout(rect=(0, min(height + 2 * NOTE_MARGIN, 0.5), 1, 1))


def save(fig: Figure, path: str | os.PathLike) -> str:
    """Write ``fig`` to ``path`` as a PNG (its folder made if needed); returns the path."""
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
