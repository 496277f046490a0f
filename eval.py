r"""Held-out perplexity at long context and loss by token position, one line per checkpoint.

    # a run folder alone: its own config (tokenizer, vocabulary, pattern); overrides on top
    python eval.py --checkpoint=runs/tiny --workdir=runs/tiny_eval --context_lengths=128,512,2K

    # several checkpoints on the same plots, LABEL=PATH each (each read with its run's config;
    # PATH@CONFIG names a config for a checkpoint outside a run folder)
    python eval.py --config=runs/r3 --workdir=runs/ablate_eval \
        --checkpoint=mla=runs/r0/checkpoints/5000 --checkpoint=3to1=runs/r3/checkpoints/5000 \
        --context_lengths=2048,8192,32768

    # what is inside: KDA memory timescales, MLA reach, Attention Residual weights, expert load
    python eval.py --workdir=runs/ablate_internals --internals --noperplexity \
        --checkpoint=mla=runs/r0 --checkpoint=3to1=runs/r3

    # lm-evaluation-harness tasks, in process (the [eval] extra): local YAML tasks, or its own
    python eval.py --checkpoint=runs/tiny --workdir=runs/tiny_lm_eval \
        --lm_eval_tasks=k3_choice,k3_rolling,k3_generate --lm_eval_include=tests/fixtures/lm_eval

    # the RULER-style suite, generated here: a table by task x length, heat maps side by side
    python eval.py --workdir=runs/ruler --checkpoint=r0=runs/r0 --checkpoint=r3=runs/r3 \
        --ruler_tasks=all --ruler_lengths=4K,32K,128K --ruler_depths=0,0.5,1 --ruler_samples=4

With --lm_eval_tasks or --ruler_tasks the perplexity evaluation runs only when --perplexity is
given. Multi-host (lm-eval): every process runs the same command with
``--coordinator_address=HOST:PORT --num_processes=N --process_id=I`` (or ``--multihost``);
process 0 drives the harness and writes the results, the others score their share.

Training and evaluating a list of variants in one command: ``python -m kimi_k3.sweep``.

Writes eval.json, eval_perplexity.csv, eval_loss_by_position.csv, eval_perplexity.png and
eval_loss_by_position.png to --workdir (with --internals also internals.json and
internals_*.png, ``kimi_k3.internals``), and prints the perplexity table (and bits per byte when
the text is known), each figure with its 95% bootstrap interval over documents. All logic lives in
``kimi_k3.evaluation`` (the run), ``kimi_k3.eval_scoring`` (what is measured) and
``kimi_k3.eval_report`` (the files).
"""

import sys

from absl import flags
from ml_collections import config_flags

from kimi_k3 import cli, compile_cache, eval_scoring, evaluation
from kimi_k3 import ruler as ruler_lib

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (model + held-out data), e.g. configs/tiny.py.", lock_config=True
)
flags.mark_flag_as_required("config")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the JSON, CSV and PNGs go.", required=True)
_CHECKPOINT = flags.DEFINE_multi_string(
    "checkpoint", [],
    "[LABEL=]PATH[@CONFIG]: a checkpoint step dir (or 'init' for untrained weights), its label "
    "and, if it differs from --config, its config. Repeat for one line per checkpoint. "
    "Default: the latest checkpoint under WORKDIR/checkpoints.",
)
_LENGTHS = flags.DEFINE_list(
    "context_lengths", ["2048"],
    "Context lengths to evaluate, in tokens: integers, or with K / M (x 1024 / x 1048576).")


cli.validate_with("context_lengths", eval_scoring.parse_context_lengths)

_PIECE = flags.DEFINE_integer(
    "piece_len", 2048, "Tokens per prefill call (bounds memory); any positive number: the last "
    "piece of a window is padded.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_size", 1, "Windows evaluated together.", lower_bound=1)
_SHORT = flags.DEFINE_enum(
    "short_docs", eval_scoring.DEFAULT_SHORT_DOCS, list(eval_scoring.SHORT_DOC_RULES),
    "Which text each length scores. same: at every length the same spans of the documents long "
    "enough for the longest length; skip: at each length the documents long enough for it; "
    "concat: all documents as one stream (windows may span documents).",
)
_MAX_WINDOWS = flags.DEFINE_integer(
    "max_windows", eval_scoring.DEFAULT_MAX_WINDOWS,
    "Windows kept per context length, spread evenly (with --short_docs=same: at the longest "
    "length; shorter lengths cut the same spans into more windows). 0 = all.", lower_bound=0)
