r"""An ablation in one command: train a list of variants one after another, then evaluate them
together and write one report.

    python -m kimi_k3.sweep --out=runs/ablate --ratios=0,1,3,all --layers=4 --base=tiny \
        --set=train.steps=200 --context_lengths=128,512,2K
    python -m kimi_k3.sweep --out=runs/lr --set=train.steps=100 \
        --variant='lr3e-3=configs/tiny.py' --variant='lr1e-3=configs/tiny.py;opt.lr=1e-3'

**Variants.** ``--variant=LABEL=CONFIG[;FIELD=VALUE...]`` (repeat it): LABEL names the run
folder and the line on every plot (letters, digits, ``.``, ``_``, ``+``, ``-``); CONFIG is what
train.py's ``--config`` takes (``configs/x.py[:arg]`` or a run folder); each ``FIELD=VALUE``
is train.py's ``--config.FIELD=VALUE`` for this variant only (``;`` separates them: quote the
flag in a shell). ``--set=FIELD=VALUE`` (repeat it) applies to every variant, before the
variant's own. ``--ratios=0,1,3,all`` (with ``--layers`` and ``--base``) adds the variants of
``configs/ablate_ratio.py`` (labels ``all-MLA``, ``1to1``, ``3to1``, ``all-KDA``; taken from the
working folder, so run from the repository root). Every variant is loaded and each field and
value checked, as train.py would, before anything trains: a mistake is one line naming the
variant (or ``--set``), exit 2.

**Layout** of ``--out``:

    OUT/commands.txt              every sweep command run here, one line each (time, host)
    OUT/runs/LABEL/               the variant's run folder (train.py --workdir)
    OUT/runs/LABEL/train.log      train.py's output, every start appended
    OUT/runs/LABEL/sweep_done.json  written when train.py exits 0: its arguments and step
    OUT/report/                   eval.json, eval_perplexity.{csv,png},
                                  eval_loss_by_position.{csv,png} (kimi_k3.evaluation),
                                  loss_curves.png, report.md, mqar/ (with --mqar)

**Training.** Each variant is a subprocess, ``python train.py --config=CONFIG
--config.FIELD=VALUE... --workdir=OUT/runs/LABEL`` (``--train_py``: the repository's
train.py), so each has its own JAX process; the sweep itself touches no device until every
variant has trained. A compact progress line shows the variant and its step and loss. A
variant is skipped when its ``sweep_done.json`` records the same train.py arguments; any other
starts train.py, which resumes from its newest checkpoint (or, at ``train.steps`` already,
says so and exits). A child's exit status ends the sweep: 75 (stopped after saving) is passed
up, to requeue on; 1 or 2 stops it with one line naming the variant, the child's error and
the log. SIGTERM or Ctrl-C to the sweep is passed on to the child, which saves and exits 75.

**Evaluation.** Once every variant has finished: one ``kimi_k3.evaluation.run`` over all of
them, each checkpoint read with its own run folder as its config, on the held-out data of
``--eval_config`` (default: the first variant's run folder), with eval.py's options
(``--context_lengths``, ``--short_docs``, ``--max_windows``, ``--piece_len``,
``--batch_size``). It is reused while the variants' steps and the options are unchanged
(``report/sweep_eval.json``). Then ``loss_curves.png`` (train loss against step from every
``metrics.jsonl``, and the held-out loss where a run measured one) and ``report.md``.
``--mqar``: a fresh small model of configs/mqar.py's width with each variant's layer pattern,
trained on the synthetic recall task (``kimi_k3.mqar``) at ``--mqar_seq_lens``; cells already
computed with the same config are reused.

**One variant per host.** ``--only=LABEL`` trains that variant and stops (no evaluation), so a
SLURM array or a loop of jobs trains one each in the same ``--out`` (a shared folder); then
``--eval_only`` evaluates what is there, naming each variant that has not finished (one with
no checkpoint is left out). ``--dry_run`` prints each variant's state and train.py command,
for launching a variant that needs several hosts by hand (docs/multi_host.md).

Exit codes (``kimi_k3.runtime``): 0 done, 1 a variant or the evaluation failed, 2 a bad flag
or variant, 75 interrupted (the same command resumes).
"""

# No ``from __future__ import annotations``: the documentation check loads this file by path,
# outside sys.modules, where dataclasses cannot resolve annotations given as strings.
import dataclasses
import datetime
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence

from absl import flags

from kimi_k3 import cli, compile_cache, eval_scoring, evaluation, mqar, plots
from kimi_k3.checkpoint import resolve_step_dir
from kimi_k3.config import ConfigError, layer_pattern
from kimi_k3.config_files import load_config
from kimi_k3.runtime import Interrupted, quiet_library_logs

RUNS, REPORT = "runs", "report"
LOG_FILE, DONE_FILE, COMMANDS_FILE = "train.log", "sweep_done.json", "commands.txt"
EVAL_KEY_FILE = "sweep_eval.json"
RATIO_CONFIG = "configs/ablate_ratio.py"
LABEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
FIELD_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
TRAIN_LINE = re.compile(r"^\[(train|eval)\] step (\d+): .*?\bloss=(\S+)")
PROGRESS_EVERY = 30.0  # seconds between progress lines when stderr is not a terminal


