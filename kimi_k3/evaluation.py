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
import os
import sys
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from kimi_k3 import mesh as mesh_lib
from kimi_k3.checkpoint import INIT_CHECKPOINT, load_model, resolve_step_dir
from kimi_k3.config import ConfigError, check_context, kda_chunk, model_spec, normalize_rules
from kimi_k3.config_files import load_config
from kimi_k3.data import first_bad_id
from kimi_k3.eval_report import format_table, write_outputs
from kimi_k3.eval_scoring import (
    BOOTSTRAP_SAMPLES,
    BOOTSTRAP_SEED,
    CI_LEVEL,
    DEFAULT_MAX_WINDOWS,
    DEFAULT_SHORT_DOCS,
    MIN_BUCKET_TARGETS,
    EvalOptions,
    Scorer,
    add_loss_changes,
    cut_windows,
    describe_windows,
    evaluate_windows,
    heldout_documents,
    token_byte_lengths,
)
from kimi_k3.run_dir import check_workdir, find_run_folder
from kimi_k3.runtime import quiet_library_logs

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
    pieces_per_model = sum(
        -(-w.num_windows // opts.batch_size) * -(-L // min(opts.piece_len, L))
        for L, w in windows.items()
    )
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
    for spec in checkpoints:
        cfg = configs[spec.label]
        if models is not None and spec.label in models:
            model, step = models[spec.label], None
        else:
            model, step = load_model(
                cfg, spec.path, config_name=spec.config or config_name,
                give_config=lambda run, s=spec: f"--checkpoint={s.label}={s.path}@{run}")
            if step is not None:
                print(f"{spec.label}: restored step {step} from {spec.path}")
        scorer = Scorer(model, mesh=mesh, rules=rules)
        entry = {
            "label": spec.label,
            "checkpoint": spec.path,
            "config": spec.config or config_name,
            "step": step,
            "params": _param_count(model),
            "results": {},
        }
        # No bar in a log file: its carriage-return redraws would pile up there.
        with tqdm(total=pieces_per_model, desc=f"eval {spec.label}", unit="piece",
                  disable=not (progress and sys.stderr.isatty())) as bar:
            for L, w in windows.items():
                if w.num_windows == 0:
                    continue
                bar.set_postfix(L=L)
                entry["results"][str(L)] = evaluate_windows(
                    scorer, w, opts, on_piece=lambda: bar.update(1), byte_lengths=byte_lengths)
        add_loss_changes(entry["results"])  # short_docs=same: each length against the shortest
        report["models"].append(entry)
        del scorer, model

    os.makedirs(workdir, exist_ok=True)  # only now: a run stopped on any error leaves none
    write_outputs(report, workdir)
    print(format_table(report))
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
) -> dict:
    """eval.py's body. With no ``checkpoints``, the latest checkpoint under ``workdir/checkpoints``.

    Every flag is checked (each error naming it) before a checkpoint or the data is read, and
    ``workdir`` is created only when the results are written: an evaluation that fails leaves
    no folder behind.
    """
    if config is None:
        raise ValueError("--config: required (the model and the held-out data to use)")
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
    context_mesh(config, opts, [spec_config(s, config, overrides) for s in specs])
    workdir = check_workdir(workdir, create=False)
    return run(config, specs, opts, workdir, progress=progress, config_name=config_name,
               overrides=overrides)
