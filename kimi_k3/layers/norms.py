"""Normalisations: RMSNorm (learned scale) and the parameter-free L2 / RMS normalisers.

    RMSNorm(x) = x / sqrt(mean(x^2) + eps) * w          (over the last axis, in float32)
    l2_normalize(x) = x / sqrt(sum(x^2) + eps)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_k3.sharding import param


def rms_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / rms(x) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / ||x|| over the last axis, in float32 (KDA's q and k, per head)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis with a learned scale w (init 1); output in ``dtype``.

    ``name`` is the logical axis of the normalised dimension: "norm" for the model width,
    "kv" for a per-head norm (one scale shared by all heads), "kv_lora" / "q_lora" for MLA.
    """

    def __init__(self, dim: int, *, name: str = "norm", eps: float = 1e-6, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        self.scale = param(jnp.ones((dim,), param_dtype), (name,))
        self.eps = eps
        self.dtype = dtype

    @jax.named_scope("norm")
    def __call__(self, x: jax.Array) -> jax.Array:
        y = rms_normalize(x, self.eps) * self.scale[...].astype(jnp.float32)
        return y.astype(self.dtype)
