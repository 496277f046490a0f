"""eval.py's body: held-out perplexity and loss by position for one or more checkpoints, each
at every context length, in one table, one JSON, two CSVs and two plots.

    main(config, workdir, ["mla=runs/r0/checkpoints/5000", "3to1=runs/r3",
                           "other=/ckpts/9000@configs/ablate_ratio.py:ratio=1"], [2048, 8192])

A checkpoint is given as ``[LABEL=]PATH[@CONFIG]`` (``CheckpointSpec``): PATH a step, checkpoints
or run folder (``checkpoint.resolve_step_dir``), or ``init`` for the config's freshly initialised
weights. Its model's config: CONFIG (a ``config_files.load_config`` spec) when given, else the
config of the run folder PATH lies in, else --config's (``spec_config``). Each model is
restored by ``checkpoint.load_model`` (parameters only, checked against its config), scored
by ``eval_scoring`` (which also says what is measured and how), and reported by
``eval_report``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from kimi_k3 import internals as internals_lib
from kimi_k3 import mesh as mesh_lib
from kimi_k3 import plots
from kimi_k3 import ruler as ruler_lib
from kimi_k3.checkpoint import INIT_CHECKPOINT, load_model, pending_model, resolve_step_dir
from kimi_k3.config import ConfigError, check_context, kda_chunk, model_spec, normalize_rules
from kimi_k3.config_files import load_config
from kimi_k3.data import PackedRows, TextTokenizer, first_bad_id, load_split_streams
from kimi_k3.eval_report import format_table, write_outputs
from kimi_k3.eval_scoring import (
    BOOTSTRAP_SAMPLES,
    BOOTSTRAP_SEED,
    CI_LEVEL,
    DEFAULT_MAX_WINDOWS,
    DEFAULT_SHORT_DOCS,
    MIN_BUCKET_TARGETS,
    CompiledAhead,
    EvalOptions,
    Scorer,
    add_loss_changes,
    cut_windows,
    describe_windows,
    evaluate_windows,
    heldout_documents,
    scoring_flops,
    token_byte_lengths,
)
from kimi_k3.run_dir import check_workdir, find_run_folder
from kimi_k3.runtime import process_seconds, quiet_library_logs


class ScoringBar:
    """eval.py's bar over one model's scoring on a terminal: pieces done of all in its text,
    but filled by the pieces' forward FLOPs (``eval_scoring.scoring_flops``: ``flops`` by
    context length), so its rate and time left hold at long context, where each piece costs
    more than the one before. ``in_flops`` False: the counts are pieces (a model without a
    ModelSpec). A context manager; ``enabled`` False draws nothing."""

    def __init__(self, label: str, flops: dict[int, np.ndarray], *, in_flops: bool = True,
                 enabled: bool = True):
        self.label, self.done = label, 0
        self.pieces = sum(len(f) for f in flops.values())
        self.bar = tqdm(total=float(sum(f.sum() for f in flops.values())), desc=f"eval {label}",
                        unit="FLOP" if in_flops else "piece", unit_scale=True,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| "
                                   "[{elapsed}<{remaining}, {rate_fmt}{postfix}]",
                        disable=not enabled)

    def length(self, L: int) -> None:
        """The context length being scored now, shown in the bar's description."""
        self.bar.set_description_str(f"eval {self.label}, L={L:,}", refresh=False)

    def advance(self, piece_flops: float) -> None:
        """One piece done, of ``piece_flops``."""
        self.done += 1
        self.bar.set_postfix_str(f"{self.done}/{self.pieces} pieces", refresh=False)
        self.bar.update(piece_flops)

    def __enter__(self) -> ScoringBar:
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


