"""KDA written from the equations in float64 NumPy, with no project code: the tests' ground truth.

Per token t, per value head: S <- Diag(exp g_t) S; S <- S + beta_t k_t (v_t - S^T k_t)^T;
o_t = S^T (scale q_t). A new segment id restarts S from zero.
"""

from __future__ import annotations

import numpy as np


def kda_numpy(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None):
    """q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K]; beta [B,T,HV] -> (o [B,T,HV,V], S [B,HV,K,V])."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    rep = HV // H
    if scale is None:
        scale = K**-0.5
    S = np.zeros((B, HV, K, V)) if initial_state is None else np.array(initial_state, np.float64)
    o = np.zeros((B, T, HV, V))
    for b in range(B):
        for t in range(T):
            if segment_ids is not None and t > 0 and segment_ids[b, t] != segment_ids[b, t - 1]:
                S[b] = 0.0
            for h in range(HV):
                qh, kh = q[b, t, h // rep] * scale, k[b, t, h // rep]
                S[b, h] = np.exp(g[b, t, h])[:, None] * S[b, h]
                delta = v[b, t, h] - S[b, h].T @ kh
                S[b, h] = S[b, h] + beta[b, t, h] * np.outer(kh, delta)
                o[b, t, h] = S[b, h].T @ qh
    return o, S


def rel_err(x, ref) -> float:
    """||x - ref|| / ||ref|| in float64."""
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))
