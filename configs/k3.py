"""Kimi K3 shapes (for shapes, parameter counts and FLOPs; far too large to train here).

    python configs/k3.py          # prints the layer pattern and the parameter count (eval_shape)

93 layers: 69 KDA + 24 Gated MLA (MLA at layers 4, 8, ..., 92 and 93); hidden 7168; KDA 96 heads
x 128 with the bounded gate (g_min = -5) and width-4 short convolutions; MLA 96 heads, q_lora
1536, kv_lora 512, head dims 128 (+64 shared) / 128; block Attention Residuals in blocks of 12
layers (24 sublayers, 8 blocks).

The FFN is a mixture of experts: 896 routed experts, 16 per token, plus 2 shared experts. The
expert count is an estimate, as are the other MoE numbers, which no publication gives for K3
and come from Kimi K2 here: each expert's width 2048 (K2's moe_intermediate_size), a dense
first layer of width 18432 (K2's first_k_dense_replace = 1, intermediate_size 18432), routed
weights renormalised and scaled by 2.827 (K2's routed_scaling_factor), no expert groups. So the
parameter count (``python configs/k3.py``: total and active) is an estimate too. The vocabulary
(163840) is Kimi K2's.
"""

import ml_collections

from kimi_k3.config import add_training_defaults, default_model_config, model_spec
from kimi_k3.model import count_params, flops_per_token


def get_config(arg: str | None = None):
    if arg:
        raise ValueError(f"configs/k3.py takes no argument, got {arg!r}")
    m = default_model_config()
    m.vocab_size = 163840
    m.d_model = 7168
    m.num_layers = 93
    m.kda_per_mla = 3
    m.final_mla = True
    m.num_heads = 96
    m.kda.head_dim = 128
    m.kda.num_v_heads = 96
    m.kda.conv_width = 4
    m.kda.gate = "bounded"
    m.kda.gate_lower_bound = -5.0
    m.mla.num_heads = 96
    m.mla.q_lora_rank = 1536
    m.mla.kv_lora_rank = 512
    m.mla.qk_nope_head_dim = 128
    m.mla.shared_head_dim = 64
    m.mla.v_head_dim = 128
    m.mla.output_gate = True
    m.mlp_dim = 18432  # the dense first layer
    m.moe.num_experts = 896  # an estimate (module docstring)
    m.moe.top_k = 16
    m.moe.num_shared = 2
    m.moe.expert_dim = 2048  # Kimi K2's
    m.moe.routed_scaling_factor = 2.827  # Kimi K2's
    m.moe.first_k_dense = 1
    m.attn_res = "block"
    m.attn_res_block_size = 24  # sublayers = 12 layers
    m.tie_embeddings = False
    m.dtype = "bfloat16"
    m.remat = "full"
    config = ml_collections.ConfigDict()
    config.model = m
    add_training_defaults(config)  # data, opt, mesh, checkpoint, train, seed
    config.data.seq_len = 8192
    config.mesh.data, config.mesh.fsdp, config.mesh.expert, config.mesh.tensor = 1, -1, 8, 8
    return config


if __name__ == "__main__":
    spec = model_spec(get_config().model)
    pattern = spec.pattern
    print(f"pattern: {pattern}")
    print(f"KDA layers: {pattern.count('K')}, MLA layers: {pattern.count('M')}")
    print(f"parameters: {count_params(spec):,} total, {count_params(spec, active=True):,} active")
    print(f"training FLOPs per token at 8192 tokens: {flops_per_token(spec, 8192):.4g}")