class Timeline:
    """Where an evaluation's wall time goes, by stage, in seconds: "startup" (from the process's
    start to ``run``: imports, the backend, flags; None where the start cannot be read),
    "data" (held-out documents, windows, byte table), "model" (building or restoring each
    model, its weights on the device), "compiling" (the scoring programs: tracing, then XLA
    or its cache), "scoring" (the pieces and the statistics), "writing" (files and table).
    """

    STAGES = ("startup", "data", "model", "compiling", "scoring", "writing")

    def __init__(self):
        self.seconds = dict.fromkeys(self.STAGES, 0.0)
        self.seconds["startup"] = process_seconds()
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        """Adds the time since the last lap to ``stage``."""
        now = time.perf_counter()
        self.seconds[stage] += now - self._last
        self._last = now

    def move(self, seconds: float, source: str, target: str) -> None:
        """Moves ``seconds`` of ``source``'s time to ``target`` (compiling, timed inside scoring)."""
        self.seconds[source] -= seconds
        self.seconds[target] += seconds

    def summary(self) -> str:
        """One line: the total and each stage."""
        known = {k: v for k, v in self.seconds.items() if v is not None}
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in known.items())
        since = "since the process started" if self.seconds["startup"] is not None else "in run"
        return f"time: {sum(known.values()):.1f} s {since}: {parts}"


# ---------------------------------------------------------------------------------------------
# Checkpoint specs and the models they name
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    """One model to evaluate: a checkpoint path (or ``init``), its label and its config spec."""

    path: str
    label: str
    # a config spec; None: the run's own config when PATH lies in a run folder that has one,
    # else the --config given to eval.py
    config: str | None = None

    @classmethod
    def parse(cls, text: str) -> CheckpointSpec:
        """``[LABEL=]PATH[@CONFIG_SPEC]``.

        Example: ``r3=runs/r3/checkpoints/2000``, ``r3=/ckpts/2000@configs/ablate_ratio.py:ratio=3``.

        PATH ``init`` evaluates the config's freshly initialised weights (a baseline, a smoke
        run). The label defaults to the run directory's name (or ``init``).
        """
        body, _, config = text.partition("@")
        label, eq, path = body.partition("=")
        if not eq:
            label, path = "", body
        if not path:
            raise ValueError(f"--checkpoint: {text!r} names no path; expected [LABEL=]PATH[@CONFIG]")
        if not label:
            label = path if path == INIT_CHECKPOINT else _default_label(path)
        return cls(path=path, label=label, config=config or None)


def _default_label(path: str) -> str:
    parts = os.path.normpath(path).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "checkpoints":
        return f"{parts[-3]}@{parts[-1]}"  # runs/r3/checkpoints/2000 -> r3@2000
    return parts[-1]


def spec_config(spec: CheckpointSpec, config, overrides: Sequence[str] = ()):
    """The config of ``spec``'s model: its own ``@CONFIG``, else the run's own config when its
    path lies in a run folder that has one (``run_dir.find_run_folder``), else ``config``
    (eval.py's --config). ``overrides`` (dotted fields given as ``--config.<field>=...``) are
    copied from ``config`` onto a config of its own, so a command line's overrides reach every
    checkpoint. A config that cannot be loaded is a ValueError naming the --checkpoint it came
    with."""
    source = spec.config
    if source is None and spec.path != INIT_CHECKPOINT:
        source = find_run_folder(spec.path)
    if source is None:
        return config
    try:
        own = load_config(source)
    except ValueError as e:  # e names the file, or the argument that does not parse
        raise ConfigError(f"--checkpoint {spec.label}={spec.path}@{source}: {e}") from e
    return apply_overrides(own, config, overrides)


def apply_overrides(target, source, fields: Sequence[str]):
    """``target`` (a ConfigDict) with each dotted field of ``fields`` set to its value in
    ``source``; a field ``target`` lacks is named in a ValueError."""
    if not fields:
        return target
    target = copy.deepcopy(target)
    for dotted in fields:
        *path, leaf = dotted.split(".")
        src, dst = source, target
        for part in path:
            src, dst = src[part], dst.get(part)
            if dst is None:
                raise ConfigError(f"--config.{dotted}: the checkpoint's own config has no "
                                 f"section {part!r}")
        with dst.unlocked() if hasattr(dst, "unlocked") else contextlib.nullcontext():
            dst[leaf] = src[leaf]
    return target


# ---------------------------------------------------------------------------------------------
# The whole evaluation: every checkpoint at every length, then tables, files and plots
# ---------------------------------------------------------------------------------------------


