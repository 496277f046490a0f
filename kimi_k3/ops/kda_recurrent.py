"""KDA, token by token: the definition every faster form is held to.

For each token t of a row, per value head, with the state S of shape [K, V] (float32):

    S <- Diag(exp g_t) S                                  fade (row d scaled by exp g_t[d])
    S <- S + beta_t k_t (v_t - S^T k_t)^T                 delta rule: erase, then write
    o_t = S^T (scale q_t)                                 read, after the write

Closed form: S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T, alpha = exp(g).
At the first token of a new segment (packed documents) S restarts from zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST


def segment_starts(segment_ids_BxT: jax.Array | None, B: int, T: int) -> jax.Array:
    """bool [B, T]: True where a token starts a new segment after token 0 of its row."""
    if segment_ids_BxT is None:
        return jnp.zeros((B, T), bool)
    prev = jnp.concatenate([segment_ids_BxT[:, :1], segment_ids_BxT[:, :-1]], axis=1)
    return segment_ids_BxT != prev


def kda_recurrent(
    q_BxTxHxK: jax.Array,
    k_BxTxHxK: jax.Array,
    v_BxTxHVxV: jax.Array,
    g_BxTxHVxK: jax.Array,
    beta_BxTxHV: jax.Array,
    *,
    scale: float,
    initial_state_BxHVxKxV: jax.Array | None,
    segment_ids_BxT: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """The recurrence with ``lax.scan`` over time. Inputs are already validated.

    Returns (o [B, T, HV, V] float32, final state [B, HV, K, V] float32).
    """
    B, T, H, K = q_BxTxHxK.shape
    HV, V = v_BxTxHVxV.shape[2:]
    G = HV // H  # value heads per q/k head
    f32 = jnp.float32
    # q/k head h serves value heads h*G ... h*G+G-1.
    q = jnp.repeat(q_BxTxHxK.astype(f32), G, axis=2) * scale
    k = jnp.repeat(k_BxTxHxK.astype(f32), G, axis=2)
    v = v_BxTxHVxV.astype(f32)
    g = g_BxTxHVxK.astype(f32)
    beta = beta_BxTxHV.astype(f32)
    reset_BxT = segment_starts(segment_ids_BxT, B, T)
    S0 = (
        jnp.zeros((B, HV, K, V), f32)
        if initial_state_BxHVxKxV is None
        else initial_state_BxHVxKxV.astype(f32)
    )

    def step(S_BxHVxKxV, xs):
        q_t, k_t, v_t, g_t, b_t, reset_t = xs
        S = jnp.where(reset_t[:, None, None, None], 0.0, S_BxHVxKxV)
        S = jnp.exp(g_t)[..., None] * S
        pred_BxHVxV = jnp.einsum("bhkv,bhk->bhv", S, k_t, precision=_HI)
        S = S + jnp.einsum("bhk,bhv->bhkv", k_t, b_t[..., None] * (v_t - pred_BxHVxV), precision=_HI)
        o_t = jnp.einsum("bhkv,bhk->bhv", S, q_t, precision=_HI)
        return S, o_t

    time_major = lambda x: jnp.moveaxis(x, 1, 0)
    xs = tuple(map(time_major, (q, k, v, g, beta, reset_BxT)))
    S_T, o_TxBxHVxV = lax.scan(step, S0, xs)
    return jnp.moveaxis(o_TxBxHVxV, 0, 1), S_T


def kda_step(
    q_BxHxK: jax.Array,
    k_BxHxK: jax.Array,
    v_BxHVxV: jax.Array,
    g_BxHVxK: jax.Array,
    beta_BxHV: jax.Array,
    state_BxHVxKxV: jax.Array,
    *,
    scale: float,
) -> tuple[jax.Array, jax.Array]:
    """One token of the recurrence (a decoding step): (o [B, HV, V] float32, the new state
    [B, HV, K, V] float32), the same numbers as ``kda_recurrent`` on a sequence of one token.

    Written so that the state is read in one pass and written in one, with no matrix product
    (a product would run in the matrix units' reduced precision on a GPU): with the faded state
    A = Diag(exp g) S and u = beta (v - A^T k),

        S' = A + k u^T,      o = S'^T (scale q) = A^T (scale q) + (k . scale q) u

    so both reads of the state (A^T k and A^T q) come from one pass over it, and the write of
    S' is one elementwise pass. Inputs are validated by the caller (the KDA layer's step).
    """
    H, HV = q_BxHxK.shape[1], v_BxHVxV.shape[1]
    G = HV // H  # value heads per q/k head
    f32 = jnp.float32
    q = jnp.repeat(q_BxHxK.astype(f32), G, axis=1) * scale
    k = jnp.repeat(k_BxHxK.astype(f32), G, axis=1)
    faded = jnp.exp(g_BxHVxK.astype(f32))[..., None] * state_BxHVxKxV.astype(f32)
    pred_BxHVxV = jnp.sum(faded * k[..., None], axis=2)
    read_BxHVxV = jnp.sum(faded * q[..., None], axis=2)
    u_BxHVxV = beta_BxHV.astype(f32)[..., None] * (v_BxHVxV.astype(f32) - pred_BxHVxV)
    state = faded + k[..., None] * u_BxHVxV[:, :, None, :]
    o = read_BxHVxV + jnp.sum(k * q, axis=-1, keepdims=True) * u_BxHVxV
    return o, state
