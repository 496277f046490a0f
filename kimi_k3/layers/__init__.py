"""Layers of the hybrid stack, one file per layer type."""

from kimi_k3.layers.attention import attention, reference_attention
from kimi_k3.layers.attn_res import DepthQuery, DepthResidual
from kimi_k3.layers.dense import Dense
from kimi_k3.layers.embed import Embed, OutputHead
from kimi_k3.layers.kda_layer import KDALayer
from kimi_k3.layers.mla import GatedMLA
from kimi_k3.layers.mlp import SwiGLU
from kimi_k3.layers.moe import MoE
from kimi_k3.layers.norms import RMSNorm, l2_normalize, rms_normalize
from kimi_k3.layers.short_conv import ShortConv

__all__ = [
    "Dense", "DepthQuery", "DepthResidual", "Embed", "GatedMLA", "KDALayer", "MoE", "OutputHead",
    "RMSNorm", "SwiGLU", "ShortConv", "attention", "l2_normalize", "reference_attention",
    "rms_normalize",
]
