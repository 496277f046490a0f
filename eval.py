r"""Held-out perplexity at long context and loss by token position, one line per checkpoint.

    python eval.py --config=configs/tiny.py --workdir=runs/tiny_eval \
        --checkpoint=runs/tiny/checkpoints/1000 --context_lengths=512,2048,8192

    # a ratio ablation in one command: LABEL=PATH@CONFIG per checkpoint
    python eval.py --config=configs/ablate_ratio.py:ratio=3 --workdir=runs/ablate_eval \
        --checkpoint=mla=runs/r0/checkpoints/5000@configs/ablate_ratio.py:ratio=0 \
        --checkpoint=3to1=runs/r3/checkpoints/5000@configs/ablate_ratio.py:ratio=3 \
        --context_lengths=2048,8192,32768 --short_docs=concat

Writes eval.json, eval_perplexity.csv, eval_loss_by_position.csv, eval_perplexity.png and
eval_loss_by_position.png to --workdir, and prints the perplexity table. All logic lives in
``kimi_k3.evaluation`` (the run), ``kimi_k3.eval_scoring`` (what is measured) and
``kimi_k3.eval_report`` (the files).
"""

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
    "short_docs", "skip", list(eval_scoring.SHORT_DOC_RULES),
    "Documents shorter than a context length: skip them, or concatenate all documents.",
)
_MAX_WINDOWS = flags.DEFINE_integer("max_windows", 16, "Windows per context length (0 = all).",
                                    lower_bound=0)
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
    )


if __name__ == "__main__":
    cli.run(main)
