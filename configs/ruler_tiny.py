r"""A tiny byte-level model trained on RULER's own generator (kimi_k3/ruler.py): evidence that the
suite measures retrieval, on a CPU.

    python -m kimi_k3.ruler train --config=configs/ruler_tiny.py --workdir=runs/ruler_tiny_a \
        --tasks=niah_single --lengths=384,512 --value_digits=4
    python -m kimi_k3.ruler train --config=configs/ruler_tiny.py --checkpoint=runs/ruler_tiny_a \
        --steps=3000 --seed=2 --workdir=runs/ruler_tiny --tasks=niah_single --lengths=384,512 \
        --value_digits=4
    python eval.py --checkpoint=runs/ruler_tiny --workdir=runs/ruler_tiny/ruler \
        --ruler_tasks=niah_single --ruler_lengths=512,1K --ruler_depths=0,0.5,1 \
        --ruler_samples=8 --ruler_value_digits=4 --batch_size=8 --piece_len=512

``python -m kimi_k3.ruler train`` draws fresh examples every step (instructions, a haystack
with one needle, the question, then the answer and a newline) and trains on the answers only,
as the passkey and MQAR tasks train; it saves a run folder that eval.py reads. The second
command goes on from the first's weights with a fresh schedule (a fresh optimizer too): the
first digits of the answer are learned early, the last ones late. Chance exact match is
10^-value_digits.

The model, optimizer and trainer sections are configs/mqar.py's (two layers "KM": one KDA, one
Gated MLA, d_model 64; a high peak rate), without its task section and with the trainer's
default data.seq_len; only the step count differs. The argument is comma-separated key=value
overrides: steps, d_model, pattern (layer letters, K = KDA, M = Gated MLA).
"""

import pathlib

import ml_collections

from kimi_k3.config import add_training_defaults
from kimi_k3.config_files import load_config, parse_arg


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    over = parse_arg(arg, {"steps": int, "d_model": int, "pattern": str})
    model_arg = ",".join(f"{k}={v}" for k, v in over.items() if k != "steps")
    config = load_config(f"{pathlib.Path(__file__).with_name('mqar.py')}:{model_arg}")
    del config.mqar  # the MQAR task: kimi_k3.ruler draws its own examples
    # mqar.py ties data.seq_len to its task; here it is the trainer's default (unused by ruler)
    config.data.seq_len = add_training_defaults(ml_collections.ConfigDict()).data.seq_len
    config.train.steps = over.get("steps", 4000)  # answer-loss steps of 16 examples
    return config
