"""The decay gate inside the KDA op: ``kda(q, k, v, f, beta, A_log=, dt_bias=)``.

Held to the existing path, ``kda(q, k, v, kda_gate(f, A_log, dt_bias, lower_bound), beta)``:
outputs, final state and the gradients w.r.t. f, A_log, dt_bias, q, k, v, beta, for both gate
forms, on the Pallas kernel (interpret and TPU-interpret mode on CPU, compiled on a GPU when
there is one) and the XLA form. The hand-written chain rule of the kernel's gate is checked
against float64 central differences, extreme pre-activations must keep the bounded gate
within its bound and everything finite, and the compiled kernels must still lower for GPU
and TPU. Shapes are small: Pallas interpret mode is slow.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_k3.ops.gates import kda_gate
from kimi_k3.ops.kda import kda
from pallas_kernels import kda as pk
from pallas_kernels import kda_body as body
from pallas_kernels import kda_calls as calls
from pallas_kernels.triton_report import as_if_on_h200
from pallas_kernels.tuning import KernelTuning

ON_GPU = jax.default_backend() == "gpu"
GRAD_NAMES = ("q", "k", "v", "f", "beta", "A_log", "dt_bias")
LOWER_BOUND = {"bounded": -5.0, "softplus": None}
QUICK_COMPILE = {"xla_backend_optimization_level": "0"}


def make_inputs(rng, B=1, T=37, H=1, HV=2, K=16, V=16, *, extreme=False, f_dtype=jnp.float32):
    """Fresh random q, k (unit rows), v, f, beta, A_log [HV], dt_bias [HV, K]. ``extreme``:
    logits |f| up to 30 (whole tokens pinned at +-30) and A = exp(A_log) = e^5 on head 0."""
    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q, k = unit((B, T, H, K)), unit((B, T, H, K))
    v = rng.standard_normal((B, T, HV, V))
    f = rng.standard_normal((B, T, HV, K))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, HV))))
    A_log = 0.5 * rng.standard_normal(HV)
    dt_bias = rng.standard_normal((HV, K))
    if extreme:
        f = np.clip(12.0 * f, -30.0, 30.0)
        f[:, 1:4], f[:, 5:8] = 30.0, -30.0
        A_log[0] = 5.0
    arrs = [jnp.asarray(x, jnp.float32) for x in (q, k, v, f, beta, A_log, dt_bias)]
    arrs[3] = arrs[3].astype(f_dtype)
    return arrs


def rel(x, ref, scale=None):
    """||x - ref|| / ||ref|| (or / ||scale|| when given)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref if scale is None else scale),
                                               1e-30))


def loss_weights(rng, inputs):
    """Random weights of a linear loss on (o, S_T): every output element gets a cotangent."""
    q, v = inputs[0], inputs[2]
    B, _, _, K = q.shape
    HV, V = v.shape[2:]
    return (jnp.asarray(rng.standard_normal(v.shape), jnp.float32),
            jnp.asarray(rng.standard_normal((B, HV, K, V)), jnp.float32))


def value_and_grads(inputs, weights, *, gate_in_op, lower_bound, flat_dt_bias=False,
                    **kda_kwargs):
    """(o, S_T, gradients of the weighted loss w.r.t. GRAD_NAMES), jitted. gate_in_op: f, A_log
    and dt_bias (flat [HV * K] with ``flat_dt_bias``) go into the op; else the op gets
    kda_gate's g (the existing path)."""
    o_w, S_w = weights

    def run(q, k, v, f, beta, A_log, dt_bias):
        if gate_in_op:
            dt_bias = dt_bias.reshape(-1) if flat_dt_bias else dt_bias
            return kda(q, k, v, f, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                       output_final_state=True, **kda_kwargs)
        g = kda_gate(f, A_log, dt_bias, lower_bound)
        return kda(q, k, v, g, beta, lower_bound=lower_bound, output_final_state=True,
                   **kda_kwargs)

    def loss(*args):
        o, S = run(*args)
        return jnp.sum(o.astype(jnp.float32) * o_w) + jnp.sum(S * S_w), (o, S)

    (_, (o, S)), grads = compiled(jax.value_and_grad(loss, argnums=range(7), has_aux=True),
                                  *inputs)(*inputs)
    return o, S, grads


def compiled(fn, *args):
    """``jax.jit(fn)`` compiled for ``args`` without XLA's CPU backend optimisations: these
    programs are tiny and run once, and the optimisations cost more time than they save."""
    return jax.jit(fn).trace(*args).lower().compile(compiler_options=QUICK_COMPILE)


