"""KDA decay gates: from gate logits f to the per-channel log-decay g <= 0.

Two parametrisations, per value head h and channel d:

    softplus (Kimi Linear):  g = -exp(A_log[h]) * softplus(f + dt_bias[h, d])          (unbounded)
    bounded (K3):            g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h, d]))
                             so lower_bound < g < 0 on every token (lower_bound = -5 in K3)

The bounded form is what lets the Pallas kernel factor intra-chunk decays into tensor-core
matmuls; pass the same ``lower_bound`` on to ``kda(..., lower_bound=...)``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def kda_gate(
    f_BxTxHVxK: jax.Array,
    A_log_HV: jax.Array,
    dt_bias_HVxK: jax.Array,
    lower_bound: float | None = None,
) -> jax.Array:
    """Per-channel log-decay g [B, T, HV, K] in float32 from gate logits f [B, T, HV, K].

    A_log: [HV]; dt_bias: [HV, K] (or flat [HV * K]). ``lower_bound=None`` selects the softplus
    form, a negative float the bounded form.
    """
    if f_BxTxHVxK.ndim != 4:
        raise ValueError(f"kda_gate: f must be [B, T, HV, K], got shape {f_BxTxHVxK.shape}")
    HV, K = f_BxTxHVxK.shape[2:]
    if A_log_HV.shape != (HV,):
        raise ValueError(f"kda_gate: A_log must have shape ({HV},), got {A_log_HV.shape}")
    if dt_bias_HVxK.shape == (HV * K,):
        dt_bias_HVxK = dt_bias_HVxK.reshape(HV, K)
    if dt_bias_HVxK.shape != (HV, K):
        raise ValueError(
            f"kda_gate: dt_bias must have shape ({HV}, {K}) or ({HV * K},), got {dt_bias_HVxK.shape}"
        )
    if lower_bound is not None and not (isinstance(lower_bound, int | float) and lower_bound < 0):
        raise ValueError(
            f"kda_gate: lower_bound must be None (softplus form) or a negative number, "
            f"got {lower_bound!r}"
        )
    f = f_BxTxHVxK.astype(jnp.float32) + dt_bias_HVxK.astype(jnp.float32)
    A = jnp.exp(A_log_HV.astype(jnp.float32))[:, None]
    if lower_bound is None:
        return -A * jax.nn.softplus(f)
    return lower_bound * jax.nn.sigmoid(A * f)


def init_dt_bias(key: jax.Array, shape, dt_min: float = 1e-3, dt_max: float = 1e-1) -> jax.Array:
    """dt_bias = softplus^-1(dt) with dt log-uniform in [dt_min, dt_max] (Mamba-style init)."""
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    # softplus^-1(y) = y + log(-expm1(-y)), stable for small y.
    return dt + jnp.log(-jnp.expm1(-dt))


def inverse_softplus(y: np.ndarray) -> np.ndarray:
    """softplus^-1 in NumPy, for tests and init checks."""
    y = np.asarray(y, np.float64)
    return y + np.log(-np.expm1(-y))
