"""KDA in chunks of C tokens (the WY form), in plain JAX.

Inside a chunk, rows r = 1..C, all per value head and in float32:

    G_r = sum_{i<=r} g_i                       (per channel),  Gamma = exp(G)
    L[i, j] = beta_i sum_d k_id k_jd exp(G_id - G_jd)          j < i, else 0
    (I + L) [W | U] = Diag(beta) [Gamma * K | V]               (unit lower-triangular solve)
    P[i, j] = sum_d (scale q_id) k_jd exp(G_id - G_jd)         j <= i, else 0
    V' = U - W S
    O  = (scale Q * Gamma) S + P V'
    S <- Diag(Gamma_C) S + (K * exp(G_C - G))^T V'

Packed documents: a pair (i, j) only interacts inside one segment, and the state entering the
chunk is seen only by rows still in the segment it belongs to (``a`` below); both are masks, so
the algebra above is unchanged.

The pairwise decay exp(G_i - G_j) is formed only for j <= i, where it is <= 1: it never
overflows, however negative the gates. It costs C*C*K per chunk, so the chunks run one after
another under ``lax.scan`` with a rematerialised body: memory stays O(T (K + V)) for the
forward and the backward pass. This is the readable fast-enough path; the Pallas kernel is the
fast one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST


def _chunk_step(S_BxHxKxV, seg_prev_B, chunk):
    """One chunk of C tokens. Shapes: q/k/g [B, H, C, K], v [B, H, C, V], beta [B, H, C]."""
    q, k, v, g, beta, seg_BxC = chunk
    C = q.shape[2]
    G = jnp.cumsum(g, axis=2)  # [B, H, C, K]

    ii = jnp.arange(C)[:, None]
    jj = jnp.arange(C)[None, :]
    same_BxCxC = seg_BxC[:, :, None] == seg_BxC[:, None, :]
    lower_eq = (jj <= ii)[None] & same_BxCxC  # j <= i, same document
    lower = (jj < ii)[None] & same_BxCxC  # j < i, same document
    a_BxC = seg_BxC == seg_prev_B[:, None]  # row still in the incoming state's document

    # exp(G_i - G_j) for j <= i only; elsewhere the exponent is replaced before exp so that
    # neither the value nor its gradient can overflow.
    diff = G[:, :, :, None, :] - G[:, :, None, :, :]  # [B, H, C(i), C(j), K]
    m = lower_eq[:, None, :, :, None]
    decay = jnp.where(m, jnp.exp(jnp.where(m, diff, 0.0)), 0.0)

    kk = jnp.einsum("bhid,bhjd,bhijd->bhij", k, k, decay, precision=_HI)
    L = jnp.where(lower[:, None], kk, 0.0) * beta[..., None]
    P = jnp.einsum("bhid,bhjd,bhijd->bhij", q, k, decay, precision=_HI)  # masked by decay

    a = a_BxC[:, None, :, None].astype(q.dtype)
    Gamma_a = jnp.exp(G) * a  # [B, H, C, K]
    K_dim = k.shape[-1]
    rhs = beta[..., None] * jnp.concatenate([Gamma_a * k, v], axis=-1)
    eye = jnp.eye(C, dtype=q.dtype)
    WU = lax.linalg.triangular_solve(
        eye + L, rhs, left_side=True, lower=True, unit_diagonal=True
    )
    W, U = WU[..., :K_dim], WU[..., K_dim:]

    Vp = U - jnp.einsum("bhck,bhkv->bhcv", W, S_BxHxKxV, precision=_HI)
    O = jnp.einsum("bhck,bhkv->bhcv", q * Gamma_a, S_BxHxKxV, precision=_HI)
    O = O + jnp.einsum("bhij,bhjv->bhiv", P, Vp, precision=_HI)

    G_last = G[:, :, -1:, :]  # [B, H, 1, K]
    keep_last = (same_BxCxC[:, -1, :])[:, None, :, None]  # tokens in the last row's document
    k_to_end = jnp.where(keep_last, k * jnp.exp(G_last - G), 0.0)
    S_new = jnp.exp(G_last[:, :, 0, :])[..., None] * S_BxHxKxV
    S_new = jnp.where(a_BxC[:, -1][:, None, None, None], S_new, 0.0)
    S_new = S_new + jnp.einsum("bhck,bhcv->bhkv", k_to_end, Vp, precision=_HI)
    return S_new, seg_BxC[:, -1], O


def kda_chunked(
    q_BxTxHxK: jax.Array,
    k_BxTxHxK: jax.Array,
    v_BxTxHVxV: jax.Array,
    g_BxTxHVxK: jax.Array,
    beta_BxTxHV: jax.Array,
    *,
    scale: float,
    initial_state_BxHVxKxV: jax.Array | None,
    segment_ids_BxT: jax.Array | None,
    chunk_size: int,
) -> tuple[jax.Array, jax.Array]:
    """Chunked KDA for any T. Inputs are already validated.

    Returns (o [B, T, HV, V] float32, final state [B, HV, K, V] float32).
    """
    B, T, H, K = q_BxTxHxK.shape
    HV, V = v_BxTxHVxV.shape[2:]
    G = HV // H
    f32 = jnp.float32
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T

    def prep(x, heads_axis_repeat=1):
        x = x.astype(f32)
        if heads_axis_repeat > 1:
            x = jnp.repeat(x, heads_axis_repeat, axis=2)
        # Padded tokens have g = 0, beta = 0, k = v = q = 0: they leave the state untouched.
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        # [B, N*C, HV, ...] -> [N, B, HV, C, ...]
        x = x.reshape((B, N, C) + x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    q = prep(q_BxTxHxK, G) * scale
    k = prep(k_BxTxHxK, G)
    v = prep(v_BxTxHVxV)
    g = prep(g_BxTxHVxK)
    beta = prep(beta_BxTxHV)

    if segment_ids_BxT is None:
        seg_BxT = jnp.zeros((B, T), jnp.int32)
    else:
        seg_BxT = segment_ids_BxT.astype(jnp.int32)
    # Padding continues the row's last document, so it never resets the state.
    seg_BxT = jnp.pad(seg_BxT, [(0, 0), (0, pad)], mode="edge")
    seg = jnp.moveaxis(seg_BxT.reshape(B, N, C), 1, 0)  # [N, B, C]

    S0 = (
        jnp.zeros((B, HV, K, V), f32)
        if initial_state_BxHVxKxV is None
        else initial_state_BxHVxKxV.astype(f32)
    )

    @jax.checkpoint
    def body(carry, chunk):
        S, seg_prev = carry
        S, seg_prev, O = _chunk_step(S, seg_prev, chunk)
        return (S, seg_prev), O

    # The initial state belongs to the row's first document.
    (S_T, _), O_NxBxHVxCxV = lax.scan(body, (S0, seg_BxT[:, 0]), (q, k, v, g, beta, seg))
    o = jnp.moveaxis(O_NxBxHVxCxV, 0, 1)  # [B, N, HV, C, V]
    o = jnp.moveaxis(o, 2, 3).reshape(B, N * C, HV, V)[:, :T]
    return o, S_T