def reduction_scales(inputs, df, lower_bound):
    """Sums of |term| behind dA_log [HV] and d dt_bias [HV, K]. Both are float32 sums over
    tokens (and channels) whose terms can cancel; two summation orders agree to a fraction of
    this scale, not of the (possibly tiny) total. Per element, dg/dA_log = dg/df * r with
    r = f + dt_bias (bounded form) or softplus / sigmoid of it (softplus form), and
    dg/d dt_bias = dg/df."""
    f, dt_bias = np.asarray(inputs[3], np.float64), np.asarray(inputs[6], np.float64)
    x = f + dt_bias.reshape(f.shape[2:])
    df = np.asarray(df, np.float64)
    r = x if lower_bound is not None else np.logaddexp(0.0, x) * (1.0 + np.exp(-x))
    return {"A_log": np.abs(df * r).sum((0, 1, 3)), "dt_bias": np.abs(df).sum((0, 1))}


def assert_same(got, want, tol, what, *, inputs, lower_bound, tols=None):
    """Outputs and gradients within ``tol`` (relative norm; ``tols``: per gradient name).
    dA_log and d(dt_bias) are measured against the norm of their reduction_scales (of
    ``inputs``, the gate form of ``lower_bound`` and the reference's df), not their own."""
    tols = tols or {}
    o, S, grads = got
    o_ref, S_ref, grads_ref = want
    scales = reduction_scales(inputs, grads_ref[GRAD_NAMES.index("f")], lower_bound)
    assert rel(o, o_ref) < tol, (what, "o", rel(o, o_ref))
    assert rel(S, S_ref) < tol, (what, "S", rel(S, S_ref))
    for name, a, b in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, name, a.dtype, b.dtype)
        assert np.all(np.isfinite(np.asarray(a, np.float32))), (what, f"d{name} not finite")
        err = rel(a, b, scales.get(name))
        assert err < tols.get(name, tol), (what, f"d{name}", err)


# ----------------------------------------------------------------------------- the chain rule


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_kernel_gate_derivatives_match_float64_differences(rng, gate):
    """``kda_body.gate_logit_grads`` (the hand-written chain rule the backward kernel runs)
    against float64 central differences of the gate's definition, and ``gate_from_logits``
    against the definition itself; padding rows give g = 0 and no gradient."""
    lb = LOWER_BOUND[gate]
    C, BK = 16, 16
    cfg = pk.make_config(jnp.zeros((1, C, 1, BK)), jnp.zeros((1, C, 1, BK)), scale=1.0,
                         segment_ids=None, chunk_size=C, lower_bound=lb, mode="interpret",
                         tuning=KernelTuning(), gate_in_kernel=True)
    assert cfg.gate == gate
    f = 3.0 * rng.standard_normal((C, BK))
    A = np.exp(0.5 * rng.standard_normal((1, BK)))
    b = rng.standard_normal((1, BK))
    dg = rng.standard_normal((C, BK))
    rows_ok = np.arange(C)[:, None] < C - 3  # the last three rows are padding

    def gate64(f, A, b):
        x = f + b
        return lb / (1.0 + np.exp(-A * x)) if gate == "bounded" else -A * np.logaddexp(0.0, x)

    g = body.gate_from_logits(*(jnp.asarray(x, jnp.float32) for x in (f, A, b, rows_ok)), cfg)
    np.testing.assert_allclose(g, np.where(rows_ok, gate64(f, A, b), 0.0), rtol=1e-6, atol=1e-6)
    df, dbias, dA = body.gate_logit_grads(
        *(jnp.asarray(x, jnp.float32) for x in (dg, f, A, b, rows_ok)), cfg)
    eps = 1e-6
    df_ref = dg * (gate64(f + eps, A, b) - gate64(f - eps, A, b)) / (2 * eps)
    dA_ref = dg * (gate64(f, A + eps, b) - gate64(f, A - eps, b)) / (2 * eps)
    df_ref, dA_ref = np.where(rows_ok, df_ref, 0.0), np.where(rows_ok, dA_ref, 0.0)
    np.testing.assert_allclose(df, df_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dbias, df_ref.sum(0, keepdims=True), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dA, dA_ref.sum(0, keepdims=True), rtol=1e-5, atol=1e-5)

    # Extreme pre-activations (|f| = 30, A = e^5): saturated, never past the bound, never NaN.
    f_x = jnp.asarray(np.where(rng.random((C, BK)) < 0.5, -30.0, 30.0), jnp.float32)
    A_x, b_x = jnp.full((1, BK), np.exp(5.0), jnp.float32), jnp.zeros((1, BK), jnp.float32)
    ok = jnp.ones((C, 1), bool)
    g_x = np.asarray(body.gate_from_logits(f_x, A_x, b_x, ok, cfg))
    grads_x = body.gate_logit_grads(jnp.ones((C, BK)), f_x, A_x, b_x, ok, cfg)
    assert np.all(g_x <= 0) and (lb is None or np.all(g_x >= lb)), (g_x.min(), g_x.max())
    assert np.all(np.isfinite(g_x)) and all(bool(jnp.all(jnp.isfinite(x))) for x in grads_x)


