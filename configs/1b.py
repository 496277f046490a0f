"""~1B-parameter K3-style model for the GPU.

    python train.py --config=configs/1b.py --workdir=runs/1b

20 layers ("KKKM" x 5), width 2048, KDA 16 heads x 128, Gated MLA 16 heads (latent 512, low-rank
queries 768, head dims 128 + 64 shared / 128), SwiGLU 5632, block Attention Residuals (blocks of
5 layers), bf16 compute, matmul and kernel outputs kept for the backward pass (remat
"dots_kernels"), the layers unrolled, the global batch of 64 rows in micro-batches sized to
the device.
"""

import ml_collections

from kimi_k3.config import add_training_defaults, default_model_config


def get_config(arg: str | None = None):
    if arg:
        raise ValueError(f"configs/1b.py takes no argument, got {arg!r}")
    m = default_model_config()
    m.vocab_size = 32768
    m.d_model = 2048
    m.num_layers = 20
    m.num_heads = 16
    m.kda.head_dim = 128
    m.mla.num_heads = 16
    m.mla.q_lora_rank = 768
    m.mla.kv_lora_rank = 512
    m.mla.qk_nope_head_dim = 128
    m.mla.shared_head_dim = 64
    m.mla.v_head_dim = 128
    m.mlp_dim = 5632
    m.attn_res_block_size = 10  # sublayers = 5 layers
    m.dtype = "bfloat16"
    # Keep matmul and kernel outputs for the backward pass, recompute the elementwise work;
    # the global batch of 64 x 4096 runs as micro-batches sized to the device
    # (train.microbatch_size = 0, the default).
    m.remat = "dots_kernels"
    # Unrolled rather than scanned: without the scan's stacked carries and residuals the step
    # is faster (BENCHMARKS.md's training-step table), at the cost of a compile several times
    # longer.
    m.scan_layers = False
    config = ml_collections.ConfigDict()
    config.model = m
    add_training_defaults(config)  # data, opt, mesh, checkpoint, train, seed
    config.data.seq_len = 4096
    config.data.global_batch_size = 64  # 262k tokens per step
    config.opt.lr = 3e-4
    config.opt.warmup_steps = 1000
    config.train.steps = 20000
    config.train.log_every = 20
    config.train.eval_every = 1000
    config.checkpoint.every_steps = 1000
    config.mesh.data, config.mesh.fsdp = 1, -1  # parameters sharded over every GPU
    return config