def run(
    config,
    checkpoints: Sequence[CheckpointSpec],
    opts: EvalOptions,
    workdir: str,
    *,
    docs: Sequence[np.ndarray] | None = None,
    models: dict | None = None,
    progress: bool = True,
    config_name: str = "--config",
    overrides: Sequence[str] = (),  # --config.<field> given: they reach every checkpoint
) -> dict:
    """Evaluate every checkpoint at every context length; write JSON, CSV and PNGs to ``workdir``.

    ``docs`` overrides the held-out documents of ``config.data``; ``models`` ({label: model})
    supplies ready models instead of building them (tests). Returns the JSON-able report.
    """
    timeline = Timeline()
    opts.validate()
    check_labels(checkpoints)
    configs = {spec.label: spec_config(spec, config, overrides) for spec in checkpoints}
    if docs is None:
        docs = heldout_documents(config)
    windows = cut_windows(docs, opts.context_lengths, opts.short_docs, opts.max_windows)
    print("\n".join(describe_windows(windows)))
    byte_lengths, bytes_source = token_byte_lengths(config.data)  # the text is --config's data

    report = {
        "short_docs": opts.short_docs,
        "piece_len": opts.piece_len,
        "batch_size": opts.batch_size,
        "max_windows": opts.max_windows,
        "windows": {str(L): w.summary() for L, w in windows.items()},
        "bits_per_byte": bytes_source,
        "ci": {"level": CI_LEVEL, "method": "percentile bootstrap over documents",
               "samples": BOOTSTRAP_SAMPLES, "seed": BOOTSTRAP_SEED},
        "min_bucket_targets": MIN_BUCKET_TARGETS,
        "models": [],
    }
    for spec in checkpoints:  # every model's vocabulary first, before any model is built
        vocab = int(configs[spec.label].model.vocab_size)
        for L, w in windows.items():
            bad = first_bad_id(w.tokens_NxL1, vocab)
            if bad is not None:
                (window, position), tok = bad
                raise ValueError(
                    f"checkpoint {spec.label!r}: held-out token id {tok} (window {window} of "
                    f"L={L}, position {position}) is outside [0, {vocab}) = its "
                    f"model.vocab_size")
    mesh, rules = context_mesh(config, opts, list(configs.values()))
    plots_ready = []  # the thread warming matplotlib up, once started
    timeline.lap("data")
    for spec in checkpoints:
        cfg = configs[spec.label]
        ahead = None
        if models is not None and spec.label in models:
            model, step = models[spec.label], None
        else:
            first = next((L for L, w in windows.items() if w.num_windows), None)
            pending = pending_model(
                cfg, spec.path, config_name=spec.config or config_name,
                give_config=lambda run, s=spec: f"--checkpoint={s.label}={s.path}@{run}")
            if mesh is None and first is not None:
                # The first length's piece program compiles while the weights load.
                ahead = CompiledAhead(pending.make_abstract, opts.batch_size, opts.piece_len,
                                      first)
            model, step = pending.load()
            if step is not None:
                print(f"{spec.label}: restored step {step} from {spec.path}")
        scorer = ahead.scorer(model) if ahead else Scorer(model, mesh=mesh, rules=rules)
        jax.block_until_ready(scorer.weights)  # so a model's initialiser counts as "model"
        timeline.lap("model")
        entry = {
            "label": spec.label,
            "checkpoint": spec.path,
            "config": spec.config or config_name,
            "step": step,
            "params": _param_count(model),
            # compiling the first length's piece program while the weights loaded: in "model"
            "compiled_ahead_seconds": None if ahead is None else round(ahead.seconds, 3),
            "results": {},
        }
        flops = {L: scoring_flops(scorer.spec, L, opts.piece_len, w.num_windows,
                                  opts.batch_size) for L, w in windows.items()}
        # No bar in a log file: its carriage-return redraws would pile up there.
        with ScoringBar(spec.label, flops, in_flops=scorer.spec is not None,
                        enabled=progress and sys.stderr.isatty()) as bar:

            def piece_done(piece_flops, bar=bar):
                bar.advance(piece_flops)
                # Once the first piece is done (its program compiled, no tracing left to slow
                # down), matplotlib's first-use costs are paid while the device scores.
                if not plots_ready:
                    plots_ready.append(plots.warm_up_in_background())

            for L, w in windows.items():
                if w.num_windows == 0:
                    continue
                bar.length(L)
                result = evaluate_windows(
                    scorer, w, opts, on_piece=piece_done, byte_lengths=byte_lengths)
                entry["results"][str(L)] = result
                timeline.lap("scoring")
                timeline.move(result["compile_seconds"], "scoring", "compiling")
        add_loss_changes(entry["results"])  # short_docs=same: each length against the shortest
        report["models"].append(entry)
        del scorer, model

    for thread in plots_ready:
        thread.join()
    os.makedirs(workdir, exist_ok=True)  # only now: a run stopped on any error leaves none
    # the files carry every stage up to writing them; the closing line has that too
    report["timeline"] = {k: v for k, v in timeline.seconds.items() if k != "writing"}
    write_outputs(report, workdir)
    print(format_table(report))
    timeline.lap("writing")
    print(timeline.summary())
    return report


