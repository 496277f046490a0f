"""Sequence operators: KDA and its gates."""

from kimi_k3.ops.gates import init_dt_bias, kda_gate
from kimi_k3.ops.kda import kda

__all__ = ["init_dt_bias", "kda", "kda_gate"]
