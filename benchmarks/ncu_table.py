"""Per-kernel times from an Nsight Compute report, one column per profiler window, as markdown.

    ncu --import ours.ncu-rep --page raw --csv --metrics gpu__time_duration.sum > ours.csv
    python3 benchmarks/ncu_table.py ours.csv --labels "defaults;stages_intra=2"

kda_profile.py opens one window per --tune value and every window launches the same kernels,
so a window starts wherever the report's first kernel name comes again. Prints the kernels'
times in ms (rows) by window (columns) and each window's total.
"""

from __future__ import annotations

import argparse
import csv
import sys


def read_windows(path: str) -> list[list[tuple[str, float]]]:
    """[(kernel name, ms)] per window, in launch order."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    try:
        header = rows[0]
        name_col, time_col = header.index("Kernel Name"), header.index("gpu__time_duration.sum")
    except (IndexError, ValueError):
        raise SystemExit(f"{path}: not an ncu raw CSV with 'Kernel Name' and "
                         "'gpu__time_duration.sum' columns") from None
    unit = rows[1][time_col]  # the second row holds the units
    scale = {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0,
             "nsecond": 1e-6}.get(unit, 1.0)
    kernels = [(r[name_col], float(r[time_col].replace(",", "")) * scale) for r in rows[2:]]
    windows: list[list[tuple[str, float]]] = []
    for name, ms in kernels:
        if not windows or name == kernels[0][0]:
            windows.append([])
        windows[-1].append((name, ms))
    return windows


def table(windows, labels) -> str:
    names = list(dict.fromkeys(n for w in windows for n, _ in w))
    lines = ["| kernel (ms) | " + " | ".join(labels) + " |",
             "|---" * (len(labels) + 1) + "|"]
    for name in names:
        cells = [f"{sum(ms for n, ms in w if n == name):.3f}" if any(n == name for n, _ in w)
                 else "—" for w in windows]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| **total** | " + " | ".join(f"**{sum(ms for _, ms in w):.3f}**"
                                                for w in windows) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --page raw --csv output with gpu__time_duration.sum")
    ap.add_argument("--labels", default="", help="window names, separated by ';'")
    args = ap.parse_args(argv)
    windows = read_windows(args.csv)
    labels = [label or "defaults" for label in args.labels.split(";")] if args.labels else []
    labels += [f"window {i}" for i in range(len(labels), len(windows))]
    print(table(windows, labels[:len(windows)]))


if __name__ == "__main__":
    sys.exit(main())
