r"""MQAR recall: all-KDA vs 3:1 vs all-MLA at a few sequence lengths, trained on the CPU.

    python benchmarks/mqar_sweep.py --config=configs/mqar.py --out_dir=benchmarks/results/mqar
    python benchmarks/mqar_sweep.py --config=configs/mqar.py --patterns=KK,KM,MM \
        --seq_lens=64,128 --config.train.steps=300

One fresh model per (pattern, length), trained on generated batches with the loss on the
answers only, then scored on held-out examples. Writes mqar_sweep.csv, mqar_sweep.md (the
table BENCHMARKS.md quotes, with the chance level under it) and mqar_sweep.png (chance dashed)
to --out_dir. Progress bars show on a terminal only; a log gets one line per finished model.
Logic, and why an all-MLA (NoPE) stack is expected to score near 1 / pairs:
``kimi_k3.mqar``.
"""

import os
import sys

from absl import app, flags
from ml_collections import config_flags

# The repository root, for ``configs`` (configs/mqar.py imports ``configs.parse_arg``).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimi_k3 import mqar

_CONFIG = config_flags.DEFINE_config_file("config", "configs/mqar.py", "MQAR config (configs/mqar.py).")
_PATTERNS = flags.DEFINE_list("patterns", ["KKKK", "KKKM", "MMMM"],
                              "Layer patterns to compare (K = KDA, M = Gated MLA).")
_LENGTHS = flags.DEFINE_list("seq_lens", ["32", "64", "128"], "MQAR sequence lengths.")
_OUT = flags.DEFINE_string("out_dir", "benchmarks/results/mqar", "Where the CSV, table and plot go.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    mqar.run_sweep(_CONFIG.value, _PATTERNS.value, [int(t) for t in _LENGTHS.value], _OUT.value)


if __name__ == "__main__":
    app.run(main)
