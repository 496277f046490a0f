"""Tiny byte-level K3-style stack for CPU: seconds per step, the README's default.

    python train.py --config=configs/tiny.py --workdir=runs/tiny

4 layers "KKKM" (3 KDA + 1 Gated MLA), width 128, 4 heads of 32, vocabulary 256 (bytes), block
Attention Residuals over blocks of 2 layers, float32.
"""

import ml_collections

from kimi_k3.config import add_training_defaults, default_model_config


def get_config(arg: str | None = None):
    if arg:
        raise ValueError(f"configs/tiny.py takes no argument, got {arg!r}")
    config = ml_collections.ConfigDict()
    config.model = default_model_config()  # the defaults are the tiny model
    # On CPU the token-by-token KDA recurrence is the fast path at this size: the chunked "xla"
    # form's pairwise decays cost far more than the short recurrence here.
    config.model.kda.impl = "recurrent"
    add_training_defaults(config)  # data, opt, mesh, checkpoint, train, seed
    config.data.seq_len = 128  # tokens per row (bytes of the stdlib corpus)
    config.data.global_batch_size = 8  # rows per step
    config.opt.lr = 3e-3
    config.opt.warmup_steps = 20
    config.train.steps = 200
    config.train.eval_every = 100
    config.checkpoint.every_steps = 100
    return config
