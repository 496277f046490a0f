"""Training-loss curves of several runs side by side: a table at chosen steps, the largest gap
between each run and the first over step ranges, and a PNG.

    python benchmarks/loss_curves.py this=runs/a/metrics.jsonl before=runs/b/metrics.jsonl \
        noise=runs/c/metrics.jsonl --out=curves.png

The steps and ranges follow the runs unless given (``--steps=1,50,100``,
``--ranges=1-50,51-100``): the table has ``--rows`` rows (8) at steps spread evenly from the
first to the last step any run logged, each the first run's logged step nearest its mark, and
the gaps are measured over the first and the second half of that span.

Each run is LABEL=PATH, PATH a trainer's metrics.jsonl (one JSON object per logged step; the
training rows are those with a "loss" and no "split" other than "train"). The first run is the
one the others are compared with; a run of the same code with the sums in another order (more
micro-batches, say) shows how far two runs of one maths drift apart on the card.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kimi_k3.metrics import read_reports
from kimi_k3.plots import line_plot


def read_losses(path: str | Path) -> dict[int, float]:
    """{step: training loss} from a metrics.jsonl."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"loss_curves: no metrics file at {path}")
    losses = {int(r["step"]): float(r["loss"]) for r in read_reports(path)
              if "loss" in r and r.get("split", "train") == "train"}
    if not losses:
        raise ValueError(f"loss_curves: {path} has no training losses")
    return losses


def largest_gaps(runs: dict[str, dict[int, float]], ranges: list[tuple[int, int]]):
    """{(label, (lo, hi)): max |loss - first run's loss| over the steps both logged in [lo, hi]}
    for every run after the first (None where they share no step there)."""
    (_, first), *others = runs.items()
    gaps = {}
    for label, losses in others:
        for lo, hi in ranges:
            d = [abs(losses[s] - first[s]) for s in first if lo <= s <= hi and s in losses]
            gaps[label, (lo, hi)] = max(d) if d else None
    return gaps


def format_report(runs: dict[str, dict[int, float]], steps: list[int],
                  ranges: list[tuple[int, int]]) -> str:
    labels = list(runs)
    lines = ["| step | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for s in steps:
        cells = [f"{runs[k][s]:.4f}" if s in runs[k] else "—" for k in labels]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += ["", f"| largest gap to {labels[0]} | "
              + " | ".join(f"steps {lo}-{hi}" for lo, hi in ranges) + " |",
              "|---" * (len(ranges) + 1) + "|"]
    gaps = largest_gaps(runs, ranges)
    for label in labels[1:]:
        cells = ["—" if gaps[label, r] is None else f"{gaps[label, r]:.4f}" for r in ranges]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spread_steps(runs: dict[str, dict[int, float]], rows: int = 8) -> list[int]:
    """Up to ``rows`` table steps spread evenly over the span of the runs (the first to the last
    step any run logged), each the first run's logged step nearest its even mark; the first
    run's first and last steps are always among them."""
    base = sorted(next(iter(runs.values())))
    lo = min(min(r) for r in runs.values())
    hi = max(max(r) for r in runs.values())
    marks = [lo + (hi - lo) * k / max(rows - 1, 1) for k in range(rows)]
    return sorted({min(base, key=lambda s: (abs(s - m), s)) for m in marks})


def halves(runs: dict[str, dict[int, float]]) -> list[tuple[int, int]]:
    """The span of the runs (the first to the last step any run logged) as its first and
    second half; one range when it is a single step."""
    lo = min(min(r) for r in runs.values())
    hi = max(max(r) for r in runs.values())
    if hi == lo:
        return [(lo, hi)]
    mid = (lo + hi) // 2
    return [(lo, mid), (mid + 1, hi)]


def parse_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    if not sep or not lo.isdigit() or not hi.isdigit() or int(lo) > int(hi):
        raise argparse.ArgumentTypeError(f"a step range is LO-HI with LO <= HI, got {text!r}")
    return int(lo), int(hi)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="LABEL=PATH to a metrics.jsonl; the first is the base")
    ap.add_argument("--steps", default="", help="steps in the table, e.g. 1,50,100; default: "
                    "--rows steps spread over the runs' span")
    ap.add_argument("--rows", type=int, default=8, help="table rows when --steps is not given")
    ap.add_argument("--ranges", default="", help="step ranges of the largest gaps, e.g. "
                    "1-50,51-100; default: the first and second half of the runs' span")
    ap.add_argument("--out", help="PNG of the curves")
    a = ap.parse_args(argv)
    if a.rows < 1:
        ap.error(f"--rows: {a.rows} must be >= 1")
    runs = {}
    for spec in a.runs:
        label, sep, path = spec.partition("=")
        if not sep or not label:
            ap.error(f"each run is LABEL=PATH, got {spec!r}")
        runs[label] = read_losses(path)
    steps = [int(s) for s in a.steps.split(",")] if a.steps else spread_steps(runs, a.rows)
    ranges = [parse_range(r) for r in a.ranges.split(",")] if a.ranges else halves(runs)
    print(format_report(runs, steps, ranges))
    if a.out:
        series = {k: (sorted(v), [v[s] for s in sorted(v)]) for k, v in runs.items()}
        print(line_plot(a.out, series, title="training loss", xlabel="step", ylabel="loss"))


if __name__ == "__main__":
    main()
