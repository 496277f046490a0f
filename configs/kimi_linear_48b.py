"""Kimi Linear 48B-A3B shapes: the published hybrid closest to K3 (shapes, counts and FLOPs).

    python configs/kimi_linear_48b.py       # prints the pattern and the total / active counts

27 layers: 20 KDA + 7 Gated MLA, the MLA layers at 4, 8, 12, 16, 20, 24 and 27 (an explicit
pattern); hidden 2304; KDA 32 heads x 128 with the softplus (unbounded) gate and width-4 short
convolutions; MLA 32 heads, no low-rank queries, kv_lora 512, head dims 128 (+64 shared) / 128,
no output gate; plain residuals (no Attention Residuals); untied output head; vocabulary
163840. FFN: layer 1 a dense SwiGLU of 9216, layers 2-27 a mixture of 256 experts of width 1024,
8 per token (sigmoid router, renormalised weights x 2.446, the load-balancing bias) plus one
shared expert. About 48B parameters, 3B of them used per token (``count_params``, with
``active=True``).
"""

import ml_collections

from kimi_k3.config import add_training_defaults, default_model_config, model_spec
from kimi_k3.model import count_params, flops_per_token


def get_config(arg: str | None = None):
    if arg:
        raise ValueError(f"configs/kimi_linear_48b.py takes no argument, got {arg!r}")
    m = default_model_config()
    m.vocab_size = 163840
    m.d_model = 2304
    m.num_layers = 27
    m.pattern = "KKKM" * 6 + "KKM"  # MLA at 4, 8, ..., 24 and 27
    m.num_heads = 32
    m.kda.head_dim = 128
    m.kda.num_v_heads = 32
    m.kda.conv_width = 4
    m.kda.gate = "softplus"
    m.mla.num_heads = 32
    m.mla.q_lora_rank = 0
    m.mla.kv_lora_rank = 512
    m.mla.qk_nope_head_dim = 128
    m.mla.shared_head_dim = 64
    m.mla.v_head_dim = 128
    m.mla.output_gate = False
    m.mlp_dim = 9216  # the dense first layer (intermediate_size)
    m.moe.num_experts = 256
    m.moe.top_k = 8
    m.moe.expert_dim = 1024  # moe_intermediate_size
    m.moe.num_shared = 1
    m.moe.renormalize = True
    m.moe.routed_scaling_factor = 2.446
    m.moe.n_group = 1
    m.moe.topk_group = 1
    m.moe.first_k_dense = 1
    m.attn_res = "none"
    m.tie_embeddings = False
    m.norm_eps = 1e-5  # rms_norm_eps
    m.dtype = "bfloat16"
    m.remat = "full"
    config = ml_collections.ConfigDict()
    config.model = m
    add_training_defaults(config)  # data, opt, mesh, checkpoint, train, seed
    config.data.seq_len = 4096
    config.mesh.data, config.mesh.fsdp, config.mesh.expert = 1, -1, 8  # 32 experts per device
    return config


if __name__ == "__main__":
    spec = model_spec(get_config().model)
    print(f"pattern: {spec.pattern}")
    print(f"parameters: {count_params(spec):,} total, {count_params(spec, active=True):,} active")
    print(f"training FLOPs per token at 4096 tokens: {flops_per_token(spec, 4096):.4g}")
