"""Where one kernel's time goes, by SASS instruction: Nsight Compute's sampled warp stalls.

    ncu --import ours.ncu-rep --page source --csv --print-source sass > src.csv
    python3 benchmarks/ncu_sass.py src.csv --kernel kda_intra_bwd_channels
    python3 benchmarks/ncu_sass.py src.csv --kernel kda_intra_bwd_channels --lines 281:1631

The report (benchmarks/kda_ncu.sh writes src_ours.csv) holds, per SASS line of each kernel,
how often a warp was sampled there and why it was stalled. This prints, for one kernel (or the
lines --lines A:B of it): the stall reasons' shares; each opcode's share of the instructions
executed and of the samples; the lines with the most samples, with their two main reasons; and
the kernel cut into runs of lines executed equally often (loop bodies show up as runs whose
count is a multiple of the kernel's), with each run's samples and what it holds.
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_kernels(path: str) -> dict[str, list[dict[str, str]]]:
    """{kernel name: its SASS lines, each a dict of the report's columns}, in report order."""
    kernels: dict[str, list[dict[str, str]]] = {}
    name, header = None, None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                name, header = row[1], None
                kernels[name] = []
            elif row[0] == "Address":
                header = row
            elif name is not None and header is not None:
                kernels[name].append(dict(zip(header, row, strict=False)))
    if not kernels:
        raise SystemExit(f"{path}: no 'Kernel Name' sections: not the output of "
                         "ncu --page source --csv --print-source sass")
    return kernels


def _int(line: dict, key: str) -> int:
    value = line.get(key, "") or "0"
    return int(value.replace(",", "")) if value.replace(",", "").isdigit() else 0


def opcode(line: dict) -> str:
    """The instruction's opcode without predicate or modifiers: '@P0 LDG.E.128 R4, ...' -> LDG."""
    words = [w for w in line.get("Source", "").split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def stall_reasons(lines) -> collections.Counter:
    reasons = collections.Counter()
    for line in lines:
        for key in line:
            if key.startswith("stall_") and "Not Issued" not in key:
                reasons[key[len("stall_"):]] += _int(line, key)
    return reasons


def runs(lines) -> list[tuple[int, int]]:
    """[start, end) line ranges over which the executed count stays within 20%."""
    bounds, start = [], 0
    for i in range(1, len(lines)):
        a, b = _int(lines[i - 1], EXECUTED), _int(lines[i], EXECUTED)
        if abs(a - b) > 0.2 * max(a, b, 1):
            bounds.append((start, i))
            start = i
    bounds.append((start, len(lines)))
    return bounds


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "—"


def report(lines, *, top: int = 15, offset: int = 0) -> str:
    samples = sum(_int(x, SAMPLES) for x in lines)
    executed = sum(_int(x, EXECUTED) for x in lines)
    out = [f"{len(lines)} SASS lines, {samples} samples, {executed} warp instructions executed", ""]
    out += ["| stall reason | share of samples |", "|---|---|"]
    out += [f"| {k} | {_pct(v, samples)} |" for k, v in stall_reasons(lines).most_common(8)]
    by_op, by_op_samples = collections.Counter(), collections.Counter()
    for x in lines:
        by_op[opcode(x)] += _int(x, EXECUTED)
        by_op_samples[opcode(x)] += _int(x, SAMPLES)
    out += ["", "| opcode | instructions | samples |", "|---|---|---|"]
    out += [f"| {op} | {_pct(by_op[op], executed)} | {_pct(n, samples)} |"
            for op, n in by_op_samples.most_common(top)]
    out += ["", "| line | samples | instruction | main stall reasons |", "|---|---|---|---|"]
    hottest = sorted(range(len(lines)), key=lambda i: -_int(lines[i], SAMPLES))[:top]
    for i in sorted(hottest):
        why = ", ".join(f"{k} {_pct(v, _int(lines[i], SAMPLES))}"
                        for k, v in stall_reasons([lines[i]]).most_common(2) if v)
        text = lines[i].get("Source", "").strip()[:56]
        out.append(f"| {i + offset} | {_pct(_int(lines[i], SAMPLES), samples)} | `{text}` | {why} |")
    out += ["", "| lines | executed per line | samples | instructions | MMA, MUFU, LDG, STG lines |",
            "|---|---|---|---|---|"]
    for a, b in runs(lines):
        part = lines[a:b]
        ops = collections.Counter(opcode(x) for x in part)
        mma = sum(n for op, n in ops.items() if "MMA" in op)
        out.append(f"| {a + offset}-{b + offset} | {_int(lines[a], EXECUTED)} | "
                   f"{_pct(sum(_int(x, SAMPLES) for x in part), samples)} | "
                   f"{_pct(sum(_int(x, EXECUTED) for x in part), executed)} | "
                   f"{mma}, {ops['MUFU']}, {ops['LDG']}, {ops['STG']} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--kernel", required=True, help="the kernel's name as the report gives it")
    ap.add_argument("--lines", default=None, help="A:B, the SASS lines A..B-1 alone")
    ap.add_argument("--top", type=int, default=15, help="opcodes and hottest lines to list")
    args = ap.parse_args(argv)
    if args.top < 1:
        ap.error(f"--top must be at least 1, got {args.top}")
    kernels = read_kernels(args.csv)
    if args.kernel not in kernels:
        ap.error(f"--kernel: {args.kernel!r} is not in {args.csv}; it has {sorted(kernels)}")
    lines, offset = kernels[args.kernel], 0
    if args.lines:
        try:
            a, b = (int(v) for v in args.lines.split(":"))
        except ValueError:
            ap.error(f"--lines: want A:B (two line numbers), got {args.lines!r}")
        if not 0 <= a < b <= len(lines):
            ap.error(f"--lines: want 0 <= A < B <= {len(lines)}, got {args.lines!r}")
        lines, offset = lines[a:b], a
    print(f"{args.kernel}" + (f", lines {args.lines}" if args.lines else ""))
    print(report(lines, top=args.top, offset=offset))


if __name__ == "__main__":
    sys.exit(main())
