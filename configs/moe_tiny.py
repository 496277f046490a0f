"""Tiny byte-level mixture-of-experts stack for CPU: configs/tiny.py with MoE FFNs.

    python train.py --config=configs/moe_tiny.py --workdir=runs/moe_tiny

4 layers "KKKM", width 128, vocabulary 256 (bytes); the first layer keeps a dense SwiGLU of 384,
the other three route each token to 2 of 8 experts of width 128 (sigmoid router, renormalised
weights, the load-balancing bias) plus one shared expert of width 128. Dropless.
"""

import pathlib

import ml_collections

from kimi_k3.config_files import load_config


def get_config(arg: str | None = None):
    if arg:
        raise ValueError(f"configs/moe_tiny.py takes no argument, got {arg!r}")
    config: ml_collections.ConfigDict = load_config(pathlib.Path(__file__).with_name("tiny.py"))
    moe = config.model.moe
    moe.num_experts = 8  # routed experts
    moe.top_k = 2  # experts per token
    moe.expert_dim = 128  # each expert's SwiGLU width
    moe.num_shared = 1  # one shared expert of width 128
    moe.first_k_dense = 1  # layer 1 keeps the dense SwiGLU (model.mlp_dim = 384)
    moe.bias_update_rate = 1e-3  # per step
    return config