def default_train_py() -> str:
    """The repository's train.py, beside the kimi_k3 package."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py")


# ---------------------------------------------------------------------------------------------
# Variants
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """One config to train: its label, config spec, overrides (``FIELD=VALUE``, the shared ones
    first) and what the sweep reads from the config (layer pattern, train.steps)."""

    label: str
    config: str
    overrides: tuple[str, ...] = ()
    pattern: str = ""
    steps: int = 0

    @property
    def train_args(self) -> list[str]:
        """train.py's arguments, less ``--workdir``."""
        return [f"--config={self.config}", *(f"--config.{o}" for o in self.overrides)]


def parse_variant(text: str) -> tuple[str, str, tuple[str, ...]]:
    """``LABEL=CONFIG[;FIELD=VALUE...]`` -> (label, config, overrides). Raises ConfigError
    naming ``--variant`` and what is wrong."""
    label, eq, rest = text.partition("=")
    where = f"--variant={text!r}"
    if not eq or not rest:
        raise ConfigError(f"{where}: expected LABEL=CONFIG[;FIELD=VALUE...], e.g. "
                          f"3to1=configs/ablate_ratio.py:ratio=3;train.steps=100")
    check_label(label, where)
    config, *overrides = [part.strip() for part in rest.split(";")]
    if not config:
        raise ConfigError(f"{where}: names no config (LABEL=CONFIG[;FIELD=VALUE...])")
    return label, config, tuple(check_override(o, where) for o in overrides if o)


def check_label(label: str, where: str) -> str:
    if not LABEL_RE.fullmatch(label):
        raise ConfigError(f"{where}: label {label!r} must be letters, digits, '.', '_', '+' or "
                          f"'-' (it names a folder and a line on every plot)")
    return label


def check_override(text: str, where: str) -> str:
    """``FIELD=VALUE`` with FIELD a dotted config field (``opt.lr``), as train.py's
    ``--config.FIELD=VALUE`` takes it."""
    field, eq, _ = text.partition("=")
    if text.startswith("-"):
        raise ConfigError(f"{where}: override {text!r}: give FIELD=VALUE (e.g. opt.lr=1e-3), "
                          f"without --config.")
    if not eq or not FIELD_RE.fullmatch(field):
        raise ConfigError(f"{where}: override {text!r} is not FIELD=VALUE with a dotted field "
                          f"(e.g. train.steps=100)")
    return text


def ratio_variants(ratios: Sequence[str], layers: int | None, base: str | None
                   ) -> list[tuple[str, str, tuple[str, ...]]]:
    """``--ratios`` as variants of configs/ablate_ratio.py: 0 -> all-MLA, all -> all-KDA,
    r -> "<r>to1"."""
    if not os.path.isfile(RATIO_CONFIG):
        raise ConfigError(f"--ratios: no {RATIO_CONFIG} under {os.getcwd()}; run from the "
                          f"repository root, or give --variant=LABEL=PATH/ablate_ratio.py:ratio=R")
    extra = (f",layers={layers}" if layers is not None else "") + (f",base={base}" if base else "")
    out = []
    for r in ratios:
        r = r.strip()
        if r != "all" and not r.isdigit():
            raise ConfigError(f"--ratios: {r!r} is not a ratio (KDA layers per MLA layer: a whole "
                              f"number >= 0, or all)")
        label = {"0": "all-MLA", "all": "all-KDA"}.get(r, f"{r}to1")
        out.append((label, f"{RATIO_CONFIG}:ratio={r}{extra}", ()))
    return out


def resolve_variant(label: str, config: str, overrides: Sequence[str],
                    shared: Sequence[str] = ()) -> Variant:
    """The variant with its config loaded and every override parsed as train.py parses it (the
    config file, each field and each value); raises ConfigError naming the variant, or
    ``--set`` for a shared override."""
    where = f"--variant {label}"
    try:
        load_config(config)
    except Exception as e:  # the config file's own error (a bad argument), or no such file
        raise ConfigError(f"{where}: {config}: {cli.one_line(e)}") from e
    for source, items in (("--set", shared), (where, overrides)):
        for o in items:
            try:
                cli.check_config_args(["sweep", f"--config={config}", f"--config.{o}"])
            except Exception as e:
                raise ConfigError(f"{source}: {o}: {cli.one_line(e)}") from e
    variant = Variant(label, config, tuple(shared) + tuple(overrides))
    try:
        parsed = parse_config(variant.train_args)
        pattern = layer_pattern(parsed.model)
        steps = int(parsed.train.steps)
    except Exception as e:  # a value that does not parse, a model field out of range
        raise ConfigError(f"{where}: {cli.one_line(e)}") from e
    return dataclasses.replace(variant, pattern=pattern, steps=steps)


