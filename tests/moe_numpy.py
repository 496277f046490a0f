"""Float64 NumPy ground truth for the mixture-of-experts FFN, written from its definition
(notes: Kimi Linear's router as transformers implements it), with a hand-written backward pass.

    s = sigmoid(x W_r);  c = s + b;  grouped: each of G groups scored by the sum of its two
    largest c, the topk_group best kept, the other experts' c = -inf;  chosen = the k largest c
    (ties: the lower index);  w = s[chosen], / (sum + 1e-20) if renormalised, * scale
    y = sum_j w_j SwiGLU_{chosen_j}(x) + SwiGLU_shared(x),  SwiGLU(x) = (silu(x Wg) * (x Wu)) Wo
    LatentMoE (weights Wd [D, l], Wl [l, D]): the routed sum taken on x Wd, then times Wl;
    the router and the shared expert still read x
"""

from __future__ import annotations

import numpy as np


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def route(x, Wr, b, *, k, n_group=1, topk_group=1, renormalize=True, scale=1.0):
    """(s [N, E], chosen [N, k], raw weights s[chosen] [N, k], weights [N, k])."""
    N = x.shape[0]
    s = sigmoid(x @ Wr)
    c = s + b
    E = c.shape[1]
    if n_group > 1:
        per = E // n_group
        groups = c.reshape(N, n_group, per)
        top2 = -np.sort(-groups, axis=-1)[:, :, :2]
        group_score = top2.sum(-1)
        best = np.argsort(-group_score, axis=-1, kind="stable")[:, :topk_group]
        keep = np.zeros((N, n_group), bool)
        keep[np.arange(N)[:, None], best] = True
        c = np.where(np.repeat(keep, per, axis=1), c, -np.inf)
    chosen = np.argsort(-c, axis=-1, kind="stable")[:, :k]
    raw = np.take_along_axis(s, chosen, axis=1)
    w = raw / (raw.sum(-1, keepdims=True) + 1e-20) if renormalize else raw
    return s, chosen, raw, w * scale


def capacity_keep(chosen, num_experts, capacity):
    """[N, k] True where an assignment fits its expert's capacity: assignments queue slot by
    slot (every token's first choice in token order, then every second choice, ...)."""
    N, k = chosen.shape
    keep = np.zeros((N, k), bool)
    taken = np.zeros(num_experts, int)
    for j in range(k):
        for t in range(N):
            e = chosen[t, j]
            keep[t, j] = taken[e] < capacity
            taken[e] += 1
    return keep


def _swiglu(x, wi, wo):
    """wi [D, 2, F], wo [F, D]: output and what the backward pass needs."""
    a, u = x @ wi[:, 0], x @ wi[:, 1]
    sg = sigmoid(a)
    h = a * sg * u
    return h @ wo, (a, u, sg, h)


def _swiglu_backward(x, wi, wo, cache, do):
    """(dx, dwi, dwo) for output cotangent do."""
    a, u, sg, h = cache
    dh = do @ wo.T
    da = dh * u * sg * (1 + a * (1 - sg))
    du = dh * a * sg
    dwi = np.stack([x.T @ da, x.T @ du], axis=1)
    return da @ wi[:, 0].T + du @ wi[:, 1].T, dwi, h.T @ do


def moe(x, p, R, *, k, n_group=1, topk_group=1, renormalize=True, scale=1.0, keep=None):
    """(y [N, D], grads of sum(y * R) w.r.t. x and every weight in ``p``, chosen [N, k]).

    p: Wr [D, E], b [E], wi [E, D, 2, F], wo [E, F, D], and optionally shared_wi [D, 2, Fs],
    shared_wo [Fs, D]; with LatentMoE's Wd [D, l] and Wl [l, D], wi [E, l, 2, F] and wo
    [E, F, l]. ``keep`` [N, k]: assignments that are computed (capacity); the others contribute
    nothing.
    """
    x = np.asarray(x, np.float64)
    p = {name: np.asarray(v, np.float64) for name, v in p.items()}
    R = np.asarray(R, np.float64)
    N, E = x.shape[0], p["Wr"].shape[1]
    s, chosen, raw, w = route(x, p["Wr"], p["b"], k=k, n_group=n_group, topk_group=topk_group,
                              renormalize=renormalize, scale=scale)
    keep = np.ones_like(chosen, bool) if keep is None else keep
    latent = "Wd" in p
    # The experts' input, and the cotangent of their weighted sum: in the latent width l when
    # LatentMoE wraps them (ye = sum_j w_j SwiGLU_j(xe), y = ye Wl), else x's own.
    xe = x @ p["Wd"] if latent else x
    Re = R @ p["Wl"].T if latent else R
    ye = np.zeros_like(xe)
    g = {name: np.zeros_like(v) for name, v in p.items()}
    gxe = np.zeros_like(xe)
    dw = np.zeros_like(w)
    for e in range(E):
        t, j = np.nonzero((chosen == e) & keep)
        if not len(t):
            continue
        o, cache = _swiglu(xe[t], p["wi"][e], p["wo"][e])
        ye[t] += w[t, j, None] * o
        dw[t, j] = (o * Re[t]).sum(-1)
        dxe, dwi, dwo = _swiglu_backward(xe[t], p["wi"][e], p["wo"][e], cache,
                                         w[t, j, None] * Re[t])
        np.add.at(gxe, t, dxe)
        g["wi"][e] += dwi
        g["wo"][e] += dwo
    if latent:
        y, gx = ye @ p["Wl"], gxe @ p["Wd"].T
        g["Wl"], g["Wd"] = ye.T @ R, x.T @ gxe
    else:
        y, gx = ye, gxe
    if "shared_wi" in p:
        o, cache = _swiglu(x, p["shared_wi"], p["shared_wo"])
        y += o
        dxs, g["shared_wi"], g["shared_wo"] = _swiglu_backward(x, p["shared_wi"], p["shared_wo"],
                                                               cache, R)
        gx += dxs
    # Through the weights to the router: w = scale * raw / S (renormalised) or scale * raw.
    if renormalize:
        S = raw.sum(-1, keepdims=True) + 1e-20
        draw = scale * (dw / S - (dw * raw).sum(-1, keepdims=True) / S**2)
    else:
        draw = scale * dw
    ds = np.zeros_like(s)
    np.add.at(ds, (np.arange(N)[:, None].repeat(k, 1), chosen), draw)
    dz = ds * s * (1 - s)
    g["Wr"] = x.T @ dz
    gx += dz @ p["Wr"].T
    g["b"] = np.zeros_like(p["b"])  # the bias chooses; it never weights
    return y, g, gx, chosen


def sequence_balance_loss(s, chosen, rows):
    """sum_e f_e P_e averaged over ``rows`` equal rows of the N tokens (DeepSeek-V3)."""
    N, E = s.shape
    k = chosen.shape[1]
    T = N // rows
    total = 0.0
    for r in range(rows):
        sl = slice(r * T, (r + 1) * T)
        f = np.bincount(chosen[sl].ravel(), minlength=E) * E / (k * T)
        P = (s[sl] / s[sl].sum(-1, keepdims=True)).mean(0)
        total += (f * P).sum()
    return total / rows
