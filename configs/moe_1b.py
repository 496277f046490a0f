"""~1B-active mixture-of-experts K3-style model for the GPU (configs/1b.py with MoE FFNs).

    python train.py --config=configs/moe_1b.py --workdir=runs/moe_1b
    # 8 GPUs, experts split over them (8 per device), the rest of the state over fsdp:
    python train.py --config=configs/moe_1b.py --workdir=runs/moe_1b \\
        --config.mesh.fsdp=1 --config.mesh.expert=8

The attention stack of configs/1b.py: 20 layers ("KKKM" x 5), width 2048, KDA 16 heads x 128,
Gated MLA 16 heads (latent 512, low-rank queries 768), block Attention Residuals, bf16 compute,
remat "dots_kernels". FFN: layer 1 a dense SwiGLU of 5632; layers 2-20 a mixture of 64 experts of
width 512, 8 per token, plus 2 shared experts (fine-grained experts, as in DeepSeek-V2-Lite),
Kimi Linear's router scaling (2.446), dropless, with the load-balancing bias. About 4.4B
parameters, 1.05B of them used per token (``count_params``).
"""

import pathlib

import ml_collections

from kimi_k3.config_files import load_config


def get_config(arg: str | None = None):
    if arg:
        raise ValueError(f"configs/moe_1b.py takes no argument, got {arg!r}")
    config: ml_collections.ConfigDict = load_config(pathlib.Path(__file__).with_name("1b.py"))
    moe = config.model.moe
    moe.num_experts = 64  # routed experts
    moe.top_k = 8  # experts per token
    moe.expert_dim = 512  # each expert's SwiGLU width
    moe.num_shared = 2  # shared SwiGLU of width 1024
    moe.first_k_dense = 1  # layer 1 keeps the dense SwiGLU (model.mlp_dim = 5632)
    moe.routed_scaling_factor = 2.446  # Kimi Linear's: the renormalised weights sum to it
    # What makes 4.4B parameters fit one 80 GB card (docs/moe.md, "Memory"): the Adam moments
    # and the micro-batches' gradient sums in bf16 (the float32 master weights stay), the
    # experts' hidden activations computed again in the backward pass, and a layer keeping only
    # its matmuls' outputs for it (KDA's kernel runs again there).
    config.opt.moments_dtype = "bfloat16"
    config.train.grad_accum_dtype = "bfloat16"
    moe.remat_experts = True
    config.model.remat = "dots"
    return config
