"""What ``kda()`` promises about bad values: gate checks, and NaN kept inside its document.

Two guards around every implementation of the KDA operator:

**The gate promise.** Every implementation assumes g <= 0 (a decay), and the Pallas kernel's
tensor-core path assumes g >= lower_bound when one is given. A broken promise does not fail
loudly inside the kernel: it gives wrong finite numbers or NaN. So ``check_gate`` checks it
whenever the values are concrete (eager calls), and under ``jit`` when asked
(``check_inputs=True``: a host callback that raises, so the jitted call fails with the message).

**Documents stay apart.** With packed documents (``segment_ids``) a non-finite value (NaN or
inf) in one document must never reach another document's outputs or gradients. The chunked
forms mix tokens of a chunk in matrix products, where a cross-document zero times a NaN is
still NaN, so masking inside them cannot do it. ``isolate_documents`` instead:

- replaces every non-finite input entry by 0 before the implementation sees it (so the
  implementation only ever computes with finite numbers, and 0 * x = 0 across documents), and
- marks as NaN, per value head, the outputs of a document from its first non-finite input on
  (where the exact recurrence would turn NaN), the final state if the last document is hit, and
  in the backward pass the input gradients of every document that held a non-finite input or
  received a non-finite output cotangent.

A document is a maximal run of equal ``segment_ids`` in a row; the initial state belongs to the
row's first document.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _gate_bounds_message(g_min: float, g_max: float, lower_bound: float | None) -> str | None:
    if not (np.isfinite(g_min) and np.isfinite(g_max)):
        return None  # non-finite gates are the document guard's business, not a broken promise
    if g_max > 0:
        return (f"kda: g must be <= 0 (a log-decay), got max(g) = {g_max:g}; pass the gate "
                f"through kda_gate, or clip it")
    if lower_bound is not None and g_min < lower_bound:
        return (f"kda: g must be >= lower_bound={lower_bound:g} (the promise that selects the "
                f"kernel's tensor-core path), got min(g) = {g_min:g}; compute g with "
                f"kda_gate(..., lower_bound={lower_bound:g}) or pass lower_bound=None")
    return None


def _finite_range(g) -> tuple[float, float]:
    """(min, max) of the finite entries of g (+inf, -inf when there are none)."""
    g = np.asarray(g, np.float32)
    finite = g[np.isfinite(g)]
    if finite.size == 0:
        return np.inf, -np.inf
    return float(finite.min()), float(finite.max())


def check_gate(g_BxTxHVxK: jax.Array, lower_bound: float | None, check_inputs: bool) -> None:
    """Raises ValueError when g > 0 somewhere, or g < lower_bound (when given).

    Concrete values (an eager call) are checked on the host, always. Traced values (inside
    ``jit``, ``grad``, ``scan``) are checked only with ``check_inputs=True``, through a host
    callback: the jitted call then fails with a runtime error that carries the same message.
    """
    if g_BxTxHVxK.size == 0:
        return
    if not isinstance(g_BxTxHVxK, jax.core.Tracer):
        message = _gate_bounds_message(*_finite_range(g_BxTxHVxK), lower_bound)
        if message:
            raise ValueError(message)
        return
    if not check_inputs:
        return
    finite = jnp.isfinite(g_BxTxHVxK)
    g_min = jnp.min(jnp.where(finite, g_BxTxHVxK, jnp.inf)).astype(jnp.float32)
    g_max = jnp.max(jnp.where(finite, g_BxTxHVxK, -jnp.inf)).astype(jnp.float32)

    def raise_if_broken(g_min, g_max):
        # An all-non-finite g reads as (inf, -inf): nothing to say about the promise.
        lo, hi = float(g_min), float(g_max)
        message = _gate_bounds_message(lo, hi, lower_bound) if lo <= hi else None
        if message:
            raise ValueError(message)

    jax.debug.callback(raise_if_broken, g_min, g_max)


# ---------------------------------------------------------------------------------------------
# Document isolation
# ---------------------------------------------------------------------------------------------


def _bad_tokens(q, k, v, g, beta) -> jax.Array:
    """bool [B, T, HV]: a non-finite entry among the token's inputs to value head hv (its own
    v, g, beta and the q, k of the q/k head that serves it)."""
    H, HV = q.shape[2], v.shape[2]
    any_bad = lambda x: jnp.any(~jnp.isfinite(x), axis=-1)
    qk_BxTxH = any_bad(q) | any_bad(k)
    return (jnp.repeat(qk_BxTxH, HV // H, axis=2) | any_bad(v) | any_bad(g)
            | ~jnp.isfinite(beta))


def _segment_bounds(seg_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(first, last) token index [B, T] of the document each token belongs to."""
    B, T = seg_BxT.shape
    t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    starts = jnp.concatenate([jnp.ones((B, 1), bool), seg_BxT[:, 1:] != seg_BxT[:, :-1]], 1)
    ends = jnp.concatenate([seg_BxT[:, 1:] != seg_BxT[:, :-1], jnp.ones((B, 1), bool)], 1)
    first = lax.cummax(jnp.where(starts, t, 0), axis=1)
    last = lax.cummin(jnp.where(ends, t, T - 1), axis=1, reverse=True)
    return first, last


