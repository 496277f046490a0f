r"""Multi-query associative recall (MQAR, kimi_k3/mqar.py): a tiny hybrid model and its task.

    python benchmarks/mqar_sweep.py --config=configs/mqar.py
    python benchmarks/mqar_sweep.py --config=configs/mqar.py:pattern=KKKM,seq_len=256 \
        --patterns=KKKK,KKKM,MMMM --seq_lens=64,128,256

The argument is comma-separated key=value overrides: pattern (layer letters, K = KDA,
M = Gated MLA; its length sets num_layers), seq_len, kv (key-value pairs; 0 = seq_len // 4),
steps, d_model, kda_head_dim. Default: 2 layers "KM" (one KDA, one MLA), d_model 64, 2 heads
of 32 in both layer kinds: each KDA head holds a 32 x 32 state (about 32 keys before they
interfere), while MLA keeps every key exactly; narrower KDA heads learned too slowly to
compare at these step counts.

The trainer sections (data, opt, mesh, checkpoint, train) come from
``kimi_k3.config.add_training_defaults``; the MQAR training in ``kimi_k3.mqar.train_mqar`` uses
``opt`` and ``train.steps`` / ``seed`` from them.
"""

import ml_collections

from kimi_k3.config import add_training_defaults, default_model_config
from kimi_k3.config_files import parse_arg


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    over = parse_arg(arg, {"pattern": str, "seq_len": int, "kv": int, "steps": int, "d_model": int,
                           "kda_head_dim": int})
    config = ml_collections.ConfigDict()
    config.seed = 0

    m = config.model = default_model_config()
    m.vocab_size = 256  # covers the MQAR vocabulary below
    m.d_model = over.get("d_model", 64)  # width D
    m.pattern = over.get("pattern", "KM")  # one letter per layer
    m.num_layers = len(m.pattern)
    m.num_heads = 2  # KDA heads
    m.kda.head_dim = over.get("kda_head_dim", 32)  # K = V: each head's state is K x V
    m.kda.impl = "recurrent"  # token by token: the fastest form on a CPU at these lengths
    m.mla.num_heads = 2
    m.mla.kv_lora_rank = m.d_model // 2  # cached latent per token
    m.mla.qk_nope_head_dim = m.d_model // 2
    m.mla.shared_head_dim = 16
    m.mla.v_head_dim = m.d_model // 2
    m.mla.attn_block_size = 64  # blockwise attention block (tokens)
    m.mlp_dim = 2 * m.d_model  # SwiGLU width
    m.attn_res_block_size = 2  # sublayers per Attention-Residual block

    q = config.mqar = ml_collections.ConfigDict()
    q.seq_len = over.get("seq_len", 128)  # tokens per example
    q.num_kv_pairs = over.get("kv", 0)  # pairs per example; 0 = seq_len // kv_pairs_divisor
    q.kv_pairs_divisor = 4  # so pairs grow with length: 32 -> 8, 64 -> 16, 128 -> 32
    q.num_queries = 0  # keys asked again; 0 = all of them
    q.vocab_size = 256  # filler 0, keys 1..127, values 128..255
    q.train_batch_size = 64  # fresh examples per step
    q.eval_examples = 512  # held-out examples for the accuracy

    add_training_defaults(config)
    config.data.seq_len = q.seq_len  # unused by MQAR; kept consistent
    config.opt.lr = 1e-2  # peak learning rate (AdamW); MQAR wants a high one
    config.opt.warmup_steps = 50
    config.opt.weight_decay = 0.01
    config.opt.min_lr_ratio = 0.05
    config.train.steps = over.get("steps", 400)
    return config
