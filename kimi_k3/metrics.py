"""Training metrics: the console, ``<workdir>/metrics.jsonl``, TensorBoard, and a progress bar.

Only process 0 writes. Each JSONL line is one report: ``{"step": s, "split": "train"|"eval",
"time": unix seconds, <metric>: value, ...}``; a resumed run appends to the same file, after
moving the reports of steps past its checkpoint (steps it runs again) to
``metrics_superseded.jsonl``, so the file holds each step's report once.
Per-layer series (``moe_load_max_mean/layer7``) go to the JSONL and TensorBoard, not the console.
``<workdir>/curves.png`` (``plot_curves``) draws the loss (train and held-out), the learning rate
and the gradient norm against the step from metrics.jsonl; the trainer redraws it at each
evaluation and at the end (``MetricsWriter.plot``: a failure to draw is a warning, never the
end of a run).

MFU = model FLOPs per token (``kimi_k3.model.flops_per_token``: forward + backward, counting
KDA's chunked recurrence and MLA's attention per token) x tokens per second / (peak FLOP/s per
device x devices). The peak is ``train.peak_tflops_per_device`` when set, else the dense bf16
peak of the device kind from ``PEAK_TFLOPS`` (None for unknown kinds, e.g. CPUs: no MFU).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import sys
import time

import jax

# Dense bf16 matmul peak per JAX device, TFLOP/s, from the vendors' data sheets. Matched as a
# case-insensitive substring of the card's kind (``device.probe().kind``), first match wins.
PEAK_TFLOPS = (
    ("h200", 989.0),
    ("h100", 989.0),
    ("h800", 989.0),
    ("gh200", 989.0),
    ("b200", 2250.0),
    ("a100", 312.0),
    ("a800", 312.0),
    ("l40s", 362.0),
    ("l4", 121.0),
    ("a10", 125.0),
    ("v100", 125.0),
    ("tpu v6", 918.0),
    ("tpu v5 lite", 197.0),
    ("tpu v5e", 197.0),
    ("tpu v5p", 459.0),
    ("tpu v5", 459.0),
    ("tpu v4", 275.0),
    ("tpu v3", 61.5),  # one device per TensorCore
    ("tpu v2", 23.0),
)


def peak_flops_per_device(device_kind: str, override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one device: the override if > 0, else the table's entry, else None."""
    if override_tflops and override_tflops > 0:
        return float(override_tflops) * 1e12
    kind = device_kind.lower()
    for key, tflops in PEAK_TFLOPS:
        if key in kind:
            return tflops * 1e12
    return None


def mfu(flops_per_token: float, tokens_per_sec: float, peak_per_device: float | None,
        num_devices: int) -> float | None:
    """Model FLOPs utilisation in [0, 1], or None without a known peak."""
    if not peak_per_device:
        return None
    return flops_per_token * tokens_per_sec / (peak_per_device * num_devices)


def read_reports(jsonl_path: str | os.PathLike) -> list[dict]:
    """The reports of a run's ``metrics.jsonl``, one dict a line (blank lines skipped); a line
    that is not JSON raises a ValueError naming the file and the line."""
    rows = []
    with open(jsonl_path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{jsonl_path} line {n} is not JSON ({err})") from None
    return rows


def throughput_summary(jsonl_path: str | os.PathLike) -> dict:
    """Medians over the timed train reports of a run's ``metrics.jsonl``: tokens_per_s,
    step_time_s and mfu (None without a known peak), with ``windows`` (how many reports were
    timed) and the ``final_loss``. The first step (compilation) is never inside a window."""
    rows = read_reports(jsonl_path)
    timed = [r for r in rows if r.get("split") == "train" and "tokens_per_s" in r]
    if not timed:
        raise ValueError(f"{jsonl_path}: no timed report; run more steps than train.log_every")
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    train = [r for r in rows if r.get("split") == "train"]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "mfu": statistics.median(mfus) if mfus else None,
        "windows": len(timed),
        "final_loss": train[-1].get("loss", float("nan")),
    }