def parse_config(train_args: Sequence[str]):
    """The config train.py builds from ``train_args`` (``--config=...`` and its overrides),
    parsed by ml_collections' config flag on flag values of its own (never absl's global
    ones)."""
    from ml_collections import config_flags

    argv = ["train.py", *(f"--config={cli.resolve_config_path(a.split('=', 1)[1])}"
                          if a.startswith("--config=") else a for a in train_args)]
    values = flags.FlagValues()
    holder = config_flags.DEFINE_config_file("config", None, "", flag_values=values,
                                             lock_config=True, sys_argv=argv)
    with warnings.catch_warnings():  # its loader calls importlib's deprecated load_module
        warnings.simplefilter("ignore", DeprecationWarning)
        values(argv)
        return holder.value


def make_variants(specs: Sequence[str], ratios: Sequence[str], layers: int | None,
                  base: str | None, shared: Sequence[str]) -> list[Variant]:
    """Every variant of ``--ratios`` then ``--variant``, checked (``resolve_variant``), with
    distinct labels."""
    if (layers is not None or base) and not ratios:
        raise ConfigError("--layers / --base: only with --ratios (for --variant, give them in "
                          "its config: configs/ablate_ratio.py:ratio=3,layers=4,base=tiny)")
    shared = tuple(check_override(s, f"--set={s!r}") for s in shared)
    parsed = (ratio_variants(ratios, layers, base) if ratios else []) + [
        parse_variant(v) for v in specs]
    if not parsed:
        raise ConfigError("--variant / --ratios: no variant given; e.g. --ratios=0,3,all "
                          "--layers=4 --base=tiny, or --variant=LABEL=configs/tiny.py")
    labels = [p[0] for p in parsed]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ConfigError(f"--variant: label(s) {dup} given more than once; labels name run "
                          f"folders and must be distinct")
    return [resolve_variant(label, config, over, shared) for label, config, over in parsed]


# ---------------------------------------------------------------------------------------------
# A variant's state on disk
# ---------------------------------------------------------------------------------------------


def run_folder(out: str, label: str) -> str:
    return os.path.join(out, RUNS, label)


def checkpoints_path(run: str) -> str:
    """Where the run keeps its steps: ``checkpoint.dir`` of its config.json when set, else
    ``RUN/checkpoints``."""
    try:
        with open(os.path.join(run, "config.json")) as f:
            elsewhere = json.load(f).get("checkpoint", {}).get("dir") or ""
    except (OSError, ValueError):
        elsewhere = ""
    return elsewhere or os.path.join(run, "checkpoints")


def newest_step(run: str) -> int | None:
    """The newest saved step of the run in ``run`` (None: none yet)."""
    try:
        return resolve_step_dir(checkpoints_path(run))[1]
    except (FileNotFoundError, ValueError):
        return None


