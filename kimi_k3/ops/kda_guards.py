"""What ``kda()`` promises about bad values: gate checks, -inf gates, and NaN kept in its place.

Three guards around every implementation of the KDA operator:

**The gate promise.** Every implementation assumes g <= 0 (a decay), and the Pallas kernel's
tensor-core path assumes g >= lower_bound when one is given. A broken promise does not fail
loudly inside the kernel: it gives wrong finite numbers or NaN. So ``check_gate`` checks it
whenever the values are concrete (eager calls), and under ``jit`` when asked
(``check_inputs=True``: a host callback that raises, so the jitted call fails with the message).
It looks at the finite gates only: a non-finite one is a bad value (below), not a broken promise.

**-inf gates.** Without a lower bound, g = -inf is a valid gate, "forget everything": the
recurrence gives exp(-inf) = 0. The chunked forms subtract cumulative gates, and -inf - -inf is
NaN, so ``finite_forget`` takes every gate below ``FORGET_GATE`` (-120) as that finite gate,
whose exp is exactly 0 in float32 too (the Pallas kernel does the same inside, as it loads g).
With a lower bound, -inf breaks the promise g >= lower_bound; like a NaN it is a bad value
(``neg_inf_as_nan`` makes the recurrent form, which would decay it exactly, agree).

**Bad values stay in place.** A non-finite value (NaN or inf) in the inputs must not reach
the outputs before it, nor another document's outputs or gradients. The chunked forms mix the
tokens of a chunk in matrix products, where a zero times a NaN is still NaN (a token earlier
in the chunk, or of another document), so masking inside them cannot do it.
``isolate_documents`` instead:

- replaces every non-finite input entry by 0 before the implementation sees it (so the
  implementation only ever computes with finite numbers, and 0 * x = 0 across documents), and
- marks as NaN, per value head, the outputs of a document from its first non-finite k, v, g or
  beta on (where the exact recurrence turns non-finite: at least the bad value's column), and
  the output of a token with a non-finite q (the state never holds q: only that output turns
  non-finite), the final state if the last document is hit, and in the backward pass the input
  gradients of every document that held a non-finite input or received a non-finite output
  cotangent.

It costs a few passes over the inputs. Without ``segment_ids`` ``isolate_rows`` gives the same
result with each row (and value head) one document, at almost no cost: the implementation runs
on the inputs as they are, and a bad k, v, g, beta or initial state always leaves the final
state non-finite (NaN spreads through the products of every form), so only when the final
state is non-finite is the call run again through ``isolate_documents``; a bad q reaches only
its own token's output in every form, as in the recurrence. The rows and heads are independent
in every form, so the backward pass takes the first run's gradients and marks those of a row
and value head that held a non-finite input (or got a non-finite cotangent) as NaN.

A document is a maximal run of equal ``segment_ids`` in a row; the initial state belongs to the
row's first document.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.kda_body import FORGET_GATE


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
# -inf gates
# ---------------------------------------------------------------------------------------------


def finite_forget(g: jax.Array) -> jax.Array:
    """g with every gate below ``FORGET_GATE`` (-inf: forget everything) taken as FORGET_GATE, a
    finite gate that decays to exactly 0 in float32 as well (exp(-120) is below half the
    smallest denormal). Exact for the recurrence, forward and backward: the gradient through
    either gate is exp(g) times a finite number, 0. NaN stays NaN. Without a lower bound only."""
    return jnp.where(g < FORGET_GATE, jnp.asarray(FORGET_GATE, g.dtype), g)


def neg_inf_as_nan(g: jax.Array) -> jax.Array:
    """g with -inf as NaN: with a lower bound, -inf breaks the promise g >= lower_bound and is a
    bad value like NaN, in the recurrence too (which would decay it exactly, unlike the chunked
    forms)."""
    return jnp.where(g == -jnp.inf, jnp.asarray(jnp.nan, g.dtype), g)


# ---------------------------------------------------------------------------------------------
# Document isolation
# ---------------------------------------------------------------------------------------------


def _bad_tokens(q, k, v, g, beta) -> tuple[jax.Array, jax.Array]:
    """(read, written) bool [B, T, HV]: a non-finite entry among the token's inputs to value
    head hv; read: in its q (of the q/k head that serves hv), which reaches only the token's own
    output; written: in its k, v, g or beta, which go into the state."""
    H, HV = q.shape[2], v.shape[2]
    any_bad = lambda x: jnp.any(~jnp.isfinite(x), axis=-1)
    per_value_head = lambda x_BxTxH: jnp.repeat(x_BxTxH, HV // H, axis=2)
    read = per_value_head(any_bad(q))
    written = per_value_head(any_bad(k)) | any_bad(v) | any_bad(g) | ~jnp.isfinite(beta)
    return read, written


def _segment_bounds(seg_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(first, last) token index [B, T] of the document each token belongs to."""
    B, T = seg_BxT.shape
    t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    starts = jnp.concatenate([jnp.ones((B, 1), bool), seg_BxT[:, 1:] != seg_BxT[:, :-1]], 1)
    ends = jnp.concatenate([seg_BxT[:, 1:] != seg_BxT[:, :-1], jnp.ones((B, 1), bool)], 1)
    first = lax.cummax(jnp.where(starts, t, 0), axis=1)
    last = lax.cummin(jnp.where(ends, t, T - 1), axis=1, reverse=True)
    return first, last


