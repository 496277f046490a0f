"""Kimi Delta Attention: one public function, several implementations of the same equation.

Layout follows flash-linear-attention's ``chunk_kda`` so code moves between the two:

    q, k         [B, T, H, K]     queries, keys (L2-normalised upstream, in the layer)
    v            [B, T, HV, V]    values; HV = G * H, q/k head h serves value heads h*G .. h*G+G-1
    g            [B, T, HV, K]    per-channel log-decay, g <= 0
    beta         [B, T, HV]       write strength
    state        [B, HV, K, V]    always float32

Per token: S <- Diag(exp g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale q_t).

The gate inside the op (fla's ``use_gate_in_kernel``): given ``A_log`` [HV] and ``dt_bias``
[HV, K], the fourth argument is the gate's pre-activation f [B, T, HV, K] (any float dtype)
and the op computes g from it (``kimi_k3.ops.gates.kda_gate``, the form chosen by
``lower_bound``). The Pallas kernel does so in its prologue, in float32, and returns df, dA_log,
d dt_bias from its backward: g never exists in memory and cannot break the bound. The other
implementations apply ``kda_gate`` first (they define the semantics).

Implementations (``impl=``):
    "recurrent"  token by token with lax.scan: the definition.
    "xla"        the chunked (WY) form in plain JAX; any T; differentiable; O(T) memory.
    "pallas"     the Pallas kernel (pallas_kernels/); interpret mode on CPU.
    "auto"       the best one available on the current backend, decided in kimi_k3/dispatch.py
                 (an explicit impl runs or raises, never silently becomes another).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kimi_k3.dispatch import KDA_IMPLS, choose_kda_impl
from kimi_k3.ops.gates import kda_gate
from kimi_k3.ops.kda_chunked import kda_chunked
from kimi_k3.ops.kda_guards import (
    check_gate,
    finite_forget,
    isolate_rows,
    neg_inf_as_nan,
)
from kimi_k3.ops.kda_guards import isolate_documents as isolate_nonfinite
from kimi_k3.ops.kda_recurrent import kda_recurrent
from pallas_kernels.kda import kda_pallas
from pallas_kernels.tuning import KernelTuning


def _shape_error(name: str, got, allowed: str) -> ValueError:
    return ValueError(f"kda: {name} {allowed}, got {got}")


def _validate(q, k, v, g, beta, initial_state, segment_ids, chunk_size, impl, lower_bound):
    if impl not in KDA_IMPLS:
        raise ValueError(f"kda: impl must be one of {KDA_IMPLS}, got {impl!r}")
    if not (isinstance(chunk_size, int) and chunk_size > 0 and chunk_size & (chunk_size - 1) == 0):
        raise ValueError(f"kda: chunk_size must be a positive power of two, got {chunk_size!r}")
    if lower_bound is not None and not (
        isinstance(lower_bound, int | float) and math.isfinite(lower_bound) and lower_bound < 0
    ):
        raise ValueError(
            f"kda: lower_bound must be None (unbounded gate) or a finite negative number, "
            f"got {lower_bound!r}"
        )
    if q.ndim != 4:
        raise _shape_error("q", q.shape, "must be [B, T, H, K]")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise _shape_error("k", k.shape, f"must match q's shape {q.shape}")
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise _shape_error("v", v.shape, f"must be [B={B}, T={T}, HV, V]")
    HV, V = v.shape[2:]
    if HV % H != 0:
        raise ValueError(
            f"kda: v's head count HV={HV} must be a multiple of q/k's head count H={H}"
        )
    if g.shape != (B, T, HV, K):
        raise _shape_error("g", g.shape, f"must be [B, T, HV, K] = {(B, T, HV, K)}")
    if beta.shape != (B, T, HV):
        raise _shape_error("beta", beta.shape, f"must be [B, T, HV] = {(B, T, HV)}")
    if initial_state is not None:
        if initial_state.shape != (B, HV, K, V):
            raise _shape_error(
                "initial_state", initial_state.shape, f"must be [B, HV, K, V] = {(B, HV, K, V)}"
            )
        if initial_state.dtype != jnp.float32:
            raise ValueError(f"kda: initial_state must be float32, got {initial_state.dtype}")
    if segment_ids is not None:
        if segment_ids.shape != (B, T):
            raise _shape_error("segment_ids", segment_ids.shape, f"must be [B, T] = {(B, T)}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"kda: segment_ids must be integer, got {segment_ids.dtype}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"kda: {name} must be a floating dtype, got {x.dtype}")


def _validate_gate(A_log, dt_bias, HV: int, K: int):
    """The in-kernel gate's parameters: both or neither, A_log [HV], dt_bias [HV, K] or
    [HV * K], floating."""
    if (A_log is None) != (dt_bias is None):
        given, missing = ("A_log", "dt_bias") if dt_bias is None else ("dt_bias", "A_log")
        raise ValueError(f"kda: {given} was given without {missing}; the gate in the op needs "
                         "both (or neither, with g the log-decay itself)")
    if A_log is None:
        return
    if A_log.shape != (HV,):
        raise _shape_error("A_log", A_log.shape, f"must be [HV] = {(HV,)} (one per value head)")
    if dt_bias.shape not in ((HV, K), (HV * K,)):
        raise _shape_error("dt_bias", dt_bias.shape,
                           f"must be [HV, K] = {(HV, K)} or flat [HV * K] = {(HV * K,)}")
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"kda: {name} must be a floating dtype, got {x.dtype}")


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _run(q, k, v, g, beta, S0, seg, *, impl, scale, chunk_size, lower_bound, tuning,
         gate_params=None):
    """One implementation on validated, clamped arguments: (o float32 or v's dtype, S_T f32).

    gate_params: None (g is the log-decay) or (A_log, dt_bias) (g is the gate's pre-activation
    f): the kernel takes them, the other implementations apply the gate first.

    A gate of -inf (``kda_guards``): without a lower bound it forgets, exactly: the chunked form
    takes it as a finite gate that decays to 0 (fused into its input pass; the kernel does the
    same as it loads g); the recurrence needs nothing. With one it is a bad value, like NaN,
    which the recurrence is told (the chunked forms turn it into NaN themselves)."""
    if gate_params is not None:
        if impl == "pallas":
            A_log, dt_bias = gate_params
            return kda_pallas(q, k, v, g, beta, scale=scale, initial_state=S0, segment_ids=seg,
                              chunk_size=chunk_size, lower_bound=lower_bound, tuning=tuning,
                              A_log=A_log, dt_bias=dt_bias)
        g = kda_gate(g, *gate_params, lower_bound)
    if impl == "recurrent":
        if lower_bound is not None:
            g = neg_inf_as_nan(g)
        return kda_recurrent(q, k, v, g, beta, scale=scale, initial_state_BxHVxKxV=S0,
                             segment_ids_BxT=seg)
    if impl == "xla":
        if lower_bound is None:
            g = finite_forget(g)
        return kda_chunked(q, k, v, g, beta, scale=scale, initial_state_BxHVxKxV=S0,
                           segment_ids_BxT=seg, chunk_size=chunk_size)
    return kda_pallas(q, k, v, g, beta, scale=scale, initial_state=S0, segment_ids=seg,
                      chunk_size=chunk_size, lower_bound=lower_bound, tuning=tuning)


def _guarded_documents(run, q, k, v, g, beta, S0, seg, gate_params, lower_bound):
    """``isolate_documents`` around ``run`` (g given): the gate applied first (the guard marks
    non-finite per-token inputs and takes the implementation as a fixed function of them: a bad
    f, A_log or dt_bias shows up in g where it hits), and without a lower bound a -inf gate
    made finite first (it forgets: not a bad value)."""
    if gate_params:
        g = kda_gate(g, *gate_params, lower_bound)
    if lower_bound is None:
        g = finite_forget(g)
    return isolate_nonfinite(run, q, k, v, g, beta, S0, seg)


def kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    chunk_size: int = 64,
    lower_bound: float | None = None,
    impl: str = "auto",
    check_inputs: bool = False,
    isolate_documents: bool = True,
    tuning: KernelTuning | None = None,
    A_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Kimi Delta Attention over a whole sequence.

    Args:
      q, k: [B, T, H, K]. v: [B, T, HV, V], HV a multiple of H. g: [B, T, HV, K] log-decay (<= 0),
        or, with ``A_log`` and ``dt_bias``, the gate's pre-activation f (any float dtype).
      beta: [B, T, HV]. scale: multiplies q; defaults to K ** -0.5.
      initial_state: [B, HV, K, V] float32, the state before token 0 (of each row's first segment).
      output_final_state: return the state after the last token.
      segment_ids: [B, T] int, packed documents; the state restarts from zero at each new id.
      chunk_size: chunk length of the chunked forms, a positive power of two; a chunk longer
        than the sequence is cut to the next power of two >= T (the result does not depend on
        it).
      lower_bound: a promise that every g >= lower_bound (the bounded gate's g_min, e.g. -5); the
        Pallas kernel then uses its tensor-core path. None: gates may be arbitrarily negative.
      impl: "auto" | "recurrent" | "xla" | "pallas".
      check_inputs: also check the gate promise when the call is traced (under ``jit``), with a
        host callback (a little slower). Concrete (eager) inputs are always checked.
      isolate_documents: keep a non-finite value inside its document, and out of the outputs
        before it (below). With ``segment_ids`` it costs a few passes over the inputs; without,
        each row is one document and the cost is a check of the final state (and of the
        initial state's gradient) and a ``lax.cond``: the guarded rerun runs only when they are
        not finite. A caller that discards everything once any value is non-finite (a training
        step, whose loss mixes all documents) can skip it.
      tuning: the Pallas kernel's launch parameters (``pallas_kernels.tuning.KernelTuning``);
        None: ``KernelTuning()``, right for every card. Ignored by the other implementations.
      A_log: [HV], dt_bias: [HV, K] (or flat [HV * K]): the gate inside the op (both or
        neither). g is then f, and the log-decay is, per value head h and channel d,
            lower_bound given:  g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h, d]))
            lower_bound None:   g = -exp(A_log[h]) * softplus(f + dt_bias[h, d])
        computed in float32 (inside the Pallas kernel; ``kda_gate`` first elsewhere), so the
        gate promise below holds by construction. Differentiable in f, A_log and dt_bias. With
        ``segment_ids`` and ``isolate_documents`` the gate is applied before the guard (which
        works on g), so g is materialised on that path (without them, only in the rerun).

    What is promised, and what happens otherwise:
      - g <= 0 everywhere, and g >= lower_bound when one is given. Broken, an eager call (or a
        traced one with ``check_inputs=True``) raises ValueError with the offending value;
        unchecked, the Pallas kernel's results are undefined (wrong numbers or NaN).
      - g = -inf ("forget everything") is a gate like any other without a lower bound: every
        implementation gives the recurrence's result, forward, final state and gradients. With
        a lower bound it breaks the promise and is a bad value, like NaN (below).
      - With ``isolate_documents``, a NaN or inf never reaches the outputs before it, nor
        another document: that document's outputs, per value head, from its bad k, v, g or
        beta on (and its final state, if it is the row's last) are NaN, as is the output of a
        token with a bad q (the only one a bad q reaches in the recurrence), and so are the
        gradients of its inputs; every other document is exact (``kimi_k3.ops.kda_guards``).
        Without ``segment_ids`` a document is a row (its gradients: of that row and value head).
      - T = 0 gives empty outputs (and the initial state, or zeros, as the final state).

    Returns:
      (o [B, T, HV, V] in v's dtype, final_state [B, HV, K, V] float32 or None).
    """
    _validate(q, k, v, g, beta, initial_state, segment_ids, chunk_size, impl, lower_bound)
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    _validate_gate(A_log, dt_bias, HV, K)
    if scale is None:
        scale = K ** -0.5
    S0 = jnp.zeros((B, HV, K, V), jnp.float32) if initial_state is None else initial_state
    if T == 0:
        return jnp.zeros((B, 0, HV, V), v.dtype), (S0 if output_final_state else None)
    gate_params = None if A_log is None else (A_log, dt_bias)
    if gate_params is None:  # (with the gate in the op its form guarantees the promise)
        check_gate(g, lower_bound, check_inputs)
    run = functools.partial(_run, impl=choose_kda_impl(impl), scale=scale,
                            chunk_size=min(chunk_size, _next_pow2(T)), lower_bound=lower_bound,
                            tuning=tuning)
    S0 = S0.astype(jnp.float32)
    if not isolate_documents:
        seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
        o, S = run(q, k, v, g, beta, S0, seg, gate_params=gate_params)
    elif segment_ids is not None:
        o, S = _guarded_documents(run, q, k, v, g, beta, S0, segment_ids.astype(jnp.int32),
                                  gate_params, lower_bound)
    else:
        # Each row one document, guarded only when its final state comes out non-finite.
        o, S = isolate_rows(
            lambda q, k, v, g, beta, S0, params: run(q, k, v, g, beta, S0, None,
                                                     gate_params=params or None),
            lambda q, k, v, g, beta, S0, params: _guarded_documents(
                run, q, k, v, g, beta, S0, jnp.zeros((B, T), jnp.int32), params, lower_bound),
            q, k, v, g, beta, S0, gate_params or ())
    return o.astype(v.dtype), (S if output_final_state else None)
