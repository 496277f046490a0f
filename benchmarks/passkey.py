r"""Passkey retrieval at length: a pass key hidden at a depth of filler text, asked for at the end.

    # a trained checkpoint, at several lengths and depths (bytes, or the config's tokenizer)
    python benchmarks/passkey.py --config=configs/tiny.py --workdir=runs/tiny_passkey \
        --checkpoint=runs/tiny/checkpoints/200 --context_lengths=1K,4K,16K

    # on the CPU, from scratch: train the MQAR-sized model on short haystacks, then score it
    python benchmarks/passkey.py --config=configs/mqar.py --workdir=/tmp/passkey \
        --checkpoint=init --train_steps=600 --train_lengths=98,160 \
        --context_lengths=128,192,256 --mode=teacher_forced

Scores every (context length, depth) cell on --trials examples: exact match and digit
accuracy, by greedy decoding or teacher-forced argmax (--mode). Writes passkey.json (every
trial's key and the model's answer included), passkey.csv, passkey_exact.png and
passkey_digits.png (depth x context length heat maps, chance marked) to --workdir and prints
the table with the chance levels. The weights: --checkpoint (a step, checkpoints or run folder,
or 'init'), else the newest step under --workdir/checkpoints. All logic lives in
``kimi_k3.passkey``.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

# The repository root, for ``configs`` (configs/mqar.py imports ``configs.parse_arg``).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimi_k3 import cli, eval_scoring, passkey

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (the model and its tokenizer), e.g. configs/tiny.py.",
    lock_config=True)
flags.mark_flag_as_required("config")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the JSON, CSV and PNGs go.", required=True)
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", None, "A checkpoint step, checkpoints or run folder, or 'init' (untrained). "
    "Default: the newest under WORKDIR/checkpoints.")
_LENGTHS = flags.DEFINE_list(
    "context_lengths", ["1K"], "Prompt lengths in tokens: integers, or with K / M (x 1024 / x 1048576).")
_DEPTHS = flags.DEFINE_list(
    "depths", [str(d) for d in passkey.DEFAULT_DEPTHS],
    "Where the needle goes, as a fraction of the filler: 0 = first, 1 = right before the question.")
_DIGITS = flags.DEFINE_integer("digits", 5, "Digits of the pass key.", lower_bound=1, upper_bound=64)
_TRIALS = flags.DEFINE_integer("trials", 8, "Examples per (context length, depth).", lower_bound=1)
_MODE = flags.DEFINE_enum("mode", "greedy", list(passkey.MODES),
                          "greedy: decode the answer; teacher_forced: argmax at each answer position.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Examples decoded together.", lower_bound=1)
_PIECE = flags.DEFINE_integer("piece_len", 2048, "Prompt tokens per prefill call (bounds memory).",
                              lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Pass keys (and the training batches).")
_TRAIN_STEPS = flags.DEFINE_integer(
    "train_steps", 0, "First train the weights this many steps on short haystacks (not saved).",
    lower_bound=0)
_TRAIN_LENGTHS = flags.DEFINE_list("train_lengths", ["128"],
                                   "Training prompt lengths: one length, or lo,hi (uniform).")
_TRAIN_BATCH = flags.DEFINE_integer("train_batch_size", 16, "Training rows per step.", lower_bound=1)


cli.validate_with("context_lengths", eval_scoring.parse_context_lengths)
cli.validate_with("train_lengths",
                  lambda v: eval_scoring.parse_context_lengths(v, "--train_lengths"))
cli.validate_with("depths", passkey.parse_depths)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:  # the command prints its own lines; -v 0 for library logs
        logging.set_verbosity(logging.WARNING)
    passkey.main(
        _CONFIG.value,
        _WORKDIR.value,
        checkpoint=_CHECKPOINT.value,
        context_lengths=_LENGTHS.value,
        depths=_DEPTHS.value,
        digits=_DIGITS.value,
        trials=_TRIALS.value,
        mode=_MODE.value,
        batch_size=_BATCH.value,
        piece_len=_PIECE.value,
        seed=_SEED.value,
        train_steps=_TRAIN_STEPS.value,
        train_lengths=_TRAIN_LENGTHS.value,
        train_batch_size=_TRAIN_BATCH.value,
        config_name=config_flags.get_config_filename(flags.FLAGS["config"]),
    )


if __name__ == "__main__":
    cli.run(main, config_from=("checkpoint",))
