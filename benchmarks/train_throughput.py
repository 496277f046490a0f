"""Training throughput: tokens/s and MFU of ``train.py``'s loop for a config, as a Markdown table.

    python benchmarks/train_throughput.py --config=configs/small.py --workdir=/tmp/bench_small \\
        --config.train.steps=300 --out=benchmarks/train_throughput_small.md

Runs ``kimi_k3.train_lib.train`` (the real loop: data pipeline, sharded step, metrics) without
held-out evaluation and without checkpoints, on a fresh ``--workdir``. The first
``--config.train.log_every`` steps (compilation) are left out; the table gives the median over
the remaining log windows of tokens/s, seconds per step and MFU (model FLOPs per token from
``kimi_k3.model.flops_per_token`` against the device's dense bf16 peak), with the command, the
device, the shapes and the JAX version, and is written to ``--out`` and printed.

Several runs of one config in one call, side by side (``--variant``, repeatable), and the
dense same-card anchor (``--anchor``, a script you supply) after them:

    python benchmarks/train_throughput.py --config=configs/1b.py --workdir=/tmp/fp8 \\
        --config.data.global_batch_size=8 --config.train.steps=6 --config.train.log_every=2 \\
        --variant=bf16= --variant=fp8=--config.model.matmul_format=fp8 \\
        --anchor=PATH/TO/dense_anchor.py --out=/tmp/fp8/fp8_1b.md
    python benchmarks/train_throughput.py --smoke --workdir=/tmp/fp8_smoke   # CPU, tiny

Each variant (``LABEL=FLAGS``, FLAGS: ``--config.*`` overrides separated by spaces) runs this
script in a process of its own, one after another (its own compile, its own device memory),
with the command line's ``--config`` flags and then its own; the anchor runs last, as
``python ANCHOR --anchor_args``, and its printed line is read. The table has a row per run with
tokens/s, its ratio to the first variant's, s/step, MFU, peak memory and what JAX's persistent
compilation cache did in it. MFU counts the same model FLOPs whatever ``model.matmul_format``:
an FP8 run's MFU is on bf16-equivalent FLOPs, against the bf16 peak. ``--smoke``:
configs/tiny.py at test size on the CPU, the variants bf16 and fp8 unless given; the figures
mean nothing.

Compiling ahead (a large step compiles for minutes, a CPU job): ``--compile_only`` builds the
run's setup exactly as the run does (``train_lib.build``: same config, mesh and micro-batch),
compiles its initialiser and train step from shapes alone (``train_lib.compile_ahead``: no
train state allocated), prints a line per program (seconds, whether it came from the cache)
and exits. With ``--compilation_cache=DIR`` (kimi_k3/compile_cache.py, as train.py; every
variant gets the same DIR) the programs land in DIR and the measured run reads them from it.
``--compile_first`` (variant mode; off unless given, and it needs a cache) starts every
variant's ``--compile_only`` at once (``XLA_PYTHON_CLIENT_PREALLOCATE=false``, so they share
the card; each within ``--timeout_s``), waits for them all, then measures the variants one
after another and runs the anchor, as without it:

    python benchmarks/train_throughput.py --config=configs/1b.py --workdir=/tmp/fp8 \\
        --config.data.global_batch_size=8 --config.train.steps=6 --config.train.log_every=2 \\
        --variant=bf16= --variant=fp8=--config.model.matmul_format=fp8 \\
        --compilation_cache=/tmp/fp8/jax_cache --compile_first --out=/tmp/fp8/fp8_1b.md

A measured run reports its process's cache hits (programs read) and misses (programs compiled
and written; one under ``jax_persistent_cache_min_compile_time_secs`` is neither): after a
compile-only run of the same variant, its train step is a hit.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax
from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for benchmarks/

from benchmarks import processes
from kimi_k3 import compile_cache, train_lib
from kimi_k3 import mesh as mesh_lib
from kimi_k3 import metrics as metrics_lib
from kimi_k3.config import run_spec
from kimi_k3.model import count_params, flops_per_token

REPO = Path(__file__).resolve().parents[1]

config_flags.DEFINE_config_file("config", "configs/small.py", "Config file.", lock_config=True)
flags.DEFINE_string("workdir", None, "A fresh run folder (an existing checkpoint would resume); "
                    "not needed with --compile_only.")
flags.DEFINE_string("out", "", "Markdown file for the table; default <workdir>/throughput.md.")
flags.DEFINE_multi_string("variant", [], "LABEL=FLAGS: a run of the config with FLAGS "
                          "(--config.* overrides separated by spaces; may be empty), each in a "
                          "process of its own; the first is the others' baseline.")
flags.DEFINE_string("anchor", "", "The dense same-card anchor script, run after the variants.")
flags.DEFINE_string("anchor_args", "--remat dots --batch 8", "The anchor's arguments.")
flags.DEFINE_bool("smoke", False, "CPU: configs/tiny.py at test size, 3 steps; the variants "
                  "bf16 and fp8 unless given.")
flags.DEFINE_integer("timeout_s", 600, "Seconds each run of --variant or --anchor may take (and "
                     "the --compile_first compiles, together).")
flags.DEFINE_bool("compile_only", False, "Compile the run's initialiser and train step into "
                  "--compilation_cache, print a line for each and exit: nothing is trained.")
flags.DEFINE_bool("compile_first", False, "Variant mode: every variant's --compile_only at once "
                  "before the runs, which then read their programs from --compilation_cache.")
_CACHE = compile_cache.define_flag()
FLAGS = flags.FLAGS

# --smoke: configs/tiny.py shrunk as the tests shrink it (tests/helpers.py's TINY).
SMOKE_CONFIG = ["--config=configs/tiny.py", "--config.model.num_layers=2",
                "--config.model.kda_per_mla=1", "--config.model.kda.impl=recurrent",
                "--config.data.seq_len=32", "--config.data.global_batch_size=4",
                "--config.data.eval_fraction=0.0", "--config.opt.schedule=constant",
                "--config.opt.warmup_steps=2", "--config.train.log_every=1",
                "--config.train.progress_bar=False", "--config.train.tensorboard=False",
                "--config.train.steps=3"]
SMOKE_VARIANTS = ["bf16=", "fp8=--config.model.matmul_format=fp8"]
COMPILED_PREFIX = "compile_only:"  # --compile_only's line for each program
# The anchor's line: "... 60,177 tokens/s, 0.545 s/step, MFU 46.1%, peak 58.4 GiB, loss 0.128"
ANCHOR_LINE = re.compile(r"([\d,.]+) tokens/s, ([\d.]+) s/step, MFU ([\d.]+)%, peak ([\d.]+) GiB"
                         r"(?:, loss ([\d.naif]+))?")


def measure(config, workdir: str, cache: compile_cache.Count) -> dict:
    """One run's figures from ``<workdir>/metrics.jsonl`` and the device; ``cache``: what the
    persistent compilation cache did during the run."""
    summary = metrics_lib.throughput_summary(os.path.join(workdir, "metrics.jsonl"))
    peak = metrics_lib.peak_memory_bytes()
    dc, m = config.data, config.model
    return {
        "config": os.path.basename(str(FLAGS["config"].config_filename)),
        "params": count_params(m), "batch": dc.global_batch_size, "seq": dc.seq_len,
        "flops_per_token": flops_per_token(m, dc.seq_len),
        "matmul_format": m.get("matmul_format", "bf16"),
        "windows": summary["windows"], "log_every": config.train.log_every,
        "tokens_per_s": summary["tokens_per_s"], "step_s": summary["step_time_s"],
        "mfu": summary["mfu"], "peak_gib": None if peak is None else peak / 2**30,
        "final_loss": summary["final_loss"],
        "cache_hits": cache.hits, "cache_misses": cache.misses,
        "device": (f"{jax.device_count()} x {jax.devices()[0].device_kind} "
                   f"({jax.process_count()} process(es)), JAX {jax.__version__}; mesh "
                   f"data={config.mesh.data}, fsdp={config.mesh.fsdp}, tensor={config.mesh.tensor}; "
                   f"compute {m.dtype}, parameters {m.param_dtype}"),
    }


def _pct(v) -> str:
    return "n/a (unknown peak)" if v is None else f"{100 * v:.1f}%"


def _cache_text(row: dict) -> str:
    """A run's persistent-cache count: "" for a run that did not report one."""
    if "cache_hits" not in row:
        return ""
    return str(compile_cache.Count(row["cache_hits"], row["cache_misses"]))