def run_internals(config, checkpoints: Sequence[CheckpointSpec], workdir: str, *,
                  config_name: str = "--config", overrides: Sequence[str] = (),
                  models: dict | None = None) -> dict:
    """``eval.py --internals``: the internals report (``kimi_k3.internals``) of every
    checkpoint on the same held-out rows: the first ``internals.ROWS`` rows of
    ``config.data.seq_len`` tokens of --config's held-out split, as the trainer reads them.
    Writes ``internals.json`` and the PNGs (``internals.write_comparison``) to ``workdir``,
    prints one line per checkpoint, returns the JSON-able report. ``models`` ({label: model})
    supplies ready models (tests)."""
    check_labels(checkpoints)
    configs = {spec.label: spec_config(spec, config, overrides) for spec in checkpoints}
    T = int(config.data.seq_len)
    _, stream = load_split_streams(config.data, int(config.model.vocab_size))
    if stream is None or stream.num_tokens < T:
        raise ValueError(f"--internals: config.data holds out no row of data.seq_len={T} tokens "
                         f"(source={config.data.source!r}, eval_fraction="
                         f"{config.data.eval_fraction}); set data.eval_paths or raise "
                         f"data.eval_fraction")
    rows = PackedRows(stream, T, 0, False)
    batch = rows.rows(range(min(internals_lib.ROWS, rows.num_rows)))
    for spec in checkpoints:  # every vocabulary first, before any model is built
        vocab = int(configs[spec.label].model.vocab_size)
        bad = first_bad_id(batch["tokens"], vocab)
        if bad is not None:
            (row, position), tok = bad
            raise ValueError(f"checkpoint {spec.label!r}: held-out token id {tok} (row {row}, "
                             f"position {position}) is outside [0, {vocab}) = its "
                             f"model.vocab_size")
    reports, compiled = [], {}  # one compilation per architecture
    for spec in checkpoints:
        if models is not None and spec.label in models:
            model, step = models[spec.label], None
        else:
            model, step = load_model(
                configs[spec.label], spec.path, config_name=spec.config or config_name,
                give_config=lambda run, s=spec: f"--checkpoint={s.label}={s.path}@{run}")
            if step is not None:
                print(f"{spec.label}: restored step {step} from {spec.path}")
        stats = internals_lib.measure_model(model, batch, compiled)
        reports.append(internals_lib.ModelReport(spec.label, spec.path, step, model.spec, stats))
        del model
    os.makedirs(workdir, exist_ok=True)
    report = internals_lib.write_comparison(reports, workdir, len(batch["tokens"]), T)
    with open(os.path.join(workdir, "internals.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"internals on {len(batch['tokens'])} held-out rows of {T} tokens "
          f"({workdir}/internals.json)")
    print(internals_lib.compare_table(reports))
    return report


# ---------------------------------------------------------------------------------------------
# lm-evaluation-harness tasks and the RULER suite (eval.py --lm_eval_tasks, --ruler_tasks)
# ---------------------------------------------------------------------------------------------


# Set before the harness (and Hugging Face's datasets with it) is imported: no request leaves
# the machine; tasks read local files.
HF_OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                  "HF_EVALUATE_OFFLINE": "1"}