def read_done(run: str) -> dict | None:
    try:
        with open(os.path.join(run, DONE_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def is_done(variant: Variant, out: str) -> bool:
    """Finished with these very train.py arguments (its ``sweep_done.json``)."""
    done = read_done(run_folder(out, variant.label))
    return done is not None and done.get("train_args") == variant.train_args


def state(variant: Variant, out: str) -> tuple[bool, int | None]:
    """(finished, newest step). Finished: the sweep saw train.py end with these arguments, or
    (a run trained by hand) its newest step is at the variant's train.steps."""
    step = newest_step(run_folder(out, variant.label))
    return is_done(variant, out) or (step is not None and step >= variant.steps), step


def describe_state(variant: Variant, out: str) -> str:
    finished, step = state(variant, out)
    if finished:
        return f"finished at step {step}"
    return "not started" if step is None else f"at step {step} of {variant.steps}"


# ---------------------------------------------------------------------------------------------
# Training: one train.py subprocess per variant
# ---------------------------------------------------------------------------------------------


class Signals:
    """SIGTERM and SIGINT while the sweep runs: passed on to the child that trains (which runs in
    its own session, so a terminal's Ctrl-C reaches it only through here), and remembered so
    that no further variant starts. During the evaluation they stop the sweep at once."""

    def __init__(self):
        self.child: subprocess.Popen | None = None
        self.received: str | None = None
        self.evaluating = False
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name
        self.received = self.received or name
        if self.evaluating:
            raise Interrupted(f"stopped by {name} during the evaluation; run the same command "
                              f"again to redo it (every variant has finished)")
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def check(self, before: str) -> None:
        if self.received:
            raise Interrupted(f"stopped by {self.received} before {before}; run the same "
                              f"command again to go on (finished variants are skipped)")

    def restore(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)


class Progress:
    """One line per variant: redrawn in place on a terminal, else printed every
    ``PROGRESS_EVERY`` seconds."""

    def __init__(self, prefix: str, steps: int):
        self.prefix, self.steps = prefix, steps
        self.tty = sys.stderr.isatty()
        self.t0 = self.last = time.monotonic()
        self.text = ""

    def update(self, step: int, loss: str) -> None:
        now = time.monotonic()
        self.text = f"{self.prefix}: step {step}/{self.steps} loss {loss} ({elapsed(now - self.t0)})"
        if self.tty:
            print(f"\r\x1b[K{self.text}", end="", file=sys.stderr, flush=True)
        elif now - self.last >= PROGRESS_EVERY:
            self.last = now
            say(self.text)

    def end(self, message: str) -> None:
        if self.tty and self.text:
            print("\r\x1b[K", end="", file=sys.stderr, flush=True)
        say(f"{self.prefix}: {message} ({elapsed(time.monotonic() - self.t0)})")


def elapsed(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def train_variant(variant: Variant, out: str, train_cmd: Sequence[str], signals: Signals,
                  prefix: str) -> int | None:
    """Runs train.py for ``variant`` (output appended to its train.log) and writes its
    ``sweep_done.json``; returns the newest step. Raises Interrupted (the child exited 75),
    ConfigError (2) or ValueError (anything else), naming the variant and its log."""
    run = run_folder(out, variant.label)
    os.makedirs(run, exist_ok=True)
    log_path = os.path.join(run, LOG_FILE)
    cmd = [*train_cmd, *variant.train_args, f"--workdir={run}"]
    before = describe_state(variant, out)
    say(f"{prefix}: training {variant.pattern} ({before}) in {run}; log {log_path}")
    done = read_done(run)
    if done is not None:  # finished before with other arguments: train.py goes on from there
        was = set(done.get("train_args", []))
        changed = [a for a in variant.train_args if a not in was]
        say(f"{prefix}: its arguments changed since it finished ({' '.join(changed) or 'order'});"
            f" train.py goes on from its newest checkpoint (a new label trains from scratch)")
    progress = Progress(prefix, variant.steps)
    last = ""
    with open(log_path, "a") as log:
        log.write(f"# {utc_now()} {shlex.join(cmd)}\n")
        log.flush()
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 bufsize=1, start_new_session=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
        signals.child = child
        try:
            for line in child.stdout:
                log.write(line)
                if line.strip():
                    last = line.strip()
                m = TRAIN_LINE.match(line)
                if m and m.group(1) == "train":
                    progress.update(int(m.group(2)), m.group(3))
            code = child.wait()
        finally:
            signals.child = None
            if child.poll() is None:  # the sweep itself is failing: leave no trainer behind
                child.terminate()
                child.wait()
    step = newest_step(run)
    if code == 0:
        with open(os.path.join(run, DONE_FILE), "w") as f:
            json.dump({"train_args": variant.train_args, "step": step, "time": utc_now()}, f)
        progress.end(f"finished at step {step}")
        return step
    progress.end(f"train.py exited with {code}")
    why = re.sub(r"^train\.py: (error: )?", "", last)  # the child's one line, less its advice
    why = why.split("; run the same command again")[0].split(" (--debug or ")[0] or "no output"
    if code < 0:  # ended by a signal before it could say anything
        why = f"killed by {signal.Signals(-code).name}"
    where = f"variant {variant.label!r}"
    if code == 75 or (code < 0 and signals.received):
        raise Interrupted(f"{where}: {why}; run the same command again to resume it (finished "
                          f"variants are skipped); its log: {log_path}")
    message = f"{where}: train.py exited with {code}: {why}; its log: {log_path}"
    raise ConfigError(message) if code == 2 else VariantFailed(message)


class VariantFailed(ValueError):
    """A variant's train.py failed (exit 1 from the sweep)."""


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


# ---------------------------------------------------------------------------------------------
# Evaluation and the report
# ---------------------------------------------------------------------------------------------


def evaluate(variants: Sequence[Variant], out: str, opts: eval_scoring.EvalOptions,
             eval_config: str | None) -> dict:
    """One evaluation of every variant with a checkpoint into OUT/report (reused when the
    steps, the options and the held-out config are those of the last one)."""
    report_dir = os.path.join(out, REPORT)
    runs = {v.label: run_folder(out, v.label) for v in variants}
    data_config = eval_config or runs[variants[0].label]
    key = {"models": [[v.label, newest_step(runs[v.label]), checkpoints_path(runs[v.label])]
                      for v in variants],
           "eval_config": data_config, "options": dataclasses.asdict(opts)}
    key = json.loads(json.dumps(key))  # tuples as lists, as read back
    key_path, eval_json = os.path.join(report_dir, EVAL_KEY_FILE), os.path.join(report_dir, "eval.json")
    try:
        with open(key_path) as f, open(eval_json) as g:
            if json.load(f) == key:
                say(f"evaluation: unchanged since {eval_json} (same steps and options); reused")
                return json.load(g)
    except (OSError, ValueError):
        pass
    config = load_config(data_config)
    specs = [evaluation.CheckpointSpec(checkpoints_path(runs[v.label]), v.label, runs[v.label])
             for v in variants]
    say(f"evaluation: {len(specs)} variant(s) at {', '.join(map(str, opts.context_lengths))} "
        f"tokens, held-out data of {data_config}")
    try:
        report = evaluation.run(config, specs, opts, report_dir, progress=sys.stderr.isatty(),
                                config_name=data_config)
    except ValueError as e:
        hint = ("; --eval_config=CONFIG names a config whose data holds some out"
                if "held-out split is empty" in str(e) else "")
        raise ValueError(f"evaluation: {cli.one_line(e)}{hint}") from e
    with open(key_path, "w") as f:
        json.dump(key, f)
    return report


def read_metrics(run: str) -> list[dict]:
    """The complete lines of a run's metrics.jsonl (a line being written is left out)."""
    path = os.path.join(run, "metrics.jsonl")
    rows = []
    try:
        with open(path) as f:
            for line in f:
                if line.endswith("\n") and line.strip():
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        continue
    except OSError:
        pass
    return rows


def final_losses(rows: Sequence[dict]) -> tuple[float | None, float | None]:
    """(the last train loss, the last held-out loss) of a run's metrics."""
    last = {}
    for r in rows:
        if isinstance(r.get("loss"), int | float):
            last[r.get("split")] = float(r["loss"])
    return last.get("train"), last.get("eval")


def loss_curves(variants: Sequence[Variant], out: str, path: str) -> str | None:
    """``path``: train loss against step for every variant, and its held-out loss where the
    run measured one; None when no run has a metric yet."""
    series = {}
    for v in variants:
        rows = read_metrics(run_folder(out, v.label))
        for split, name in (("train", v.label), ("eval", f"{v.label} (held-out)")):
            pts = [(r["step"], float(r["loss"])) for r in rows
                   if r.get("split") == split and isinstance(r.get("loss"), int | float)]
            if pts:
                series[name] = ([p[0] for p in pts], [p[1] for p in pts])
    if not series:
        return None
    return plots.line_plot(path, series, title="Training loss", xlabel="step",
                           ylabel="loss (nats / token)", note=f"{out}/{RUNS}/<variant>/metrics.jsonl")


def run_mqar(variants: Sequence[Variant], out: str, mqar_config: str,
             seq_lens: Sequence[int]) -> str:
    """MQAR accuracy of each distinct layer pattern (labelled by its variants) at each length,
    into OUT/report/mqar; cells computed before with the same config are reused. Returns the
    markdown table."""
    config = load_config(mqar_config)
    folder = os.path.join(out, REPORT, "mqar")
    os.makedirs(folder, exist_ok=True)
    cache_path = os.path.join(folder, "mqar_cells.json")
    try:
        with open(cache_path) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        cache = {}
    labels = {}
    for v in variants:
        labels.setdefault(v.pattern, []).append(v.label)
    rows = []
    for T in seq_lens:
        for pattern, names in labels.items():
            cfg = mqar.sweep_config(config, pattern, T)
            key = f"{pattern} T={T} {cfg.to_json_best_effort(sort_keys=True)}"
            if key not in cache:
                spec = mqar.spec_from_config(cfg.mqar)
                say(f"mqar: {'/'.join(names)} ({pattern}) at T={T}, {spec.num_kv_pairs} pairs, "
                    f"{int(cfg.train.steps)} steps")
                r = mqar.train_mqar(cfg, spec, progress=sys.stderr.isatty(), desc=f"mqar {pattern}")
                chance = getattr(spec, "chance", None)  # a uniform guess's accuracy
                cache[key] = {"pattern": pattern, "seq_len": T, "kv_pairs": spec.num_kv_pairs,
                              "steps": int(cfg.train.steps), **r,
                              **({"chance": chance} if chance is not None else {})}
                with open(cache_path, "w") as f:
                    json.dump(cache, f)
            rows.append({"label": "/".join(names), **cache[key]})
    return mqar.write_sweep_outputs(rows, config, folder)


def interval(result: dict, key: str, spec: str = ".3f") -> str:
    """``result[key + "_ci"]`` (the evaluation's confidence interval of ``key``, when it reports
    one) as ``[lo, hi]``, else ``-``."""
    ci = result.get(f"{key}_ci")
    if isinstance(ci, list | tuple) and len(ci) == 2 and all(isinstance(x, int | float) for x in ci):
        return f"[{ci[0]:{spec}}, {ci[1]:{spec}}]"
    return "-"


def table(head: Sequence[str], rows: Sequence[Sequence]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def fmt(x, spec: str = ".4f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def context_tables(variants: Sequence[Variant], models: dict, lengths: Sequence[int]) -> list[str]:
    """report.md's view of context use: each variant's change in loss from the shortest length
    (with its paired interval, when every length scored the same documents), and its loss by
    token position at the longest length (the buckets of ``eval_scoring.scored_buckets``)."""
    lines = []
    scored = [v for v in variants if v.label in models]
    changes = {v.label: {L: models[v.label]["results"].get(str(L), {}).get("loss_change")
                         for L in lengths[1:]} for v in scored}
    if len(lengths) > 1 and any(c for ch in changes.values() for c in ch.values()):
        lines += ["", f"## Change in loss from {lengths[0]} tokens (nats; below 0: longer context "
                      f"helped)", "",
                  "The same documents at every length, so each interval is paired: it excludes "
                  "0 when the change is more than the sampling of documents.", ""]
        rows = []
        for v in scored:
            cells = []
            for L in lengths[1:]:
                c = changes[v.label][L]
                ci = c.get("ci") if c else None
                cells.append("-" if not c else f"{c['value']:+.4f}" + (
                    f" [{ci[0]:+.4f}, {ci[1]:+.4f}]" if ci else ""))
            rows.append([v.label, f"`{v.pattern}`", *cells])
        lines += table(["variant", "pattern", *(f"{L} tokens" for L in lengths[1:])], rows)
    if lengths:
        L = lengths[-1]
        buckets = {v.label: models[v.label]["results"].get(str(L), {}).get("buckets") or []
                   for v in scored}
        spans = list(dict.fromkeys((b["lo"], b["hi"]) for bs in buckets.values() for b in bs))
        if spans:
            lines += ["", f"## Loss by token position at {L} tokens (nats; the context a target "
                          f"was predicted from)", ""]
            rows = []
            for v in scored:
                at = {(b["lo"], b["hi"]): b["loss"] for b in buckets[v.label]}
                rows.append([v.label, f"`{v.pattern}`",
                             *(fmt(at.get(span), ".3f") for span in spans)])
            head = [f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in spans]
            lines += table(["variant", "pattern", *head], rows)
    return lines


def write_report(variants: Sequence[Variant], out: str, evaluated: dict | None,
                 unfinished: Sequence[str], train_cmd: Sequence[str],
                 opts: eval_scoring.EvalOptions, eval_config: str | None,
                 mqar_table: str | None) -> str:
    """OUT/report/report.md (the module docstring says what it holds); returns its path."""
    report_dir = os.path.join(out, REPORT)
    os.makedirs(report_dir, exist_ok=True)
    models = {m["label"]: m for m in (evaluated or {}).get("models", [])}
    info = {}
    for v in variants:
        run = run_folder(out, v.label)
        train_loss, eval_loss = final_losses(read_metrics(run))
        m = models.get(v.label, {})
        info[v.label] = {"params": f"{m['params']:,}" if m.get("params") else "-",
                         "step": newest_step(run), "train": train_loss, "eval": eval_loss}
    lines = [f"# Sweep: {out}", "",
             f"{len(variants)} variant(s), each trained in `{out}/{RUNS}/<label>` and evaluated "
             f"together on the held-out data of `{eval_config or run_folder(out, variants[0].label)}` "
             f"(short_docs={opts.short_docs}, at most {opts.max_windows or 'all'} windows per "
             f"length). Plots: `eval_perplexity.png`, `eval_loss_by_position.png`, "
             f"`loss_curves.png`; every number in `eval.json`.", ""]
    lines += table(
        ["variant", "pattern", "KDA", "MLA", "parameters", "step", "train loss (last)",
         "held-out loss (last, training)", "config"],
        [[v.label, f"`{v.pattern}`", v.pattern.count("K"), v.pattern.count("M"),
          info[v.label]["params"], f"{fmt(info[v.label]['step'], 'd')} of {v.steps}",
          fmt(info[v.label]["train"]), fmt(info[v.label]["eval"]),
          "`" + " ".join([v.config, *v.overrides]) + "`"] for v in variants])
    if unfinished:
        lines += ["", "**Not finished:** " + "; ".join(unfinished) + "."]
    lengths = sorted({int(L) for m in models.values() for L in m["results"]})
    for L in lengths:
        rows = []
        for v in variants:
            r = models.get(v.label, {}).get("results", {}).get(str(L))
            if r:
                rows.append([v.label, f"`{v.pattern}`", info[v.label]["params"],
                             fmt(info[v.label]["train"]), fmt(r.get("perplexity"), ".3f"),
                             interval(r, "perplexity"), fmt(r.get("loss")),
                             fmt(r.get("bits_per_byte"), ".3f"), r.get("windows_used", "-"),
                             r.get("targets", "-")])
        lines += ["", f"## Held-out perplexity at {L} tokens", ""]
        lines += table(["variant", "pattern", "parameters", "train loss (last)", "perplexity",
                        "95% interval", "loss (nats)", "bits per byte", "windows", "targets"],
                       rows)
    lines += context_tables(variants, models, lengths)
    if mqar_table:
        lines += ["", "## MQAR recall (`mqar/`)", "", mqar_table]
    lines += ["", "## Commands", "", "```bash", "# the sweep (every command run in this folder)"]
    try:
        with open(os.path.join(out, COMMANDS_FILE)) as f:  # "<time> <host>: <command>"
            lines += dict.fromkeys(ln.rstrip("\n").split(": ", 1)[-1] for ln in f if ln.strip())
    except OSError:
        pass
    lines.append("# what it ran for each variant")
    python_train = ["python", os.path.relpath(train_cmd[1]), *train_cmd[2:]]
    lines += [shlex.join([*python_train, *v.train_args, f"--workdir={run_folder(out, v.label)}"])
              for v in variants]
    if models:
        lines.append("# the evaluation alone")
        data = eval_config or run_folder(out, variants[0].label)
        lines.append(shlex.join(
            ["python", "eval.py", f"--config={data}", f"--workdir={report_dir}",
             f"--context_lengths={','.join(map(str, opts.context_lengths))}",
             f"--short_docs={opts.short_docs}", f"--max_windows={opts.max_windows}",
             f"--piece_len={opts.piece_len}", f"--batch_size={opts.batch_size}",
             *(f"--checkpoint={v.label}={run_folder(out, v.label)}"
               for v in variants if v.label in models)]))
    lines.append("```")
    path = os.path.join(report_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Options:
    """What to do with the variants (the flags of the module docstring)."""

    out: str
    eval: eval_scoring.EvalOptions
    only: tuple[str, ...] = ()
    eval_only: bool = False
    dry_run: bool = False
    eval_config: str | None = None
    mqar: bool = False
    mqar_config: str = "configs/mqar.py"
    mqar_seq_lens: tuple[int, ...] = (64, 128)
    train_py: str = ""
    train_flags: tuple[str, ...] = ()


def record_command(out: str, argv: Sequence[str]) -> None:
    """One line in OUT/commands.txt (appended whole: hosts sharing ``out`` each add theirs)."""
    os.makedirs(out, exist_ok=True)
    line = f"{utc_now()} {socket.gethostname()}: {shlex.join(['python', '-m', 'kimi_k3.sweep', *argv])}\n"
    fd = os.open(os.path.join(out, COMMANDS_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def check_options(variants: Sequence[Variant], opts: Options) -> None:
    """Raises ConfigError naming the flag of ``opts`` that cannot work with ``variants``, before
    anything trains: --only, --eval_config, --mqar_config and --mqar_seq_lens."""
    labels = [v.label for v in variants]
    unknown = [x for x in opts.only if x not in labels]
    if unknown:
        raise ConfigError(f"--only: no variant {unknown[0]!r}; the variants: {', '.join(labels)}")
    if opts.only and opts.eval_only:
        raise ConfigError("--only and --eval_only: give one (--only trains, --eval_only evaluates)")
    if opts.eval_config:
        try:
            load_config(opts.eval_config)
        except Exception as e:
            raise ConfigError(f"--eval_config={opts.eval_config}: {cli.one_line(e)}") from e
    if opts.mqar:
        try:
            config = load_config(opts.mqar_config)
        except Exception as e:
            raise ConfigError(f"--mqar_config={opts.mqar_config}: {cli.one_line(e)}") from e
        if "mqar" not in config:
            raise ConfigError(f"--mqar_config={opts.mqar_config}: has no mqar section; give an "
                              f"MQAR config such as configs/mqar.py")
        for T in opts.mqar_seq_lens:
            try:
                mqar.spec_from_config(mqar.sweep_config(config, "K", T).mqar)
            except ValueError as e:
                raise ConfigError(f"--mqar_seq_lens: {T}: {cli.one_line(e)}") from e


def sweep(variants: Sequence[Variant], opts: Options, argv: Sequence[str] = ()) -> dict | None:
    """Trains, evaluates and reports (the module docstring); returns the evaluation's report,
    None when nothing was evaluated (``--only``, ``--dry_run``)."""
    check_options(variants, opts)
    train_py = opts.train_py or default_train_py()
    train_cmd = [sys.executable, train_py, *opts.train_flags]
    if opts.dry_run:
        for v in variants:
            print(f"{v.label} ({v.pattern}): {describe_state(v, opts.out)}\n  "
                  + shlex.join(["python", os.path.relpath(train_py), *v.train_args,
                                f"--workdir={run_folder(opts.out, v.label)}"]))
        return None
    record_command(opts.out, argv)
    signals = Signals()
    try:
        if not opts.eval_only:
            todo = [v for v in variants if not opts.only or v.label in opts.only]
            pending = [v for v in todo if not is_done(v, opts.out)]
            if pending and not os.path.isfile(train_py):
                raise ConfigError(f"--train_py: no file {train_py!r}; give the repository's "
                                  f"train.py")
            for i, v in enumerate(todo, 1):
                prefix = f"[{i}/{len(todo)}] {v.label}"
                if v not in pending:
                    say(f"{prefix}: finished at step {newest_step(run_folder(opts.out, v.label))}"
                        f" with these arguments; skipped")
                    continue
                signals.check(f"variant {v.label!r}")
                train_variant(v, opts.out, train_cmd, signals, prefix)
            if opts.only:
                rest = [v.label for v in variants if v.label not in opts.only
                        and not state(v, opts.out)[0]]
                say(f"trained {', '.join(opts.only)}" + (
                    f"; not finished yet: {', '.join(rest)}" if rest else
                    "; every variant has finished") + ". Evaluate them all with this command, "
                    "--eval_only instead of --only")
                return None
            signals.check("the evaluation")
        return report(variants, opts, train_cmd, signals)
    finally:
        signals.restore()


def report(variants: Sequence[Variant], opts: Options, train_cmd: Sequence[str],
           signals: Signals) -> dict:
    """The evaluation, the loss curves, MQAR and report.md of the variants there are."""
    ready, unfinished = [], []
    for v in variants:
        finished, step = state(v, opts.out)
        if not finished:
            unfinished.append(f"{v.label} (not started, left out)" if step is None else
                              f"{v.label} (at step {step} of {v.steps}, evaluated there)")
        if step is not None:
            ready.append(v)
    if unfinished:
        say("not finished: " + "; ".join(unfinished))
    if not ready:
        raise ValueError(f"--eval_only: no variant has a checkpoint yet under {opts.out}/{RUNS}; "
                         f"train them first (the same command without --eval_only)")
    signals.evaluating = True
    quiet_library_logs()
    evaluated = evaluate(ready, opts.out, opts.eval, opts.eval_config)
    curves = loss_curves(variants, opts.out, os.path.join(opts.out, REPORT, "loss_curves.png"))
    mqar_table = (run_mqar(variants, opts.out, opts.mqar_config, opts.mqar_seq_lens)
                  if opts.mqar else None)
    path = write_report(variants, opts.out, evaluated, unfinished, train_cmd, opts.eval,
                        opts.eval_config, mqar_table)
    say(f"report: {path}" + (f", {curves}" if curves else ""))
    return evaluated


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------


def define_flags() -> None:
    flags.DEFINE_string("out", None, "The sweep's folder: runs/<label>/ and report/.")
    flags.DEFINE_multi_string(
        "variant", [], "LABEL=CONFIG[;FIELD=VALUE...]: a config to train (train.py's --config) "
        "and its own overrides (train.py's --config.FIELD=VALUE). Repeat for each variant.")
    flags.DEFINE_list("ratios", [], "KDA:MLA ratios of configs/ablate_ratio.py to train, e.g. "
                      "0,1,3,all (0 = all MLA, all = all KDA).")
    flags.DEFINE_integer("layers", None, "With --ratios: the number of layers.", lower_bound=1)
    flags.DEFINE_enum("base", None, ["small", "tiny"], "With --ratios: the base config.")
    flags.DEFINE_multi_string("set", [], "FIELD=VALUE: an override for every variant, e.g. "
                              "train.steps=300. Repeat for more.")
    flags.DEFINE_list("only", [], "Train only these variants, then stop (one per host/job); "
                      "evaluate later with --eval_only.")
    flags.DEFINE_bool("eval_only", False, "Train nothing: evaluate and report the variants that "
                      "have a checkpoint, naming those not finished.")
    flags.DEFINE_bool("dry_run", False, "Print each variant's state and train.py command, run "
                      "nothing.")
    flags.DEFINE_list("context_lengths", ["2048"], "As eval.py: lengths in tokens (K, M allowed).")
    flags.DEFINE_enum("short_docs", eval_scoring.DEFAULT_SHORT_DOCS,
                      list(eval_scoring.SHORT_DOC_RULES), "As eval.py.")
    flags.DEFINE_integer("max_windows", eval_scoring.DEFAULT_MAX_WINDOWS,
                         "As eval.py: windows per length (0 = all).", lower_bound=0)
    flags.DEFINE_integer("piece_len", 2048, "As eval.py: tokens per prefill call.", lower_bound=1)
    flags.DEFINE_integer("batch_size", 1, "As eval.py: windows scored together.", lower_bound=1)
    flags.DEFINE_string("eval_config", None, "The config whose held-out data the evaluation "
                        "reads (default: the first variant's run folder).")
    flags.DEFINE_bool("mqar", False, "Also train and score MQAR recall for each variant's "
                      "layer pattern (a small model; see --mqar_config).")
    flags.DEFINE_string("mqar_config", "configs/mqar.py", "The MQAR model and task "
                        "(configs/mqar.py[:arg]); its pattern is each variant's.")
    flags.DEFINE_list("mqar_seq_lens", ["64", "128"], "MQAR sequence lengths.")
    flags.DEFINE_string("train_py", None, "train.py to run (default: the repository's, beside "
                        "the kimi_k3 package).")
    compile_cache.define_flag()
    flags.mark_flag_as_required("out")


def main(argv: Sequence[str]) -> None:
    from absl import app, logging

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    F = flags.FLAGS
    if not F["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    try:
        lengths = eval_scoring.parse_context_lengths(F.context_lengths)
        eval_opts = eval_scoring.EvalOptions(
            context_lengths=lengths, piece_len=F.piece_len, batch_size=F.batch_size,
            short_docs=F.short_docs, max_windows=F.max_windows).validate()
        seq_lens = tuple(int(t) for t in F.mqar_seq_lens)
    except ValueError as e:  # every flag is checked before anything trains
        raise ConfigError(str(e) if str(e).startswith("--") else f"--mqar_seq_lens: {e}") from e
    variants = make_variants(F.variant, F.ratios, F.layers, F.base, F.set)
    compile_cache.enable(F.compilation_cache)
    opts = Options(
        out=os.path.normpath(F.out), eval=eval_opts, only=tuple(F.only), eval_only=F.eval_only,
        dry_run=F.dry_run, eval_config=F.eval_config, mqar=F.mqar, mqar_config=F.mqar_config,
        mqar_seq_lens=seq_lens, train_py=F.train_py or "",
        train_flags=(f"--compilation_cache={F.compilation_cache}",)
        if F["compilation_cache"].present else ())
    sweep(variants, opts, sys.argv[1:])


# Run as a program (python -m kimi_k3.sweep), or loaded by the documentation check: the flags.
# Imported as a library (``import kimi_k3.sweep``): no process-wide absl flag is defined.
if __name__ != "kimi_k3.sweep":
    define_flags()

if __name__ == "__main__":
    cli.run(main)
