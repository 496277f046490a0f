"""~150M-parameter K3-style model for one GPU.

    python train.py --config=configs/small.py --workdir=runs/small

12 layers "KKKM" x 3, width 768, KDA 12 heads x 64, Gated MLA 12 heads (latent 256, low-rank
queries 384), SwiGLU 3072, block Attention Residuals (blocks of 3 layers), bf16 compute, full
rematerialisation.
"""

import ml_collections

from kimi_k3.config import add_training_defaults, default_model_config


def get_config(arg: str | None = None):
    if arg:
        raise ValueError(f"configs/small.py takes no argument, got {arg!r}")
    m = default_model_config()
    m.vocab_size = 32768
    m.d_model = 768
    m.num_layers = 12
    m.num_heads = 12
    m.kda.head_dim = 64
    m.mla.num_heads = 12
    m.mla.q_lora_rank = 384
    m.mla.kv_lora_rank = 256
    m.mla.qk_nope_head_dim = 64
    m.mla.shared_head_dim = 32
    m.mla.v_head_dim = 64
    m.mlp_dim = 3072
    m.attn_res_block_size = 6  # sublayers = 3 layers
    m.dtype = "bfloat16"
    # Without rematerialisation every KDA layer keeps its intra-chunk activations per token,
    # and 32 rows of 2048 no longer fit one GPU; full remat trades recompute for that memory
    # (BENCHMARKS.md's training-step table).
    m.remat = "full"
    config = ml_collections.ConfigDict()
    config.model = m
    add_training_defaults(config)  # data, opt, mesh, checkpoint, train, seed
    config.data.seq_len = 2048
    config.data.global_batch_size = 32  # 64k tokens per step
    config.opt.lr = 1e-3
    config.opt.warmup_steps = 200
    config.train.steps = 5000
    config.train.log_every = 20
    config.train.eval_every = 500
    config.checkpoint.every_steps = 500
    return config