# ----------------------------------------------------------------------------- the op


PALLAS_CASES = [  # (backend, gate, B, T, chunk_size, f dtype, packed documents, extreme logits)
    # (one interpret case per gate form: the Triton-semantics softplus, the TPU bounded)
    ("interpret", "softplus", 2, 37, 16, jnp.bfloat16, True, True),
    ("tpu_interpret", "bounded", 1, 13, 16, jnp.float32, True, True),
] + ([("gpu", "bounded", 2, 100, 64, jnp.bfloat16, True, True),
      ("gpu", "softplus", 1, 100, 64, jnp.float32, False, False)] if ON_GPU else [])


@pytest.mark.parametrize(("backend", "gate", "B", "T", "chunk_size", "f_dtype", "packed",
                          "extreme"), PALLAS_CASES)
def test_pallas_gate_in_kernel_equals_gate_outside(rng, monkeypatch, backend, gate, B, T,
                                                   chunk_size, f_dtype, packed, extreme):
    """The kernel's in-prologue gate against the same kernel fed kda_gate's g: T not a
    multiple of the chunk (padding rows must not decay the final state), grouped value heads
    with packed documents, bf16 logits (df comes back in bf16), and extreme logits (saturated
    gates, g ~ -4000 per step in the softplus form) where everything must stay finite."""
    if backend != "gpu":  # route impl="pallas" to the requested interpret flavour
        real = pk.kda_pallas
        # (the module, not kimi_k3.ops.kda the function the package re-exports)
        monkeypatch.setattr(importlib.import_module("kimi_k3.ops.kda"), "kda_pallas",
                            lambda *a, **kw: real(*a, backend=backend, poison=True, **kw))
    inputs = make_inputs(rng, B=B, T=T, H=1 if packed else 2, HV=2, f_dtype=f_dtype,
                         extreme=extreme)
    kw = dict(lower_bound=LOWER_BOUND[gate], impl="pallas", chunk_size=chunk_size)
    if packed:  # documents: the kernel's own segment handling (no guard around it)
        seg = np.zeros((B, T), np.int32)
        seg[:, T // 3:] += 1
        seg[-1, 2 * T // 3:] += 1
        kw.update(segment_ids=jnp.asarray(seg), isolate_documents=False)
    weights = loss_weights(rng, inputs)
    got = value_and_grads(inputs, weights, gate_in_op=True, flat_dt_bias=not packed, **kw)
    want = value_and_grads(inputs, weights, gate_in_op=False, **kw)
    # Both paths round the same float32 df to f's dtype: bf16 ties may land either way.
    tol = 5e-3 if backend == "gpu" else 1e-5
    assert_same(got, want, tol, backend, inputs=inputs, lower_bound=kw["lower_bound"],
                tols={"f": 5e-3} if f_dtype == jnp.bfloat16 else {})


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_xla_gate_in_op_equals_gate_outside(rng, gate):
    """The reference implementations apply kda_gate themselves ("recurrent" takes the same
    branch): the same numbers, with a flat [HV * K] dt_bias and bf16 logits."""
    inputs = make_inputs(rng, B=2, T=23, H=1, HV=2, K=8, V=8, f_dtype=jnp.bfloat16)
    weights = loss_weights(rng, inputs)
    kw = dict(lower_bound=LOWER_BOUND[gate], impl="xla", chunk_size=8)
    assert_same(value_and_grads(inputs, weights, gate_in_op=True, flat_dt_bias=True, **kw),
                value_and_grads(inputs, weights, gate_in_op=False, **kw), 1e-6, gate,
                inputs=inputs, lower_bound=kw["lower_bound"])


def test_packed_documents_with_the_guard_keep_a_nan_inside_its_document(rng):
    """With segment_ids and isolate_documents, the gate runs before the guard: a NaN logit in
    one document leaves the other documents' outputs finite and exact."""
    q, k, v, f, beta, A_log, dt_bias = make_inputs(rng, B=1, T=24, K=8, V=8)
    seg = jnp.asarray(np.repeat([[0, 1]], 12, axis=1))
    kw = dict(lower_bound=-5.0, impl="xla", chunk_size=8, segment_ids=seg)
    o_ref, _ = compiled(lambda f: kda(q, k, v, kda_gate(f, A_log, dt_bias, -5.0), beta, **kw),
                        f)(f)
    f_bad = f.at[0, 15, 1, 3].set(jnp.nan)
    o, _ = compiled(lambda f: kda(q, k, v, f, beta, A_log=A_log, dt_bias=dt_bias, **kw), f)(f_bad)
    np.testing.assert_allclose(o[:, :12], o_ref[:, :12], rtol=1e-6, atol=1e-6)
    assert bool(jnp.all(jnp.isnan(o[:, 15:, 1]))) and bool(jnp.all(jnp.isfinite(o[:, :15])))


def test_kernel_gate_stays_within_the_bound_for_extreme_logits(rng):
    """The log-decay the forward kernel computes (read back from the cumulative gate G it saves
    for the backward) lies in [lower_bound, 0] for |f| = 30 and A = e^5, padding rows included
    (g = 0 there, so the chunk's last row carries the last real token's G)."""
    B, T, H, HV, K, V, C = 1, 21, 1, 2, 16, 16, 16
    q, k, v, f, beta, A_log, dt_bias = make_inputs(rng, B=B, T=T, H=H, HV=HV, K=K, V=V,
                                                   extreme=True)
    cfg = pk.make_config(q, v, scale=K ** -0.5, segment_ids=None, chunk_size=C, lower_bound=-5.0,
                         mode="interpret", tuning=KernelTuning(), gate_in_kernel=True)
    args = (*pk._prep(q, k, v, f, beta, None, cfg), pk._gate_params(A_log, dt_bias, cfg))
    G = compiled(lambda *a: calls.intra_fwd(cfg, *a, residuals=True), *args)(*args)[-3]
    G = np.asarray(G, np.float64).reshape(HV, cfg.N * C, K)  # [B*HV, N, C, K], B = 1
    g = np.diff(G.reshape(HV, cfg.N, C, K), axis=2, prepend=0.0).reshape(HV, -1, K)
    assert np.all(np.isfinite(G)) and g.max() <= 1e-4 and g.min() >= -5.0 - 1e-4, g.min()
    assert np.all(g[:, T:] == 0.0)  # padding rows
    g_ref = np.swapaxes(np.asarray(kda_gate(f, A_log, dt_bias, -5.0))[0], 0, 1)  # [HV, T, K]
    np.testing.assert_allclose(g[:, :T], g_ref, atol=5e-5)


def test_bad_gate_parameters_are_named(rng):
    q, k, v, f, beta, A_log, dt_bias = make_inputs(rng, T=5, HV=2, K=16)
    with pytest.raises(ValueError, match=r"kda: A_log must be \[HV\] = \(2,\) \(one per value "
                                         r"head\), got \(3,\)"):
        kda(q, k, v, f, beta, A_log=jnp.zeros(3), dt_bias=dt_bias)
    with pytest.raises(ValueError, match=r"kda: dt_bias must be \[HV, K\] = \(2, 16\) or flat "
                                         r"\[HV \* K\] = \(32,\), got \(16, 2\)"):
        kda(q, k, v, f, beta, A_log=A_log, dt_bias=dt_bias.T)
    with pytest.raises(ValueError, match="kda: A_log was given without dt_bias"):
        kda(q, k, v, f, beta, A_log=A_log)
    with pytest.raises(ValueError, match="kda: A_log must be a floating dtype, got int32"):
        kda(q, k, v, f, beta, A_log=jnp.zeros(2, jnp.int32), dt_bias=dt_bias)


def test_gated_kernels_lower_for_gpu_and_tpu():
    """Forward and backward with the gate in the kernel lower to Triton and to Mosaic from the
    CPU (the prologue's exp, log1p and masks included), both gate forms."""
    B, T, H, HV, K, V = 1, 70, 1, 2, 128, 128
    rng = np.random.default_rng(0)
    q, k, v, f, beta, A_log, dt_bias = make_inputs(rng, B=B, T=T, H=H, HV=HV, K=K, V=V,
                                                   f_dtype=jnp.bfloat16)
    for backend, platform in (("gpu", "cuda"), ("tpu", "tpu")):
        for lb in (-5.0, None):
            def loss(q, k, v, f, beta, A_log, dt_bias, backend=backend, lb=lb):
                o, S = pk.kda_pallas(q, k, v, f, beta, scale=0.1, initial_state=None,
                                     segment_ids=None, chunk_size=64, lower_bound=lb,
                                     backend=backend, A_log=A_log, dt_bias=dt_bias)
                return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)

            grad = jax.jit(jax.grad(loss, argnums=range(7)))
            with as_if_on_h200():  # newer JAX: the card Triton kernels are for
                text = grad.trace(q, k, v, f, beta, A_log, dt_bias).lower(
                    lowering_platforms=(platform,)).as_text()
            assert text.count("custom_call") >= 4, (backend, lb)
