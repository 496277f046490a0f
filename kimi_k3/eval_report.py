"""eval.py's outputs, from the report ``evaluation.run`` returns: the tables it prints and the
files it writes to --workdir. Every figure comes with its 95% bootstrap interval over documents
(``eval_scoring``'s module docstring says what is measured and how).

- the printed tables: perplexity, then (with ``short_docs="same"``) the change in loss from the
  shortest length with its paired interval, then bits per byte (or why it was not computed);
  one row per model, one column per context length, each cell ``value [low, high]``;
- ``eval.json``: the whole report (options, the interval's method, window and document counts
  per context length, and per model its label, checkpoint, config, step, parameter count and
  per-length results with intervals and position buckets);
- ``eval_perplexity.csv``: one row per (model, context length): windows, targets, loss (nats),
  perplexity, bits per byte, each with its interval, the interval's unit and count, the
  short-document rule and every document counted, the paired change in loss from the shortest
  length, seconds;
- ``eval_loss_by_position.csv``: one row per (model, context length, position bucket): its
  positions, loss with interval, and targets;
- ``eval_perplexity.png``: perplexity against context length, one line per model, the interval
  shaded;
- ``eval_loss_by_position.png``: loss against token position at each model's longest context,
  the interval shaded.

The PNGs are left out (and absent from the returned paths) when no model scored any length.
"""

from __future__ import annotations

import csv
import json
import math
import os

from kimi_k3 import plots

PERPLEXITY_COLUMNS = [
    "label", "context_length", "windows", "targets", "loss", "loss_ci_lo", "loss_ci_hi",
    "perplexity", "perplexity_ci_lo", "perplexity_ci_hi", "bytes", "bits_per_byte",
    "bits_per_byte_ci_lo", "bits_per_byte_ci_hi", "ci_unit", "ci_units", "short_docs",
    "docs_total", "docs_skipped", "docs_dropped", "docs_used", "windows_available",
    "loss_change_from", "loss_change", "loss_change_ci_lo", "loss_change_ci_hi", "seconds",
]
POSITION_COLUMNS = ["label", "context_length", "position_lo", "position_hi", "loss", "loss_ci_lo",
                    "loss_ci_hi", "targets"]


def _cell(value, ci, digits: int = 3) -> str:
    """``7.204 [7.012, 7.409]``; the value alone without an interval; '-' without a value."""
    if value is None or not math.isfinite(value):
        return "-"
    text = f"{value:.{digits}f}"
    return text + (f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" if ci else "")


def _grid(report: dict, key: str) -> tuple[list[str], list[list[str]]]:
    lengths = sorted(int(L) for L in report["windows"])
    head = ["model"] + [f"L={L}" for L in lengths]
    rows = []
    for m in report["models"]:
        cells = [m["label"]]
        for L in lengths:
            r = m["results"].get(str(L))
            cells.append(_cell(r.get(key), r.get(f"{key}_ci")) if r else "-")
        rows.append(cells)
    return head, rows


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows, strict=True)]
    fmt = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True))
    return [fmt(head)] + [fmt(r) for r in rows]


def _units(report: dict) -> str:
    """'38 documents' (or '31-38 documents' when lengths differ), from the results."""
    found = {(r["ci_unit"], r["ci_units"]) for m in report["models"] for r in m["results"].values()}
    if not found:
        return "documents"
    names = sorted({u for u, _ in found})
    counts = sorted({n for _, n in found})
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"{n} {' or '.join(names)}"


def format_table(report: dict) -> str:
    """The perplexity table, then bits per byte: one row per model, one column per context
    length, every cell with its bootstrap interval."""
    ci = report.get("ci", {})
    level = f"{round(100 * ci.get('level', 0.95))}%"
    rule = report["short_docs"]
    how = {"same": "the same text at every length", "skip": "at each length the documents long "
           "enough for it", "concat": "documents as one stream"}.get(rule, rule)
    any_ci = any(r.get("perplexity_ci") for m in report["models"] for r in m["results"].values())
    interval = (f"{level} bootstrap interval over {_units(report)}" if any_ci else
                "no interval: the windows come from one document, and there is one window")
    lines = [f"perplexity on held-out data [{interval}]; short_docs={rule}: {how}"]
    lines += _table(*_grid(report, "perplexity"))
    changes = [(m["label"], m["results"]) for m in report["models"]]
    firsts = {r["loss_change"]["from"] for _, res in changes for r in res.values() if "loss_change" in r}
    if len(firsts) == 1:
        lengths = sorted(int(L) for L in report["windows"])
        head = ["model"] + [f"L={L}" for L in lengths]
        rows = [[label] + ["base" if L in firsts else
                           _signed(res[str(L)]["loss_change"]) if "loss_change" in res.get(str(L), {})
                           else "-" for L in lengths] for label, res in changes]
        lines += [f"change in loss from L={firsts.pop()}, nats [{level} paired bootstrap interval: "
                  f"the same documents at every length]"] + _table(head, rows)
    source = report.get("bits_per_byte", "")
    head, rows = _grid(report, "bits_per_byte")
    if any(c != "-" for r in rows for c in r[1:]):
        lines += [f"bits per byte ({source})"] + _table(head, rows)
    elif source:
        lines.append(f"bits per byte: {source}")
    return "\n".join(lines)