def summarise(row: dict, command: str) -> str:
    """The Markdown table of one run."""
    peak = "n/a" if row["peak_gib"] is None else f"{row['peak_gib']:.1f} GiB"
    fmt = (", FP8 projections (MFU on bf16-equivalent FLOPs)" if row["matmul_format"] == "fp8"
           else "")
    lines = [
        f"Command: `python {command}`",
        "",
        f"Device: {row['device']}{fmt}",
        "",
        "| config | params | batch x seq | FLOPs/token | steps timed | tokens/s | s/step | MFU "
        "| peak memory / device | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {row['config']} | {row['params'] / 1e6:.1f}M | {row['batch']} x {row['seq']} | "
        f"{row['flops_per_token']:.3g} | {row['windows']} windows of {row['log_every']} | "
        f"{row['tokens_per_s']:,.0f} | {row['step_s']:.3f} | {_pct(row['mfu'])} | {peak} | "
        f"{row['final_loss']:.3f} |",
        "",
        f"Persistent compilation cache: {_cache_text(row)}",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Several runs side by side: each in a process of its own
# ---------------------------------------------------------------------------------------------


def parse_variant(text: str) -> tuple[str, list[str]]:
    """"LABEL=FLAGS" -> (label, flags); every flag must be a --config.* override."""
    label, sep, rest = text.partition("=")
    extra = shlex.split(rest)
    if not sep or not re.fullmatch(r"[\w.-]+", label):
        raise app.UsageError(f"--variant: {text!r} is not LABEL=FLAGS (a label of letters, "
                             "digits, '.', '_' or '-')")
    bad = [f for f in extra if not f.startswith("--config.")]
    if bad:
        raise app.UsageError(f"--variant {label}: {bad} are not --config.* overrides")
    return label, extra


def config_args(argv: list[str]) -> list[str]:
    """The command line's ``--config=FILE`` and ``--config.*`` overrides, in order."""
    return [a for a in argv if a.startswith(("--config=", "--config."))]


def _run(cmd: list[str], log: Path, timeout_s: float, env: dict) -> str:
    """Runs ``cmd`` (output to ``log``); "ok", or how it ended."""
    return _run_together([cmd], [log], timeout_s, env)[0]


def _run_together(cmds: list[list[str]], logs: list[Path], timeout_s: float,
                  env: dict) -> list[str]:
    """Starts every command at once (each one's output to its log), waits for them all, each
    stopped ``timeout_s`` after the start; for each, "ok" or how it ended."""
    with contextlib.ExitStack() as stack:
        ended = processes.run_at_once(
            [dict(args=cmd, cwd=REPO, env=env, stdout=stack.enter_context(open(log, "w")),
                  stderr=subprocess.STDOUT) for cmd, log in zip(cmds, logs, strict=True)],
            [timeout_s] * len(cmds))
    status = []
    for (code, _), log in zip(ended, logs, strict=True):
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        status.append("ok" if code == 0 else f"stopped at its limit of {timeout_s:.0f} s"
                      if code is None else
                      f"exit {code}: {tail[-1].strip()[:160] if tail else 'no output'}")
    return status


def compile_variants(variants, common: list[str], workdir: Path, timeout_s: float,
                     env) -> dict[str, str]:
    """--compile_first: every variant's ``--compile_only`` at once, sharing the card (its
    allocator growing on demand); {label: "ok" or how it ended}. Each child's lines about its
    programs are printed here too."""
    env = {**env, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    cmds, logs = [], []
    for label, extra in variants:
        cmds.append([sys.executable, str(Path(__file__).resolve()), *common, *extra,
                     "--compile_only"])
        logs.append(workdir / f"{label}.compile.log")
        print(f"[train_throughput] {label} (compile only): {shlex.join(cmds[-1][1:])}",
              flush=True)
    status = _run_together(cmds, logs, timeout_s, env)
    for (label, _), log, st in zip(variants, logs, status, strict=True):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(COMPILED_PREFIX):
                print(f"[train_throughput] {label}: {line}", flush=True)
        print(f"[train_throughput] {label} (compile only): {st}", flush=True)
    return dict(zip((label for label, _ in variants), status, strict=True))


def run_variants(variants, common: list[str], workdir: Path, timeout_s: float, env,
                 done=lambda rows: None, compiled=None) -> list[dict]:
    """Each variant in turn; ``done(rows)`` after each (the table so far is written then).
    ``compiled``: how each variant's --compile_first child ended (a failure joins its status)."""
    rows = []
    for label, extra in variants:
        wd, out = workdir / label, workdir / f"{label}.md"
        cmd = [sys.executable, str(Path(__file__).resolve()), *common, *extra,
               f"--workdir={wd}", f"--out={out}"]
        print(f"[train_throughput] {label}: {shlex.join(cmd[1:])}", flush=True)
        status = _run(cmd, workdir / f"{label}.log", timeout_s, env)
        result = out.with_suffix(".json")
        row = json.loads(result.read_text()) if status == "ok" and result.exists() else {}
        if compiled and compiled.get(label, "ok") != "ok":
            status = f"{status}; its compile first: {compiled[label]}"
        rows.append({**row, "label": label, "flags": " ".join(extra), "status": status})
        print(f"[train_throughput] {label}: {status}", flush=True)
        done(rows)
    return rows


def run_anchor(anchor: str, args: str, workdir: Path, timeout_s: float, env) -> dict:
    cmd = [sys.executable, anchor, *shlex.split(args)]
    print(f"[train_throughput] anchor: {shlex.join(cmd[1:])}", flush=True)
    log = workdir / "anchor.log"
    status = _run(cmd, log, timeout_s, env)
    row = {"label": "dense anchor", "flags": f"{os.path.basename(anchor)} {args}".strip(),
           "status": status}
    found = ANCHOR_LINE.findall(log.read_text(errors="replace")) if log.exists() else []
    if found:
        tps, step, mfu, peak, loss = found[-1]
        row.update(tokens_per_s=float(tps.replace(",", "")), step_s=float(step),
                   mfu=float(mfu) / 100, peak_gib=float(peak),
                   final_loss=float(loss) if loss else None)
    elif status == "ok":
        row["status"] = "no 'tokens/s, s/step, MFU, peak' line in its output"
    return row


def comparison(rows: list[dict], command: str) -> str:
    """One table: a row per run, tokens/s against the first variant's."""
    base = rows[0].get("tokens_per_s") if rows else None
    device = next((r["device"] for r in rows if r.get("device")), "unknown (no run finished)")
    f = lambda v, spec: "" if v is None else format(v, spec)
    lines = [f"Command: `python {command}`", "", f"Device: {device}. Each run in its own process, "
             "one after another. MFU: model FLOPs per token (kimi_k3.model.flops_per_token, the "
             "same for bf16 and FP8 products: bf16-equivalent FLOPs) x tokens/s over the dense "
             "bf16 peak; the anchor's as its script prints it. Compilation cache: the programs "
             "the run read from JAX's persistent cache, and those it compiled and wrote.", "",
             f"| run | flags | batch x seq | steps timed | tokens/s | x {rows[0]['label']} | "
             "s/step | MFU (bf16-equivalent) | peak memory / device | final loss | "
             "compilation cache | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tps = r.get("tokens_per_s")
        ratio = f"{tps / base:.2f}x" if tps and base else ""
        shape = f"{r['batch']} x {r['seq']}" if "batch" in r else ""
        timed = f"{r['windows']} windows of {r['log_every']}" if "windows" in r else ""
        mfu = "" if "tokens_per_s" not in r else _pct(r.get("mfu"))
        lines.append(f"| {r['label']} | `{r['flags']}` | {shape} | {timed} | {f(tps, ',.0f')} | "
                     f"{ratio} | {f(r.get('step_s'), '.3f')} | {mfu} | "
                     f"{f(r.get('peak_gib'), '.1f')}{' GiB' if r.get('peak_gib') else ''} | "
                     f"{f(r.get('final_loss'), '.3f')} | {_cache_text(r)} | {r['status']} |")
    return "\n".join(lines) + "\n"


def compare(argv: list[str], workdir: Path, out: Path) -> str:
    """The --variant / --anchor mode: the runs in subprocesses, their table written to ``out``
    after each (a call stopped midway keeps the rows it has)."""
    variants = [parse_variant(v) for v in FLAGS.variant]
    workdir.mkdir(parents=True, exist_ok=True)
    # Every child compiles through the same cache (this command's, a folder from anywhere).
    cache = os.path.abspath(os.path.expanduser(FLAGS.compilation_cache)) \
        if FLAGS.compilation_cache else ""
    common = config_args(argv[1:])
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    if FLAGS.smoke:
        common = SMOKE_CONFIG + [a for a in common if not a.startswith("--config=")]
        variants = variants or [parse_variant(v) for v in SMOKE_VARIANTS]
        env["JAX_PLATFORMS"] = "cpu"
    common.append(f"--compilation_cache={cache}")
    command = " ".join(shlex.quote(a) for a in argv)
    write = lambda rows: out.write_text(comparison(rows, command)) if rows else None
    compiled = (compile_variants(variants, common, workdir, FLAGS.timeout_s, env)
                if FLAGS.compile_first and variants else None)
    rows = run_variants(variants, common, workdir, FLAGS.timeout_s, env, write,
                        compiled) if variants else []
    if FLAGS.anchor:
        rows.append(run_anchor(FLAGS.anchor, FLAGS.anchor_args, workdir, FLAGS.timeout_s, env))
        write(rows)
    return comparison(rows, command) if rows else "no runs: give --variant or --anchor\n"


def check_flags() -> None:
    """The flags that go together (app.UsageError naming the one that does not)."""
    compare_mode = [f"--{n}" for n in ("variant", "anchor", "smoke") if FLAGS[n].value]
    if FLAGS.anchor and not os.path.isfile(FLAGS.anchor):
        raise app.UsageError(f"--anchor: no file {FLAGS.anchor!r}")
    if FLAGS.compile_only and compare_mode:
        raise app.UsageError(f"--compile_only compiles one run's programs, not {compare_mode[0]}'s "
                             "runs: with --variant or --smoke, --compile_first compiles them all "
                             "ahead")
    if FLAGS.compile_first and not (FLAGS.variant or FLAGS.smoke):
        raise app.UsageError("--compile_first: only with --variant or --smoke (a single run: "
                             "--compile_only, then the run)")
    if (FLAGS.compile_only or FLAGS.compile_first) and not FLAGS.compilation_cache:
        flag = "--compile_only" if FLAGS.compile_only else "--compile_first"
        raise app.UsageError(f"{flag} needs a cache to compile into: --compilation_cache is ''")
    if not FLAGS.workdir and not FLAGS.compile_only:
        raise app.UsageError("--workdir: required (a fresh run folder), except with "
                             "--compile_only")


def compile_only(config) -> None:
    """--compile_only: the run's setup as ``train_lib.train`` builds it (mesh, then
    ``train_lib.build`` of the config), its programs compiled ahead; a line each."""
    setup = train_lib.build(config, mesh_lib.make_mesh(run_spec(config).mesh))
    for program in train_lib.compile_ahead(setup):
        print(f"{COMPILED_PREFIX} {program}", flush=True)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    check_flags()
    if FLAGS.variant or FLAGS.anchor or FLAGS.smoke:
        # Nothing here touches a device: it is the subprocesses'.
        out = Path(FLAGS.out or os.path.join(FLAGS.workdir, "throughput.md"))
        table = compare(sys.argv, Path(FLAGS.workdir), out)
        out.write_text(table)
        print(table)
        return
    compile_cache.enable(FLAGS.compilation_cache)
    mesh_lib.initialize_distributed()
    config = FLAGS.config
    config.data.eval_fraction = 0.0  # no held-out split: nothing but training is timed
    config.train.eval_every = 0
    config.train.progress_bar = False
    config.checkpoint.enabled = False  # saving the state is not what is measured
    if FLAGS.compile_only:
        compile_only(config)
        return
    if os.path.exists(os.path.join(FLAGS.workdir, "metrics.jsonl")):
        raise app.UsageError(f"--workdir {FLAGS.workdir!r} already holds a run; use a fresh one")
    with compile_cache.counting() as cache:
        train_lib.train(config, FLAGS.workdir)
    if jax.process_index() == 0:
        row = measure(config, FLAGS.workdir, cache)
        table = summarise(row, " ".join(shlex.quote(a) for a in sys.argv))
        out = FLAGS.out or os.path.join(FLAGS.workdir, "throughput.md")
        with open(out, "w") as f:
            f.write(table)
        with open(os.path.splitext(out)[0] + ".json", "w") as f:
            json.dump(row, f)
        print(table)


if __name__ == "__main__":
    app.run(main)
