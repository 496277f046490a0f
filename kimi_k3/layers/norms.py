"""Normalisations: RMSNorm (learned scale) and the parameter-free L2 / RMS normalisers.

    RMSNorm(x) = x / sqrt(mean(x^2) + eps) * w          (over the last axis, in float32)
    l2_normalize(x) = x / sqrt(sum(x^2) + eps)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_k3.ops.reductions import column_sum
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
        return _scaled_rms_norm(x, self.scale[...], self.eps, jnp.dtype(self.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _scaled_rms_norm(x_NxD, w_D, eps: float, dtype):
    """y = x r w in ``dtype``, r = 1 / sqrt(mean(x^2) + eps) over the last axis (float32 inside).

    Its own backward pass, for the scale's gradient: dw = sum over every token of dy x r, taken
    by ``column_sum`` (as XLA derives it, the sum fuses into the slow column reductions
    described in ``kimi_k3.ops.reductions``). The input's gradient:
        dx = r (g - x r mean(g x r)),   g = dy w.
    """
    y = rms_normalize(x_NxD, eps) * w_D.astype(jnp.float32)
    return y.astype(dtype)


def _norm_fwd(x, w, eps, dtype):
    return _scaled_rms_norm(x, w, eps, dtype), (x, w)


def _norm_bwd(eps, dtype, res, dy):
    x, w = res
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    xhat = xf * r
    dyf = dy.astype(jnp.float32)
    g = dyf * w.astype(jnp.float32)
    dx = r * (g - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    dw = column_sum((dyf * xhat).reshape(-1, x.shape[-1]))
    return dx.astype(x.dtype), dw.astype(w.dtype)


_scaled_rms_norm.defvjp(_norm_fwd, _norm_bwd)