_WHOLE = flags.DEFINE_integer(
    "whole_check_max_len", 0,
    "Also score the first batch in one whole-sequence pass for lengths up to this, and report "
    "the largest NLL difference (0 = never).",
    lower_bound=0,
)

_INTERNALS = flags.DEFINE_bool(
    "internals", False,
    "Also report each checkpoint's internals (KDA memory timescales, MLA attention entropy "
    "and distance, Attention Residual weights, expert load) on the first held-out rows: "
    "internals.json and internals_*.png, the checkpoints side by side.")
_PERPLEXITY = flags.DEFINE_bool(
    "perplexity", True,
    "The perplexity evaluation over --context_lengths; --noperplexity --internals runs the "
    "internals report alone.")

_LM_EVAL_TASKS = flags.DEFINE_list(
    "lm_eval_tasks", [], "lm-evaluation-harness tasks to run (names of its own tasks or of the "
    "YAML files under --lm_eval_include); needs the [eval] extra.")
_LM_EVAL_INCLUDE = flags.DEFINE_string(
    "lm_eval_include", None, "A folder of task YAML files (local data: dataset_path: json with "
    "dataset_kwargs: data_files).")
_LM_EVAL_LIMIT = flags.DEFINE_float(
    "lm_eval_limit", None, "Documents per task, at most (below 1: that share of them).")
_LM_EVAL_FEWSHOT = flags.DEFINE_integer(
    "lm_eval_num_fewshot", None, "Few-shot examples per prompt (default: each task's own).")
_LM_EVAL_OUTPUT = flags.DEFINE_string(
    "lm_eval_output", None, "Where the harness's results go (JSON); default WORKDIR/lm_eval.json.")
_RULER_TASKS = flags.DEFINE_list(
    "ruler_tasks", [], "RULER-style tasks (kimi_k3/ruler.py): niah_single, niah_multikey, "
    "niah_multivalue, niah_multiquery, vt, cwe, fwe, or all.")
_RULER_LENGTHS = flags.DEFINE_list(
    "ruler_lengths", ["4K"], "RULER prompt lengths in tokens, with K / M as --context_lengths.")
_RULER_DEPTHS = flags.DEFINE_list(
    "ruler_depths", ["0", "0.25", "0.5", "0.75", "1"],
    "Where the needle asked about goes, as a share of the filler (0 first, 1 last).")
_RULER_SAMPLES = flags.DEFINE_integer(
    "ruler_samples", 4, "RULER examples per (task, length, depth).", lower_bound=1)
_RULER_DIGITS = flags.DEFINE_integer(
    "ruler_value_digits", 7, "Digits of the numbers the RULER needles hide.", lower_bound=2)
_RULER_SEED = flags.DEFINE_integer("ruler_seed", 0, "Seed of the RULER examples.")
_MULTIHOST = cli.define_multihost_flags()

_CACHE = compile_cache.define_flag()


def main(argv):
    cli.start(argv, _CACHE.value)
    _MULTIHOST.initialize()
    lm_eval = ruler = None
    if _LM_EVAL_TASKS.value:
        lm_eval = evaluation.LmEvalOptions(
            tuple(_LM_EVAL_TASKS.value), _LM_EVAL_INCLUDE.value, _LM_EVAL_LIMIT.value,
            _LM_EVAL_OUTPUT.value, _LM_EVAL_FEWSHOT.value)
    if _RULER_TASKS.value:
        ruler = ruler_lib.parse_options(
            _RULER_TASKS.value, _RULER_LENGTHS.value, _RULER_DEPTHS.value,
            samples=_RULER_SAMPLES.value, batch_size=_BATCH.value, piece_len=_PIECE.value,
            seed=_RULER_SEED.value, value_digits=_RULER_DIGITS.value)
    # a suite alone unless --perplexity is given too
    perplexity = _PERPLEXITY.value if flags.FLAGS["perplexity"].present else not (lm_eval or ruler)
    evaluation.main(
        _CONFIG.value,
        _WORKDIR.value,
        _CHECKPOINT.value,
        eval_scoring.parse_context_lengths(_LENGTHS.value),
        piece_len=_PIECE.value,
        batch_size=_BATCH.value,
        short_docs=_SHORT.value,
        max_windows=_MAX_WINDOWS.value,
        whole_check_max_len=_WHOLE.value,
        config_name=config_flags.get_config_filename(flags.FLAGS["config"]),
        overrides=cli.override_fields(sys.argv),
        internals=_INTERNALS.value,
        perplexity=perplexity,
        lm_eval=lm_eval,
        ruler=ruler,
    )


if __name__ == "__main__":
    cli.run(main, config_from=("checkpoint",), skip_teardown=True)