def _forward_poison(bad_BxTxHV, bad_S0_BxHV, first_BxT) -> jax.Array:
    """bool [B, T, HV]: the token's output is past a non-finite input of its document (or the
    document is the row's first and the initial state is non-finite)."""
    T = bad_BxTxHV.shape[1]
    t = jnp.arange(T, dtype=jnp.int32)[None, :, None]
    latest_bad = lax.cummax(jnp.where(bad_BxTxHV, t, -1), axis=1)
    hit = latest_bad >= first_BxT[..., None]
    return hit | (bad_S0_BxHV[:, None, :] & (first_BxT == 0)[..., None])


def _per_document_any(flag_BxTxHV, first_BxT, last_BxT) -> jax.Array:
    """bool [B, T, HV]: some token of the same document has the flag."""
    T = flag_BxTxHV.shape[1]
    t = jnp.arange(T, dtype=jnp.int32)[None, :, None]
    latest = lax.cummax(jnp.where(flag_BxTxHV, t, -1), axis=1)  # last flagged token <= t
    # The last flagged token of the whole document, read at the document's last token.
    at_end = jnp.take_along_axis(latest, last_BxT[..., None], axis=1)
    return at_end >= first_BxT[..., None]


def _nan_where(mask, x):
    return jnp.where(mask, jnp.asarray(jnp.nan, x.dtype), x)


def _clean(x):
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def isolate_documents(run, q, k, v, g, beta, S0, seg):
    """``run(q, k, v, g, beta, S0, seg) -> (o, S_T)`` with non-finite values kept inside their
    document (module docstring). ``seg`` [B, T] int; S0 [B, HV, K, V] float32."""
    return _isolated_forward(run, q, k, v, g, beta, S0, seg)[0]


def _isolated_forward(run, q, k, v, g, beta, S0, seg):
    bad = _bad_tokens(q, k, v, g, beta)
    bad_S0 = jnp.any(~jnp.isfinite(S0), axis=(2, 3))  # [B, HV]
    first, last = _segment_bounds(seg)
    poison = _forward_poison(bad, bad_S0, first)
    clean = tuple(map(_clean, (q, k, v, g, beta, S0)))
    (o, S_T), vjp = jax.vjp(lambda *a: run(*a, seg), *clean)
    o = _nan_where(poison[..., None], o)
    S_T = _nan_where(poison[:, -1, :, None, None], S_T)
    return (o, S_T), (vjp, bad, bad_S0, poison, first, last)


def _isolated_bwd(run, residuals, cotangents):
    vjp, bad, bad_S0, poison, first, last = residuals
    do, dS_T = cotangents
    # Cotangents of outputs that are NaN by design carry nothing back; a non-finite cotangent
    # elsewhere poisons the gradients of its own document only.
    bad_do = jnp.any(~jnp.isfinite(do), axis=-1) & ~poison  # [B, T, HV]
    bad_dST = jnp.any(~jnp.isfinite(dS_T), axis=(2, 3))  # [B, HV]: the row's last document
    do = jnp.where(poison[..., None] | ~jnp.isfinite(do), jnp.zeros((), do.dtype), do)
    dS_T = _clean(dS_T)
    dq, dk, dv, dg, dbeta, dS0 = vjp((do, dS_T))

    in_last_doc = (last == last[:, -1:])[..., None]  # [B, T, 1]
    hit = bad | bad_do | (bad_dST[:, None, :] & in_last_doc)
    hit = hit | (bad_S0[:, None, :] & (first == 0)[..., None])
    doc_hit = _per_document_any(hit, first, last)  # [B, T, HV]
    H, HV = dq.shape[2], doc_hit.shape[2]
    doc_hit_qk = jnp.any(doc_hit.reshape(*doc_hit.shape[:2], H, HV // H), axis=-1)
    dq, dk = (_nan_where(doc_hit_qk[..., None], x) for x in (dq, dk))
    dv, dg = (_nan_where(doc_hit[..., None], x) for x in (dv, dg))
    dbeta = _nan_where(doc_hit, dbeta)
    first_doc_hit = jnp.any(doc_hit & (first == 0)[..., None], axis=1)  # [B, HV]
    dS0 = _nan_where(first_doc_hit[..., None, None], dS0)
    return dq, dk, dv, dg, dbeta, dS0, None


isolate_documents.defvjp(_isolated_forward, _isolated_bwd)
