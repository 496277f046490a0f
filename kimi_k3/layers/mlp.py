"""SwiGLU MLP.

    MLP(x) = W_o ( SiLU(x W_gate) * (x W_up) )      W_gate, W_up [D, F] (fused as [D, 2, F]),
                                                    W_o [F, D]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_k3.layers.dense import Dense
from kimi_k3.sharding import BTF, constrain


class SwiGLU(nnx.Module):
    """x [B, T, D] -> [B, T, D]."""

    def __init__(self, d_model: int, mlp_dim: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        # One matmul for both input projections; axis 1 is (gate, up).
        self.wi = Dense(d_model, (2, mlp_dim), names=("embed", None, "mlp"), **kw)
        self.wo = Dense(mlp_dim, d_model, names=("mlp", "embed"), **kw)

    @jax.named_scope("mlp")
    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        h_BxTx2xF = self.wi(x_BxTxD)
        gate_BxTxF, up_BxTxF = h_BxTx2xF[..., 0, :], h_BxTx2xF[..., 1, :]
        h_BxTxF = constrain(jax.nn.silu(gate_BxTxF) * up_BxTxF, BTF)
        return self.wo(h_BxTxF)
