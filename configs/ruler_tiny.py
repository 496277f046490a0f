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

The model is configs/mqar.py's (two layers "KM": one KDA, one Gated MLA, d_model 64). The
argument is comma-separated key=value overrides: steps, d_model, pattern (layer letters,
K = KDA, M = Gated MLA).
"""

import ml_collections

from kimi_k3.config import add_training_defaults, default_model_config
from kimi_k3.config_files import parse_arg


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    over = parse_arg(arg, {"steps": int, "d_model": int, "pattern": str})
    config = ml_collections.ConfigDict()
    m = config.model = default_model_config()
    m.vocab_size = 256  # bytes
    m.d_model = over.get("d_model", 64)  # width D
    m.pattern = over.get("pattern", "KM")  # one letter per layer
    m.num_layers = len(m.pattern)
    m.num_heads = 2  # KDA heads
    m.kda.head_dim = 32  # K = V
    m.kda.impl = "recurrent"  # token by token: the fastest form on a CPU at this size
    m.mla.num_heads = 2
    m.mla.kv_lora_rank = m.d_model // 2
    m.mla.qk_nope_head_dim = m.d_model // 2
    m.mla.shared_head_dim = 16
    m.mla.v_head_dim = m.d_model // 2
    m.mla.attn_block_size = 64  # blockwise attention block (tokens)
    m.mlp_dim = 2 * m.d_model  # SwiGLU width
    m.attn_res_block_size = 2  # sublayers per Attention-Residual block

    add_training_defaults(config)
    config.opt.lr = 1e-2  # a high peak rate, as MQAR's (configs/mqar.py)
    config.opt.warmup_steps = 50
    config.opt.weight_decay = 0.01
    config.opt.min_lr_ratio = 0.05
    config.train.steps = over.get("steps", 4000)  # answer-loss steps of 16 examples
    return config