def _state_poison(written_BxTxHV, bad_S0_BxHV, first_BxT) -> jax.Array:
    """bool [B, T, HV]: the state after the token holds a non-finite value: a non-finite k, v,
    g or beta at or before it in its document (or the document is the row's first and the
    initial state is non-finite)."""
    T = written_BxTxHV.shape[1]
    t = jnp.arange(T, dtype=jnp.int32)[None, :, None]
    latest_bad = lax.cummax(jnp.where(written_BxTxHV, t, -1), axis=1)
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
    return _isolated(run, q, k, v, g, beta, S0, seg, with_vjp=False)[0]


def _isolated(run, q, k, v, g, beta, S0, seg, *, with_vjp: bool):
    read, written = _bad_tokens(q, k, v, g, beta)
    bad_S0 = jnp.any(~jnp.isfinite(S0), axis=(2, 3))  # [B, HV]
    first, last = _segment_bounds(seg)
    state_poison = _state_poison(written, bad_S0, first)
    poison = state_poison | read  # the outputs that are NaN by design
    clean = tuple(map(_clean, (q, k, v, g, beta, S0)))
    if with_vjp:
        (o, S_T), vjp = jax.vjp(lambda *a: run(*a, seg), *clean)
    else:
        (o, S_T), vjp = run(*clean, seg), None
    o = _nan_where(poison[..., None], o)
    S_T = _nan_where(state_poison[:, -1, :, None, None], S_T)
    return (o, S_T), (vjp, read | written, bad_S0, poison, first, last)


def _isolated_forward(run, q, k, v, g, beta, S0, seg):
    return _isolated(run, q, k, v, g, beta, S0, seg, with_vjp=True)


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


# ---------------------------------------------------------------------------------------------
# Without packed documents: each row one document, guarded only when something is non-finite
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def isolate_rows(run, rerun, q, k, v, g, beta, S0, params):
    """``run(q, k, v, g, beta, S0, params) -> (o, S_T)`` without packed documents, with each row
    (per value head) one document of ``isolate_documents`` (module docstring). ``rerun`` takes
    the same arguments and gives that guarded result (``isolate_documents`` with one segment per
    row); it runs only when ``run``'s final state is non-finite. ``params``: a tuple of arrays
    shared by all rows (the gate's A_log and dt_bias, or ()); their gradients are NaN when any
    row is hit.

    Cost when every value is finite: a reduction over the final state after the forward and
    over the initial state's gradient after the backward, and a ``lax.cond`` on each."""
    o, S_T = run(q, k, v, g, beta, S0, params)
    return _rerun_if_hit(rerun, (q, k, v, g, beta, S0, params), o, S_T)[:2]


def _rerun_if_hit(rerun, args, o, S_T):
    # A non-finite k, v, g, beta or initial state leaves the row's final state non-finite
    # (module docstring); q never reaches it, and a bad q spoils only its own output anyway.
    hit = jnp.any(~jnp.isfinite(S_T), axis=(2, 3))  # [B, HV]
    o, S_T = lax.cond(jnp.any(hit), lambda a, o, S: rerun(*a), lambda a, o, S: (o, S),
                      args, o, S_T)
    return o, S_T, hit


def _rows_fwd(run, rerun, q, k, v, g, beta, S0, params):
    args = (q, k, v, g, beta, S0, params)
    (o, S_T), vjp = jax.vjp(run, *args)
    o, S_T, hit = _rerun_if_hit(rerun, args, o, S_T)
    return (o, S_T), (vjp, hit)


def _rows_bwd(run, rerun, residuals, cotangents):
    vjp, hit = residuals
    grads = vjp(cotangents)
    # Rows and value heads never mix in any form, so only a hit row and head has gradients
    # touched by a non-finite value: one that held one (its final state says so), or got a
    # non-finite cotangent or a non-finite q (either reaches the initial state's gradient).
    hit = hit | jnp.any(~jnp.isfinite(grads[5]), axis=(2, 3))  # [B, HV]

    def mark(grads):
        dq, dk, dv, dg, dbeta, dS0, dparams = grads
        B, HV, H = hit.shape[0], hit.shape[1], dq.shape[2]
        hit_qk = jnp.any(hit.reshape(B, H, HV // H), axis=-1)[:, None, :, None]  # [B, 1, H, 1]
        dq, dk = (_nan_where(hit_qk, x) for x in (dq, dk))
        dv, dg = (_nan_where(hit[:, None, :, None], x) for x in (dv, dg))
        dbeta = _nan_where(hit[:, None, :], dbeta)
        dS0 = _nan_where(hit[..., None, None], dS0)
        dparams = tuple(_nan_where(True, x) for x in dparams)
        return dq, dk, dv, dg, dbeta, dS0, dparams

    return lax.cond(jnp.any(hit), mark, lambda grads: grads, tuple(grads))


isolate_rows.defvjp(_rows_fwd, _rows_bwd)
