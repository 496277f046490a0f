r"""Held-out perplexity at long context and loss by token position, one line per checkpoint.

    # a run folder alone: its own config (tokenizer, vocabulary, pattern); overrides on top
    python eval.py --checkpoint=runs/tiny --workdir=runs/tiny_eval --context_lengths=128,512,2K

    # several checkpoints on the same plots, LABEL=PATH each (each read with its run's config;
    # PATH@CONFIG names a config for a checkpoint outside a run folder)
    python eval.py --config=runs/r3 --workdir=runs/ablate_eval \
        --checkpoint=mla=runs/r0/checkpoints/5000 --checkpoint=3to1=runs/r3/checkpoints/5000 \
        --context_lengths=2048,8192,32768

Training and evaluating a list of variants in one command: ``python -m kimi_k3.sweep``.

Writes eval.json, eval_perplexity.csv, eval_loss_by_position.csv, eval_perplexity.png and
eval_loss_by_position.png to --workdir, and prints the perplexity table (and bits per byte when
the text is known), each figure with its 95% bootstrap interval over documents. All logic lives in
``kimi_k3.evaluation`` (the run), ``kimi_k3.eval_scoring`` (what is measured) and
``kimi_k3.eval_report`` (the files).
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from kimi_k3 import cli, compile_cache, eval_scoring, evaluation

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


@flags.validator("context_lengths")
def _lengths_parse(values):
    try:
        eval_scoring.parse_context_lengths(values)
    except ValueError as e:  # names the flag and the bad item
        raise flags.ValidationError(str(e)) from e
    return True

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

_CACHE = compile_cache.define_flag()


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:  # the command prints its own lines; -v 0 for library logs
        logging.set_verbosity(logging.WARNING)
    compile_cache.enable(_CACHE.value)
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
    )


if __name__ == "__main__":
    cli.run(main, config_from=("checkpoint",))