@dataclasses.dataclass(frozen=True)
class LmEvalOptions:
    """eval.py's --lm_eval_* flags (``kimi_k3.lm_eval_adapter``)."""

    tasks: tuple[str, ...]
    include: str | None = None  # a folder of task YAML files
    limit: float | None = None  # documents per task (< 1: a share of them)
    output: str | None = None  # default WORKDIR/lm_eval.json
    num_fewshot: int | None = None  # default: each task's own

    def validate(self) -> LmEvalOptions:
        if not self.tasks:
            raise ValueError("--lm_eval_tasks: empty; give task names, e.g. "
                             "--lm_eval_tasks=k3_choice,k3_generate")
        if self.include and not os.path.isdir(self.include):
            raise FileNotFoundError(f"--lm_eval_include: {self.include!r} is not a folder (of "
                                    f"task YAML files)")
        if self.limit is not None and not self.limit > 0:
            raise ValueError(f"--lm_eval_limit: {self.limit!r} must be > 0 (documents per "
                             f"task; below 1 a share of them)")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ValueError(f"--lm_eval_num_fewshot: {self.num_fewshot!r} must be >= 0")
        return self


def prefix_token(config, tokenizer: TextTokenizer) -> int:
    """The token an empty context or a scored text starts from: ``data.eos_id`` when set, else
    the tokenizer's BOS, else its EOS, else the first token of a newline (bytes: 10)."""
    eos = int(config.data.get("eos_id", -1)) if "data" in config else -1
    if eos >= 0:
        return eos
    for i in (tokenizer.bos_id, tokenizer.eos_id):
        if i is not None:
            return int(i)
    return int(tokenizer.encode("\n")[0])


def _load(spec: CheckpointSpec, cfg, config_name: str, models: dict | None):
    if models is not None and spec.label in models:
        return models[spec.label], None
    model, step = load_model(cfg, spec.path, config_name=spec.config or config_name,
                             give_config=lambda run: f"--checkpoint={spec.label}={spec.path}@{run}")
    if step is not None:
        print(f"{spec.label}: restored step {step} from {spec.path}", file=sys.stderr)
    return model, step


def run_lm_eval(config, checkpoints: Sequence[CheckpointSpec], opts: LmEvalOptions,
                workdir: str, *, piece_len: int = 2048, batch_size: int = 1,
                progress: bool = True, config_name: str = "--config",
                overrides: Sequence[str] = (), models: dict | None = None) -> dict:
    """``eval.py --lm_eval_tasks``: the harness's tasks on every checkpoint, each model with its
    own config's tokenizer (``kimi_k3.lm_eval_adapter``; rows of ``piece_len`` tokens,
    ``batch_size`` rows per call). Process 0 drives the harness and writes
    ``opts.output`` (default WORKDIR/lm_eval.json: per checkpoint label its results); every
    other process follows. Returns {label: results} (empty on the followers)."""
    for key, value in HF_OFFLINE_ENV.items():  # read by Hugging Face's libraries on import
        os.environ.setdefault(key, value)
    try:  # the optional [eval] extra
        from kimi_k3 import lm_eval_adapter
    except ImportError as e:
        raise ValueError(f"--lm_eval_tasks: lm-evaluation-harness is not installed ({e}); "
                         f"pip install -e '.[eval]'") from e
    # the task names checked before any model is read, on the process that runs the harness;
    # the others hear whether to go on (else they would wait for its requests forever)
    manager, error = None, None
    if jax.process_index() == 0:
        try:
            manager = lm_eval_adapter.task_manager(opts.tasks, opts.include)
        except ValueError as e:
            error = e
    if not lm_eval_adapter.Channel().agree(error is None):
        if error is not None:
            raise error
        raise ValueError("--lm_eval_tasks: process 0 refused the tasks (its error says why)")
    out = {}
    for spec in checkpoints:
        cfg = spec_config(spec, config, overrides)
        tokenizer = TextTokenizer(cfg.data.tokenizer if "data" in cfg else "")
        model, step = _load(spec, cfg, config_name, models)
        eos = int(cfg.data.get("eos_id", -1)) if "data" in cfg else -1
        engine = lm_eval_adapter.TokenEngine(model, row_len=piece_len, batch_size=batch_size,
                                             piece_len=piece_len, progress=progress)
        lm = lm_eval_adapter.KimiLM(engine, tokenizer, prefix_token(cfg, tokenizer),
                                    stop_id=eos if eos >= 0 else tokenizer.eos_id,
                                    seed=int(cfg.get("seed", 0)))
        results = lm_eval_adapter.evaluate_tasks(
            lm, opts.tasks, opts.include, limit=opts.limit, num_fewshot=opts.num_fewshot,
            seed=int(cfg.get("seed", 0)), manager=manager)
        if results is not None:
            out[spec.label] = {"checkpoint": spec.path, "step": step,
                               "tokenizer": tokenizer.path or "bytes",
                               **lm_eval_adapter.summary(results)}
            print(f"lm-eval, {spec.label}:")
            print(lm_eval_adapter.table(results))
        del engine, lm, model
    if jax.process_index() == 0:
        path = opts.output or os.path.join(workdir, "lm_eval.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {path}")
    return out