CURVES = "curves.png"


def _series(rows: list[dict], split: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` in the ``split`` reports, finite numbers only."""
    pts = [(int(r["step"]), float(r[key])) for r in rows
           if r.get("split", "train") == split and isinstance(r.get(key), int | float)
           and not isinstance(r.get(key), bool) and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_curves(jsonl_path: str | os.PathLike, png_path: str | os.PathLike,
                title: str = "") -> str:
    """A PNG of a run's metrics.jsonl against the step, three panels: the loss (train, and
    held-out where measured), the learning rate, the gradient norm (log scale). Written with
    matplotlib's object API (no pyplot, no display) to a temporary file that then replaces
    ``png_path``, so a viewer never reads half a PNG. Returns ``png_path``."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogFormatter

    rows = read_reports(jsonl_path)
    fig = Figure(figsize=(7.0, 8.0), dpi=100)
    loss_ax, lr_ax, grad_ax = fig.subplots(3, 1, sharex=True)
    steps, loss = _series(rows, "train", "loss")
    loss_ax.plot(steps, loss, linewidth=1.4, label="train")
    steps, loss = _series(rows, "eval", "loss")
    if steps:
        loss_ax.plot(steps, loss, marker="o", markersize=4, linewidth=1.4, label="held out")
    loss_ax.set_ylabel("loss (nats per token)")
    loss_ax.legend(fontsize=8)
    lr_ax.plot(*_series(rows, "train", "lr"), linewidth=1.4, color="tab:green")
    lr_ax.set_ylabel("learning rate")
    steps, grad = _series(rows, "train", "grad_norm")
    grad_ax.plot(steps, grad, linewidth=1.0, color="tab:red")
    if grad and min(grad) > 0:
        grad_ax.set_yscale("log")
        grad_ax.yaxis.set_major_formatter(LogFormatter())  # 0.3, not 3 x 10^-1
        grad_ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    grad_ax.set_ylabel("gradient norm")
    grad_ax.set_xlabel("step")
    for ax in (loss_ax, lr_ax, grad_ax):
        ax.grid(True, alpha=0.35)
    last = max((int(r["step"]) for r in rows), default=0)
    fig.suptitle(f"{title + '  ' if title else ''}step {last:,}", fontsize=10)
    fig.tight_layout()
    png_path = os.fspath(png_path)
    tmp = f"{png_path}.tmp"
    fig.savefig(tmp, format="png")
    os.replace(tmp, png_path)
    return png_path


def peak_memory_bytes() -> int | None:
    """The largest allocator high-water mark over this process's devices, or None where the
    backend keeps no statistics (CPU)."""
    peaks = []
    for d in jax.local_devices():
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def _fmt(v) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.4f}"
    return str(v)


SUPERSEDED = "metrics_superseded.jsonl"


def drop_reports_after(jsonl_path: str | os.PathLike, step: int) -> int:
    """Moves the reports of steps after ``step`` (and a last line cut short by a kill) from
    ``jsonl_path`` to ``metrics_superseded.jsonl`` beside it; returns how many. The file is
    replaced whole, never left half-written."""
    if not os.path.exists(jsonl_path):
        return 0
    keep, drop = [], []
    with open(jsonl_path) as f:
        for line in f:
            try:
                record = json.loads(line) if line.endswith("\n") else None
            except json.JSONDecodeError:
                record = None
            if not line.strip():
                continue
            (keep if record is not None and record.get("step", 0) <= step else drop).append(
                line if line.endswith("\n") else line + "\n")
    if drop:
        with open(os.path.join(os.path.dirname(jsonl_path), SUPERSEDED), "a") as f:
            f.writelines(drop)
        tmp = f"{jsonl_path}.tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, jsonl_path)
    return len(drop)


class MetricsWriter:
    """Writes reports to the console, metrics.jsonl and TensorBoard (process 0 only).

    ``start``: the step a run starts from (its checkpoint's). Reports of later steps, left by an
    earlier start that went past its last checkpoint, are moved out of metrics.jsonl
    (``drop_reports_after``) and hidden in TensorBoard (its ``purge_step``), since this run
    reports those steps again."""

    def __init__(self, workdir: str, enabled: bool = True, tensorboard: bool = True,
                 console=None, start: int = 0):
        self.enabled = enabled
        self.console = console or logging.info
        self.jsonl_path = os.path.join(workdir, "metrics.jsonl")
        self.curves_path = os.path.join(workdir, CURVES)
        self._title = os.path.basename(os.path.normpath(workdir))
        self._written = self._plotted = 0  # reports written, and written when last plotted
        self._jsonl = None
        self._tb = None
        if enabled:
            os.makedirs(workdir, exist_ok=True)
            dropped = drop_reports_after(self.jsonl_path, start)
            if dropped:
                logging.warning("moved %d reports of steps after %d (run again from that "
                                "checkpoint) from %s to %s", dropped, start, self.jsonl_path,
                                SUPERSEDED)
            self._jsonl = open(self.jsonl_path, "a", buffering=1)
            if tensorboard:
                try:
                    from tensorboardX import SummaryWriter
                except ImportError as e:
                    raise ImportError(
                        "train.tensorboard=True needs tensorboardX (pip install tensorboardX); "
                        "or set --config.train.tensorboard=False") from e
                self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"),
                                         purge_step=start + 1)

    def write(self, step: int, metrics: dict, split: str = "train") -> None:
        if not self.enabled:
            return
        record = {"step": int(step), "split": split, "time": round(time.time(), 3), **metrics}
        self._jsonl.write(json.dumps(record) + "\n")  # NaN / Infinity stay readable by json
        self._written += 1
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    self._tb.add_scalar(f"{split}/{k}", v, step)
        # Per-layer series ("moe_load_max_mean/layer7") go to the files only.
        shown = " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items()
                         if v is not None and "/" not in k)
        self.console(f"[{split}] step {step}: {shown}")

    def plot(self) -> str | None:
        """Redraws ``<workdir>/curves.png`` from metrics.jsonl (``plot_curves``) if a report
        was written since the last drawing; returns its path, or None when nothing was drawn.
        A failure (matplotlib missing, a full disk) is logged as a warning and training goes
        on."""
        if not self.enabled or self._written == self._plotted:
            return None
        self._plotted = self._written
        try:
            self._jsonl.flush()
            return plot_curves(self.jsonl_path, self.curves_path, self._title)
        except Exception as e:  # a picture is never worth stopping a run for
            logging.warning("could not draw %s (%s: %s); training goes on", self.curves_path,
                            type(e).__name__, e)
            return None

    def text(self, tag: str, value: str) -> None:
        if self.enabled and self._tb is not None:
            self._tb.add_text(tag, value, 0)

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class ProgressBar:
    """A tqdm bar over steps (rate and ETA), started by ``start`` (after the first step, so the
    rate and ETA leave out compilation).

    Shown only when enabled and stderr is a terminal: in a log file its carriage-return
    redraws would pile up, and the periodic report lines say the same. ``write`` prints a line
    above the bar without breaking it (or logs it when there is no bar).
    """

    def __init__(self, total: int, enabled: bool):
        self.total = total
        self.enabled = enabled and sys.stderr.isatty()
        self._bar = None

    def start(self, initial: int) -> None:
        """Shows the bar at ``initial`` steps done; a no-op once it is shown."""
        if self.enabled and self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, initial=initial, unit="step", dynamic_ncols=True,
                             smoothing=0.1)

    def update(self, n: int = 1, **postfix) -> None:
        """Counts ``n`` more steps, shown with ``postfix`` (the last of them's loss): set
        first, so the redraw that the count triggers shows them together."""
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix({k: _fmt(v) for k, v in postfix.items()}, refresh=False)
            self._bar.update(n)

    def write(self, msg: str) -> None:
        if self._bar is not None:
            self._bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
