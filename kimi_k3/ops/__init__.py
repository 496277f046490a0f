"""Sequence operators: KDA and its gates."""

from kimi_k3.ops.gates import init_dt_bias, kda_gate
from kimi_k3.ops.kda import IMPLS, kda, resolve_impl

__all__ = ["IMPLS", "init_dt_bias", "kda", "kda_gate", "resolve_impl"]