def run_ruler(config, checkpoints: Sequence[CheckpointSpec], opts: ruler_lib.RulerOptions,
              workdir: str, *, progress: bool = True, config_name: str = "--config",
              overrides: Sequence[str] = (), models: dict | None = None) -> dict:
    """``eval.py --ruler_tasks``: the RULER suite (``kimi_k3.ruler``) on every checkpoint,
    each through its own config's tokenizer, the same examples for models that share one.
    Writes ruler.json, ruler.csv and ruler_heatmap.png (the checkpoints side by side) to
    ``workdir``, prints the tables, returns the report. Runs on process 0 alone."""
    if jax.process_index() != 0:
        return {}
    configs = {spec.label: spec_config(spec, config, overrides) for spec in checkpoints}
    suites = {}
    for spec in checkpoints:  # every tokenizer and length first, before any model is built
        cfg = configs[spec.label]
        suite = ruler_lib.RulerSuite(TextTokenizer(cfg.data.tokenizer if "data" in cfg else ""),
                                     opts.value_digits)
        vocab = int(cfg.model.vocab_size)
        if suite.max_token_id() >= vocab:
            raise ValueError(f"checkpoint {spec.label!r}: its tokenizer ({suite.tokenizer_name}) "
                             f"gives id {suite.max_token_id()}, outside [0, {vocab}) = its "
                             f"model.vocab_size")
        for task in opts.tasks:
            suite.example(task, min(opts.lengths), 0.0 if task in ruler_lib.NEEDLE_TASKS else None,
                          np.random.default_rng(0))  # a length too short is named now
        suites[spec.label] = suite
    report = ruler_lib.new_report(next(iter(suites.values())), opts)
    report["tokenizer"] = ", ".join(sorted({s.tokenizer_name for s in suites.values()}))
    for spec in checkpoints:
        model, step = _load(spec, configs[spec.label], config_name, models)
        rows = ruler_lib.evaluate(model, suites[spec.label], opts, progress=progress,
                                  label=spec.label)
        report["models"].append({"label": spec.label, "checkpoint": spec.path, "step": step,
                                 "tokenizer": suites[spec.label].tokenizer_name, "rows": rows})
        del model
    paths = ruler_lib.write_outputs(report, workdir)
    print(ruler_lib.format_table(report))
    print(f"wrote {', '.join(os.path.basename(p) for p in paths.values())} to {workdir}")
    return report


def context_mesh(config, opts: EvalOptions, model_configs: Sequence) -> tuple:
    """(mesh, rules) for ``config.mesh.context`` = n > 1: each piece of a window is split over
    the first n devices (context parallelism; nothing else is split), else (None, ()). Every
    piece, min(piece_len, L) tokens, must divide into n shards of whole KDA chunks of every
    model; the error names --piece_len."""
    mesh_cfg = config.get("mesh")
    n = int(mesh_cfg.get("context", 1)) if mesh_cfg is not None else 1
    if n <= 1:
        return None, ()
    sizes = ml_collections.ConfigDict({"data": 1, "fsdp": 1, "expert": 1, "context": n,
                                       "tensor": 1})
    mesh = mesh_lib.make_mesh(sizes, jax.devices()[:n])
    for cfg in model_configs:
        chunk = kda_chunk(model_spec(cfg.model))
        for L in opts.context_lengths:
            check_context(min(opts.piece_len, L), n, chunk,
                          field=f"--piece_len (a piece of L={L})")
    return mesh, normalize_rules(mesh_cfg.axis_rules)


