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

Runs can be trained first, here: each ``--train=LABEL=FLAGS`` is ``train.py --config=CONFIG
--flags FLAGS`` in ``--work_dir/LABEL`` (``--jobs`` at a time, sharing the device's memory), and
joins the runs after the given paths. ``--noise=LABEL`` names the run whose gap to the first is
the run-to-run noise (the same maths from another seed, say): each other run's largest gaps are
held against it, range by range. Each trained run's non-finite steps are counted (the
``skipped_steps`` of its reports: pass ``--config.train.nan_policy=skip`` so that one does not
end the run). FP8 against bf16 at configs/small.py's shapes, with the noise of a second seed:

    python benchmarks/loss_curves.py --config=configs/small.py --work_dir=/tmp/fp8_loss \
        --flags="--config.data.global_batch_size=8 --config.train.steps=300 \
                 --config.opt.warmup_steps=50 --config.train.nan_policy=skip" --jobs=3 \
        --train=bf16= --train=bf16_seed1=--config.seed=1 \
        --train=fp8=--config.model.matmul_format=fp8 --noise=bf16_seed1 \
        --out=/tmp/fp8_loss/fp8_loss.png --table=/tmp/fp8_loss/fp8_loss.md
    python benchmarks/loss_curves.py --smoke --work_dir=/tmp/loss_smoke     # CPU, tiny

``--smoke``: configs/tiny.py at test size on the CPU, those three runs unless given.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from kimi_k3.metrics import read_reports
from kimi_k3.plots import line_plot

REPO = Path(__file__).resolve().parents[1]
# --smoke: configs/tiny.py shrunk as the tests shrink it (tests/helpers.py's TINY), 8 steps.
SMOKE_FLAGS = ("--config.model.num_layers=2 --config.model.kda_per_mla=1 "
               "--config.model.kda.impl=recurrent --config.data.seq_len=32 "
               "--config.data.global_batch_size=4 --config.data.eval_fraction=0.0 "
               "--config.opt.schedule=constant --config.opt.warmup_steps=2 "
               "--config.train.log_every=1 --config.train.progress_bar=False "
               "--config.train.tensorboard=False --config.train.steps=8 "
               "--config.train.nan_policy=skip --config.checkpoint.enabled=False")
SMOKE_RUNS = ("bf16=", "bf16_seed1=--config.seed=1", "fp8=--config.model.matmul_format=fp8")


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


def within_noise(runs: dict[str, dict[int, float]], ranges: list[tuple[int, int]],
                 noise: str) -> list[str]:
    """One line per run other than the first and ``noise``: its largest gaps to the first run
    against ``noise``'s, range by range, and whether every one is within the noise."""
    gaps = largest_gaps(runs, ranges)
    base, lines = next(iter(runs)), []
    for label in [k for k in list(runs)[1:] if k != noise]:
        pairs = [(gaps[label, r], gaps[noise, r]) for r in ranges]
        cells = ", ".join(f"steps {lo}-{hi}: {'—' if g is None else f'{g:.4f}'} against "
                          f"{'—' if n is None else f'{n:.4f}'}"
                          for (lo, hi), (g, n) in zip(ranges, pairs, strict=True))
        ok = all(g is not None and n is not None and g <= n for g, n in pairs)
        lines.append(f"{label}: largest gap to {base} ({cells} for {noise}, the noise) -> "
                     f"**{'within' if ok else 'outside'} the run-to-run noise**")
    return lines


def nonfinite_steps(path: str | Path) -> tuple[int, int]:
    """(steps a run's reports say were skipped as non-finite, the last step it logged)."""
    rows = [r for r in read_reports(path) if r.get("split", "train") == "train"]
    return (sum(int(r.get("skipped_steps", 0)) for r in rows),
            max((int(r["step"]) for r in rows), default=0))