def _signed(change: dict) -> str:
    v, ci = change["value"], change.get("ci")
    return f"{v:+.4f}" + (f" [{ci[0]:+.4f}, {ci[1]:+.4f}]" if ci else "")


def _change_cells(change: dict | None) -> list[str]:
    if not change:
        return ["", "", "", ""]
    return [str(change["from"]), f"{change['value']:.6f}", _ci(change.get("ci"), 0),
            _ci(change.get("ci"), 1)]


def _ci(ci, i: int) -> str:
    return f"{ci[i]:.6f}" if ci else ""


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
        w.writerow(PERPLEXITY_COLUMNS)
        for m in report["models"]:
            for L, r in m["results"].items():
                bpb = r.get("bits_per_byte")
                w.writerow([m["label"], L, r["windows_used"], r["targets"], f"{r['loss']:.6f}",
                            _ci(r.get("loss_ci"), 0), _ci(r.get("loss_ci"), 1),
                            f"{r['perplexity']:.6f}", _ci(r.get("perplexity_ci"), 0),
                            _ci(r.get("perplexity_ci"), 1),
                            "" if r.get("bytes") is None else r["bytes"],
                            "" if bpb is None else f"{bpb:.6f}",
                            _ci(r.get("bits_per_byte_ci"), 0), _ci(r.get("bits_per_byte_ci"), 1),
                            r.get("ci_unit", ""), r.get("ci_units", ""), r["short_docs"],
                            r["docs_total"], r["docs_skipped"], r.get("docs_dropped", ""),
                            r["docs_used"], r["windows_available"],
                            *_change_cells(r.get("loss_change")), f"{r['seconds']:.3f}"])
    with open(paths["positions_csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(POSITION_COLUMNS)
        for m in report["models"]:
            for L, r in m["results"].items():
                for b in r["buckets"]:
                    w.writerow([m["label"], L, b["lo"], b["hi"], f"{b['loss']:.6f}",
                                _ci(b.get("loss_ci"), 0), _ci(b.get("loss_ci"), 1), b["targets"]])

    ppl_series, pos_series, ppl_bands, pos_bands = {}, {}, {}, {}
    nan2 = [math.nan, math.nan]
    for m in report["models"]:
        res = {int(L): r for L, r in m["results"].items()}
        if not res:
            continue
        Ls = sorted(res)
        label = m["label"]
        ppl_series[label] = (Ls, [res[L]["perplexity"] for L in Ls])
        cis = [res[L].get("perplexity_ci") or nan2 for L in Ls]
        ppl_bands[label] = ([c[0] for c in cis], [c[1] for c in cis])
        longest = res[Ls[-1]]
        mids = [math.sqrt(b["lo"] * b["hi"]) for b in longest["buckets"]]
        key = f"{label} (L={Ls[-1]})"
        pos_series[key] = (mids, [b["loss"] for b in longest["buckets"]])
        cis = [b.get("loss_ci") or nan2 for b in longest["buckets"]]
        pos_bands[key] = ([c[0] for c in cis], [c[1] for c in cis])
    ci = report.get("ci", {})
    note = (f"held-out data, short_docs={report['short_docs']}; shaded: "
            f"{round(100 * ci.get('level', 0.95))}% bootstrap interval over {_units(report)}")
    ppl_note = note
    if report["short_docs"] == "same":
        ppl_note += ("; every length scores the same documents, so the bands move together: the "
                     "change between lengths is far surer than their overlap suggests (paired "
                     "intervals: the printed table, eval.json)")
    if ppl_series:
        plots.line_plot(paths["perplexity_png"], ppl_series, title="Perplexity against context length",
                        xlabel="context length (tokens)", ylabel="perplexity", logx=True,
                        token_axis=True, note=ppl_note, bands=ppl_bands)
        plots.line_plot(paths["positions_png"], pos_series,
                        title="Loss against token position (longest context)",
                        xlabel="token position (log-spaced buckets)", ylabel="NLL (nats / token)",
                        logx=True, bands=pos_bands,
                        note=note + f"; buckets of at least {report.get('min_bucket_targets', 0)} "
                                    f"targets")
    else:
        for key in ("perplexity_png", "positions_png"):
            paths.pop(key)
    return paths
