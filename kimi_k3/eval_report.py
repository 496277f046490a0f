"""eval.py's outputs, from the report ``evaluation.run`` returns: the perplexity table it prints
and the files it writes to --workdir.

- ``eval.json``: the whole report (options, window counts per context length, and per model
  its label, checkpoint, config, step, parameter count and per-length results with buckets);
- ``eval_perplexity.csv``: one row per (model, context length): windows, targets, loss (nats),
  perplexity, the short-document rule and its counts, seconds;
- ``eval_loss_by_position.csv``: one row per (model, context length, position bucket);
- ``eval_perplexity.png``: perplexity against context length, one line per model;
- ``eval_loss_by_position.png``: loss against token position at each model's longest context.

The PNGs are left out (and absent from the returned paths) when no model scored any length.
"""

from __future__ import annotations

import csv
import json
import math
import os

from kimi_k3 import plots


def format_table(report: dict) -> str:
    """Perplexity table: one row per model, one column per context length."""
    lengths = sorted(int(L) for L in report["windows"])
    head = ["model"] + [f"L={L}" for L in lengths]
    rows = []
    for m in report["models"]:
        cells = [m["label"]]
        for L in lengths:
            r = m["results"].get(str(L))
            cells.append(f"{r['perplexity']:.3f}" if r else "-")
        rows.append(cells)
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows, strict=True)]
    fmt = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True))
    lines = ["perplexity (held-out, short_docs=" + report["short_docs"] + ")", fmt(head)]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def write_outputs(report: dict, workdir: str) -> dict[str, str]:
    """eval.json, eval_perplexity.csv, eval_loss_by_position.csv and two PNGs in ``workdir``
(module docstring); returns {kind: path} of what was written."""
    paths = {
        "json": os.path.join(workdir, "eval.json"),
        "csv": os.path.join(workdir, "eval_perplexity.csv"),
        "positions_csv": os.path.join(workdir, "eval_loss_by_position.csv"),
        "perplexity_png": os.path.join(workdir, "eval_perplexity.png"),
        "positions_png": os.path.join(workdir, "eval_loss_by_position.png"),
    }
    with open(paths["json"], "w") as f:
        json.dump(report, f, indent=1)
    with open(paths["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "context_length", "windows", "targets", "loss", "perplexity",
                    "short_docs", "docs_used", "docs_skipped", "seconds"])
        for m in report["models"]:
            for L, r in m["results"].items():
                w.writerow([m["label"], L, r["windows_used"], r["targets"], f"{r['loss']:.6f}",
                            f"{r['perplexity']:.6f}", r["short_docs"], r["docs_used"],
                            r["docs_skipped"], f"{r['seconds']:.3f}"])
    with open(paths["positions_csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "context_length", "position_lo", "position_hi", "loss", "targets"])
        for m in report["models"]:
            for L, r in m["results"].items():
                for b in r["buckets"]:
                    w.writerow([m["label"], L, b["lo"], b["hi"], f"{b['loss']:.6f}", b["targets"]])

    ppl_series, pos_series = {}, {}
    for m in report["models"]:
        res = {int(L): r for L, r in m["results"].items()}
        if not res:
            continue
        Ls = sorted(res)
        ppl_series[m["label"]] = (Ls, [res[L]["perplexity"] for L in Ls])
        longest = res[Ls[-1]]
        mids = [math.sqrt(b["lo"] * b["hi"]) for b in longest["buckets"]]
        pos_series[f"{m['label']} (L={Ls[-1]})"] = (mids, [b["loss"] for b in longest["buckets"]])
    note = f"held-out data, short_docs={report['short_docs']}"
    if ppl_series:
        plots.line_plot(paths["perplexity_png"], ppl_series, title="Perplexity against context length",
                        xlabel="context length (tokens)", ylabel="perplexity", logx=True,
                        token_axis=True, note=note)
        plots.line_plot(paths["positions_png"], pos_series,
                        title="Loss against token position (longest context)",
                        xlabel="token position (log-spaced buckets)", ylabel="NLL (nats / token)",
                        logx=True, note=note)
    else:
        for key in ("perplexity_png", "positions_png"):
            paths.pop(key)
    return paths