def train_runs(a) -> tuple[dict[str, str], list[str]]:
    """Each ``--train`` run of ``--config`` through train.py (``--jobs`` at a time): ({label:
    its metrics.jsonl}, a line per run saying how it ended and its non-finite steps)."""
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    common = shlex.split(a.flags)
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    if a.smoke:
        env["JAX_PLATFORMS"] = "cpu"
    if a.jobs > 1:  # runs sharing one device share its memory
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / a.jobs:.2f}")
    pending, running, ended, paths = [], [], {}, {}
    for spec in a.train:
        label, sep, extra = spec.partition("=")
        if not sep or not label:
            raise SystemExit(f"--train: each run is LABEL=FLAGS, got {spec!r}")
        wd = work / label
        if (wd / "metrics.jsonl").exists():
            raise SystemExit(f"--train {label}: {wd} already holds a run; use a fresh --work_dir")
        cmd = [sys.executable, str(REPO / "train.py"), f"--config={a.config}", *common,
               *shlex.split(extra), f"--workdir={wd}"]
        pending.append((label, cmd))
        paths[label] = str(wd / "metrics.jsonl")
    while pending or running:
        while pending and len(running) < a.jobs:
            label, cmd = pending.pop(0)
            print(f"[loss_curves] {label}: {shlex.join(cmd[1:])}", flush=True)
            log = open(work / f"{label}.log", "w")
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            running.append((label, proc, log, time.monotonic()))
        time.sleep(0.2)
        for item in list(running):
            label, proc, log, t0 = item
            if proc.poll() is None and time.monotonic() - t0 < a.timeout_s:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                ended[label] = f"stopped at its limit of {a.timeout_s:.0f} s"
            else:
                ended[label] = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
            log.close()
            running.remove(item)
            print(f"[loss_curves] {label}: {ended[label]}", flush=True)
    lines = []
    for label, path in paths.items():
        bad, last = nonfinite_steps(path) if Path(path).exists() else (0, 0)
        lines.append(f"{label}: {ended[label]}, last step {last}, {bad} non-finite steps "
                     f"(log: {work / label}.log)")
    return paths, lines


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
    ap.add_argument("runs", nargs="*", help="LABEL=PATH to a metrics.jsonl; the first is the base")
    ap.add_argument("--steps", default="", help="steps in the table, e.g. 1,50,100; default: "
                    "--rows steps spread over the runs' span")
    ap.add_argument("--rows", type=int, default=8, help="table rows when --steps is not given")
    ap.add_argument("--ranges", default="", help="step ranges of the largest gaps, e.g. "
                    "1-50,51-100; default: the first and second half of the runs' span")
    ap.add_argument("--out", help="PNG of the curves")
    ap.add_argument("--table", help="Markdown file for what is printed")
    ap.add_argument("--noise", default="", help="LABEL of the run whose gap to the first is the "
                    "run-to-run noise; every other run is held against it")
    ap.add_argument("--config", default="", help="the config the --train runs train")
    ap.add_argument("--train", action="append", default=[], help="LABEL=FLAGS: train.py "
                    "--config=CONFIG --flags FLAGS in --work_dir/LABEL first (repeatable)")
    ap.add_argument("--flags", default="", help="--config.* overrides of every --train run")
    ap.add_argument("--work_dir", default="runs/loss_curves", help="the --train runs' folders")
    ap.add_argument("--jobs", type=int, default=1, help="--train runs at a time (sharing the "
                    "device: XLA_PYTHON_CLIENT_MEM_FRACTION = 0.9 / jobs unless set)")
    ap.add_argument("--timeout_s", type=float, default=900.0, help="each --train run's limit")
    ap.add_argument("--smoke", action="store_true", help="CPU: configs/tiny.py at test size, "
                    "the runs bf16, bf16_seed1 (the noise) and fp8 unless given")
    a = ap.parse_args(argv)
    if a.smoke:
        a.config = a.config or str(REPO / "configs" / "tiny.py")
        a.flags = f"{SMOKE_FLAGS} {a.flags}".strip()
        a.train = a.train or list(SMOKE_RUNS)
        a.noise = a.noise or "bf16_seed1"
        a.jobs = max(a.jobs, 2)
        a.out = a.out or str(Path(a.work_dir) / "loss_curves.png")
    if a.rows < 1:
        ap.error(f"--rows: {a.rows} must be >= 1")
    if a.train and not a.config:
        ap.error("--train needs --config")
    if not a.runs and not a.train:
        ap.error("give runs (LABEL=PATH) or --train runs")
    runs, report = {}, []
    for spec in a.runs:
        label, sep, path = spec.partition("=")
        if not sep or not label:
            ap.error(f"each run is LABEL=PATH, got {spec!r}")
        runs[label] = read_losses(path)
    if a.train:
        paths, report = train_runs(a)
        for label, path in paths.items():
            if Path(path).exists():
                runs[label] = read_losses(path)
    if a.noise and a.noise not in runs:
        ap.error(f"--noise: no run {a.noise!r} among {list(runs)}")
    steps = [int(s) for s in a.steps.split(",")] if a.steps else spread_steps(runs, a.rows)
    ranges = [parse_range(r) for r in a.ranges.split(",")] if a.ranges else halves(runs)
    text = format_report(runs, steps, ranges)
    if a.noise:
        text += "\n\n" + "\n\n".join(within_noise(runs, ranges, a.noise))
    if report:
        text += "\n\nRuns: " + "; ".join(report) + "."
    print(text)
    if a.table:
        Path(a.table).write_text(f"Command: `python benchmarks/loss_curves.py "
                                 f"{shlex.join(argv if argv is not None else sys.argv[1:])}`"
                                 f"\n\n{text}\n")
    if a.out:
        series = {k: (sorted(v), [v[s] for s in sorted(v)]) for k, v in runs.items()}
        print(line_plot(a.out, series, title="training loss", xlabel="step", ylabel="loss"))


if __name__ == "__main__":
    main()