def check_labels(checkpoints: Sequence[CheckpointSpec]) -> None:
    """Raises ValueError naming ``--checkpoint`` unless there is at least one checkpoint and
    their labels are distinct (one line per label on every plot)."""
    if not checkpoints:
        raise ValueError("--checkpoint: none given")
    labels = [c.label for c in checkpoints]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--checkpoint: labels must be distinct, got {labels}; name them "
                         f"LABEL=PATH")


def _param_count(model) -> int | None:
    """Parameters of an ``nnx.Module``; None for any other model object (a test double)."""
    if not isinstance(model, nnx.Module):
        return None
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def main(
    config,
    workdir: str,
    checkpoints: Sequence[str],
    context_lengths: Sequence[int],
    *,
    piece_len: int = 2048,
    batch_size: int = 1,
    short_docs: str = DEFAULT_SHORT_DOCS,
    max_windows: int = DEFAULT_MAX_WINDOWS,
    whole_check_max_len: int = 0,
    progress: bool = True,
    config_name: str = "--config",
    overrides: Sequence[str] = (),
    internals: bool = False,
    perplexity: bool = True,
    lm_eval: LmEvalOptions | None = None,
    ruler: ruler_lib.RulerOptions | None = None,
) -> dict:
    """eval.py's body. With no ``checkpoints``, the latest checkpoint under ``workdir/checkpoints``.

    Every flag is checked (each error naming it) before a checkpoint or the data is read, and
    ``workdir`` is created only when the results are written: an evaluation that fails leaves
    no folder behind. ``internals``: also the internals report (``run_internals``), returned
    under "internals"; ``perplexity=False`` skips the perplexity evaluation. ``lm_eval``: the
    harness's tasks (``run_lm_eval``), returned under "lm_eval"; ``ruler``: the RULER suite
    (``run_ruler``), under "ruler".
    """
    if config is None:
        raise ValueError("--config: required (the model and the held-out data to use)")
    if not (perplexity or internals or lm_eval or ruler):
        raise ValueError("--noperplexity: leaves nothing to evaluate; add --internals, "
                         "--lm_eval_tasks or --ruler_tasks")
    if lm_eval is not None:
        lm_eval.validate()
    if ruler is not None:
        ruler.validate()
    opts = EvalOptions(
        context_lengths=tuple(int(x) for x in context_lengths),
        piece_len=piece_len,
        batch_size=batch_size,
        short_docs=short_docs,
        max_windows=max_windows,
        whole_check_max_len=whole_check_max_len,
    ).validate()
    quiet_library_logs()  # Orbax reports every read in INFO lines
    if not checkpoints:
        own = os.path.join(workdir, "checkpoints")
        try:
            latest, _ = resolve_step_dir(own)
        except (FileNotFoundError, ValueError) as e:
            raise FileNotFoundError(
                f"--checkpoint: none given and no checkpoint under {own!r}; "
                f"pass --checkpoint=PATH (or --checkpoint=init for untrained weights)"
            ) from e
        checkpoints = [latest]
    specs = [CheckpointSpec.parse(c) for c in checkpoints]
    check_labels(specs)
    for s in specs:
        if s.path != INIT_CHECKPOINT and not os.path.exists(s.path):
            raise FileNotFoundError(f"--checkpoint: {s.path!r} does not exist")
        spec_config(s, config, overrides)  # a @CONFIG that does not load fails now
    if perplexity:
        context_mesh(config, opts, [spec_config(s, config, overrides) for s in specs])
    workdir = check_workdir(workdir, create=False)
    report = {}
    if perplexity:
        report = run(config, specs, opts, workdir, progress=progress, config_name=config_name,
                     overrides=overrides)
    if internals:
        report["internals"] = run_internals(config, specs, workdir, config_name=config_name,
                                            overrides=overrides)
    if ruler is not None:
        report["ruler"] = run_ruler(config, specs, ruler, workdir, progress=progress,
                                    config_name=config_name, overrides=overrides)
    if lm_eval is not None:
        report["lm_eval"] = run_lm_eval(config, specs, lm_eval, workdir, piece_len=piece_len,
                                        batch_size=batch_size, progress=progress,
                                        config_name=config_name, overrides=overrides)
    return report
