"""The Pallas KDA kernel against the definition: forward, final state and every gradient.

Backends: "interpret" (the GPU kernels in Pallas interpret mode) and "tpu_interpret" (the TPU
kernels in TPU interpret mode) run everywhere; "gpu" (compiled Pallas-Triton) is added when a
GPU is present. Every kernel output is poisoned with NaN before the call (``poison=True``),
so an element a kernel never writes fails the finiteness checks.

Tolerances, relative ||x - ref|| / ||ref||: float32 arithmetic (CPU interpret) 1e-5 against a
float64 NumPy recurrence; bf16 inputs 5e-3. On GPU the in-kernel dots use bf16/tf32 tensor
cores, so GPU runs are held to fla's test tolerances: 5e-3 outputs, 8e-3 dq/dk/dv, 2e-2 dg/dbeta.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from kimi_k3.ops.kda import kda
from kimi_k3.ops.kda_recurrent import kda_recurrent
from pallas_kernels import kda as pk
from pallas_kernels import kda_calls as calls
from pallas_kernels import triton_report
from pallas_kernels.kda import kda_pallas
from pallas_kernels.tuning import KernelTuning
from tests.helpers import fast_jit
from tests.kda_numpy import kda_numpy, rel_err

ON_GPU = jax.default_backend() == "gpu"
GPU = ["gpu"] if ON_GPU else []
# TPU interpret mode is slow on CPU: it runs a subset of the cases (both gate paths, segments).
ALL, NO_TPU = ["interpret", "tpu_interpret", *GPU], ["interpret", *GPU]
HIGHEST = jax.lax.Precision.HIGHEST
GRAD_NAMES = ("q", "k", "v", "g", "beta", "h0")


# ----------------------------------------------------------------------------- references


def float64_grads(q, k, v, g, beta, h0, seg, o_w, S_w, scale):
    """The gradients of sum(o * o_w) + sum(S * S_w) in q, k, v, g, beta, h0 through the
    recurrence of ``kda_numpy``, in float64: jax.grad of a token-by-token scan under x64.
    Returns NumPy float64 arrays."""
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, g, beta, h0)]
        B, T, H, _ = args[0].shape
        G = args[2].shape[2] // H
        starts = np.zeros((B, T), bool) if seg is None else np.concatenate(
            [np.zeros((B, 1), bool), np.diff(np.asarray(seg), axis=1) != 0], axis=1)
        o_w, S_w = (jnp.asarray(np.asarray(x, np.float64)) for x in (o_w, S_w))

        def loss(q, k, v, g, beta, h0):
            def step(S_BxHVxKxV, xs):
                qt, kt, vt, gt, bt, start = xs
                S = jnp.where(start[:, None, None, None], 0.0, S_BxHVxKxV)
                S = jnp.exp(gt)[..., None] * S
                err = vt - jnp.einsum("bhkv,bhk->bhv", S, kt)
                S = S + bt[..., None, None] * kt[..., None] * err[:, :, None, :]
                return S, jnp.einsum("bhkv,bhk->bhv", S, scale * qt)

            q, k = (jnp.repeat(x, G, axis=2) for x in (q, k))
            xs = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, jnp.asarray(starts))]
            S, o = jax.lax.scan(step, h0, xs)
            return jnp.sum(jnp.moveaxis(o, 0, 1) * o_w) + jnp.sum(S * S_w)

        return [np.asarray(x) for x in jax.jit(jax.grad(loss, argnums=range(6)))(*args)]


def make_inputs(seed, B, T, H, HV, K, V, *, gate="bounded", dtype=jnp.float32):
    rng = np.random.default_rng(seed)

    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q, k = unit((B, T, H, K)), unit((B, T, H, K))
    v = rng.standard_normal((B, T, HV, V))
    if gate == "bounded":  # K3's gate: -5 sigmoid(.)
        g = -5.0 / (1.0 + np.exp(-2.0 * rng.standard_normal((B, T, HV, K))))
    elif gate == "softplus":  # Kimi Linear's: -exp(A) softplus(.), unbounded
        g = -np.exp(0.5 * rng.standard_normal((1, 1, HV, 1))) * np.log1p(
            np.exp(rng.standard_normal((B, T, HV, K)) - 2.0))
    else:  # extreme: half the channels near -1000 per step, the rest near 0
        g = np.where(np.arange(K) % 2 == 0, -1000.0 + rng.standard_normal((B, T, HV, K)),
                     -1e-3 * rng.random((B, T, HV, K)))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, HV))))
    h0 = 0.3 * rng.standard_normal((B, HV, K, V))
    arrs = [jnp.asarray(x, dtype) for x in (q, k, v, g, beta)]
    return arrs + [jnp.asarray(h0, jnp.float32)]


def segments(B, T, seed):
    """Packed documents: a few random cut points per row, ids increasing."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((B, T), np.int32)
    for b in range(B):
        cuts = rng.choice(np.arange(1, T), size=min(3, T - 1), replace=False) if T > 1 else []
        for c in cuts:
            seg[b, c:] += 1
    return jnp.asarray(seg)


def run_pallas(backend, q, k, v, g, beta, h0, *, seg=None, lower_bound=-5.0, chunk_size=64,
               tuning=None):
    return kda_pallas(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=h0,
                      segment_ids=seg, chunk_size=chunk_size, lower_bound=lower_bound,
                      backend=backend, tuning=tuning, poison=True)


def fwd_tol(backend, dtype):
    if backend == "gpu":
        return 5e-3
    return 5e-3 if dtype == jnp.bfloat16 else 1e-5


def grad_tols(backend):
    if backend == "gpu":
        return dict(q=8e-3, k=8e-3, v=8e-3, g=2e-2, beta=2e-2, h0=8e-3)
    return dict.fromkeys(GRAD_NAMES, 1e-5)


def loss_fn(fn, o_w, S_w):
    def loss(q, k, v, g, beta, h0):
        o, S = fn(q, k, v, g, beta, h0)
        return jnp.sum(o.astype(jnp.float32) * o_w) + jnp.sum(S * S_w)
    return loss


def check_grads(backend, inputs, *, seg, lower_bound, chunk_size, names=GRAD_NAMES):
    q = inputs[0]
    scale = q.shape[-1] ** -0.5
    rng = np.random.default_rng(7)
    B, T, HV, V = inputs[2].shape
    o_w = jnp.asarray(rng.standard_normal((B, T, HV, V)), jnp.float32)
    S_w = jnp.asarray(rng.standard_normal(inputs[5].shape), jnp.float32)

    def ours(q, k, v, g, beta, h0):
        return run_pallas(backend, q, k, v, g, beta, h0, seg=seg, lower_bound=lower_bound,
                          chunk_size=chunk_size)

    def ref(q, k, v, g, beta, h0):
        with jax.default_matmul_precision("highest"):
            return kda_recurrent(q, k, v, g, beta, scale=scale, initial_state_BxHVxKxV=h0,
                                 segment_ids_BxT=seg)

    f32_inputs = [x.astype(jnp.float32) for x in inputs]
    got = fast_jit(jax.grad(loss_fn(ours, o_w, S_w), argnums=range(6)))(*inputs)
    # Jitted: the recurrence's gradient run eagerly dispatches (and compiles) op by op, several
    # times slower than compiling it whole.
    want = fast_jit(jax.grad(loss_fn(ref, o_w, S_w), argnums=range(6)))(*f32_inputs)
    tols = grad_tols(backend)
    for name, a, b in zip(GRAD_NAMES, got, want, strict=True):
        assert bool(jnp.all(jnp.isfinite(a))), f"{backend}: d{name} not finite (unwritten?)"
        if name in names:
            err = rel_err(a, b)
            assert err < tols[name], f"{backend}: d{name} rel err {err:.2e} > {tols[name]}"


# ----------------------------------------------------------------------------- forward


FWD_CASES = [  # (T, H, HV, K, V, gate, lower_bound, chunk_size, segments), backends
    ((1, 1, 1, 16, 16, "bounded", -5.0, 64, False), NO_TPU),
    ((63, 1, 2, 32, 16, "softplus", None, 64, False), ALL),
    ((64, 2, 2, 16, 32, "bounded", -5.0, 64, True), NO_TPU),
    ((100, 1, 2, 16, 16, "bounded", -5.0, 32, True), ALL),
    ((100, 1, 1, 32, 32, "softplus", None, 16, True), NO_TPU),
]


def _cases(cases):
    return [pytest.param(backend, case, id=f"{backend}-T{case[0]}-{case[5]}-C{case[7]}-"
                         f"seg{case[8]:d}") for case, backends in cases for backend in backends]


@pytest.mark.parametrize(("backend", "case"), _cases(FWD_CASES))
def test_forward_matches_float64_recurrence(backend, case):
    T, H, HV, K, V, gate, lb, C, use_seg = case
    B = 2
    q, k, v, g, beta, h0 = make_inputs(T * 7 + K, B, T, H, HV, K, V, gate=gate)
    seg = segments(B, T, seed=T) if use_seg else None
    o, S = run_pallas(backend, q, k, v, g, beta, h0, seg=seg, lower_bound=lb, chunk_size=C)
    assert o.shape == (B, T, HV, V) and S.shape == (B, HV, K, V) and S.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(S))), "unwritten output"
    o_ref, S_ref = kda_numpy(q, k, v, g, beta, scale=K ** -0.5, initial_state=h0,
                             segment_ids=None if seg is None else np.asarray(seg))
    tol = fwd_tol(backend, jnp.float32)
    assert rel_err(o, o_ref) < tol, rel_err(o, o_ref)
    assert rel_err(S, S_ref) < tol, rel_err(S, S_ref)


@pytest.mark.parametrize("backend", NO_TPU)
def test_forward_long_sequence(backend):
    """T = 1000: many chunks, a partial last one, bounded-gate tensor-core path."""
    B, T, H, HV, K, V = 1, 1000, 1, 1, 16, 16
    q, k, v, g, beta, h0 = make_inputs(3, B, T, H, HV, K, V)
    o, S = run_pallas(backend, q, k, v, g, beta, h0)
    o_ref, S_ref = kda_numpy(q, k, v, g, beta, scale=K ** -0.5, initial_state=h0)
    assert rel_err(o, o_ref) < fwd_tol(backend, jnp.float32)
    assert rel_err(S, S_ref) < fwd_tol(backend, jnp.float32)


@pytest.mark.parametrize("backend", NO_TPU)
def test_forward_bf16_inputs(backend):
    B, T, H, HV, K, V = 2, 100, 2, 2, 32, 32
    q, k, v, g, beta, h0 = make_inputs(5, B, T, H, HV, K, V, dtype=jnp.bfloat16)
    o, S = run_pallas(backend, q, k, v, g, beta, h0)
    assert o.dtype == jnp.bfloat16
    o_ref, S_ref = kda_numpy(*(x.astype(jnp.float32) for x in (q, k, v, g, beta)),
                             scale=K ** -0.5, initial_state=h0)
    assert rel_err(o, o_ref) < 5e-3, rel_err(o, o_ref)
    assert rel_err(S, S_ref) < 5e-3, rel_err(S, S_ref)


def test_public_api_dispatches_to_kernel():
    """kda(..., impl="pallas") runs the kernel (interpret mode on CPU) and casts to v's dtype."""
    B, T, H, HV, K, V = 1, 40, 1, 1, 16, 16
    q, k, v, g, beta, h0 = make_inputs(11, B, T, H, HV, K, V)
    o, S = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, lower_bound=-5.0,
               impl="pallas", chunk_size=16)
    o_ref, S_ref = kda_numpy(q, k, v, g, beta, scale=K ** -0.5, initial_state=h0)
    assert o.dtype == v.dtype
    assert rel_err(o, o_ref) < fwd_tol("gpu" if ON_GPU else "interpret", jnp.float32)
    assert rel_err(S, S_ref) < fwd_tol("gpu" if ON_GPU else "interpret", jnp.float32)


@pytest.mark.parametrize("backend", ALL)
def test_forward_stable_for_agreeing_keys_and_slow_decay(backend, rng):
    """Keys that (nearly) agree and gates near 0 make L = Diag(beta) Akk close to the all-ones
    triangle, where inverting I + L by repeated squaring of the whole chunk cancels entries near
    1e18 (it returned outputs ~1e30 here, and NaN in GPU training). Held to the float64
    recurrence like any other input."""
    B, T, H, HV, K, V = 1, 130, 1, 1, 32, 32

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    k = unit(unit(rng.standard_normal((B, 1, H, K))) + 0.02 * rng.standard_normal((B, T, H, K)))
    q = unit(rng.standard_normal((B, T, H, K)))
    v = rng.standard_normal((B, T, HV, V))
    g = -1e-4 * rng.random((B, T, HV, K))
    beta = 1.0 - 0.01 * rng.random((B, T, HV))
    h0 = 0.3 * rng.standard_normal((B, HV, K, V))
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)]
    o, S = run_pallas(backend, *args, jnp.asarray(h0, jnp.float32), lower_bound=-5.0)
    o_ref, S_ref = kda_numpy(q, k, v, g, beta, scale=K ** -0.5, initial_state=h0)
    assert rel_err(o, o_ref) < fwd_tol(backend, jnp.float32)
    assert rel_err(S, S_ref) < fwd_tol(backend, jnp.float32)


@pytest.mark.parametrize("backend", ["interpret", "tpu_interpret"])
def test_forward_residuals_for_the_backward(backend):
    """What the forward saves for the backward, per chunk, against float64 NumPy from the
    definitions: G = chunk-local cumsum of g, Akk_ij = sum_d k_id k_jd exp(G_id - G_jd) for
    j < i in one segment (else 0), Tinv = (I + Diag(beta) Akk)^-1."""
    B, T, H, HV, K, V, C = 1, 100, 1, 2, 16, 16, 32
    q, k, v, g, beta, _ = make_inputs(23, B, T, H, HV, K, V)
    seg = segments(B, T, 5)
    cfg = pk.make_config(q, v, scale=K ** -0.5, segment_ids=seg, chunk_size=C, lower_bound=-5.0,
                         mode=backend, tuning=KernelTuning(), poison=True)
    *_, G, Akk, Tinv = calls.intra_fwd(cfg, *pk._prep(q, k, v, g, beta, seg, cfg),
                                       residuals=True)
    N = cfg.N
    pad = N * C - T
    kk = np.pad(np.asarray(k, np.float64), [(0, 0), (0, pad), (0, 0), (0, 0)])
    gg = np.pad(np.asarray(g, np.float64), [(0, 0), (0, pad), (0, 0), (0, 0)])
    bb = np.pad(np.asarray(beta, np.float64), [(0, 0), (0, pad), (0, 0)])
    ss = np.pad(np.asarray(seg), [(0, 0), (0, pad)], mode="edge")
    for hv in range(HV):
        for n in range(N):
            rows = slice(n * C, (n + 1) * C)
            G_ref = np.cumsum(gg[0, rows, hv], axis=0)  # [C, K]
            kc = kk[0, rows, hv // (HV // H)]
            E = np.exp(np.minimum(G_ref[:, None, :] - G_ref[None, :, :], 0.0))
            A_ref = np.einsum("id,jd,ijd->ij", kc, kc, E)
            sc = ss[0, rows]
            A_ref *= np.tril(np.ones((C, C)), -1) * (sc[:, None] == sc[None, :])
            T_ref = np.linalg.inv(np.eye(C) + bb[0, rows, hv][:, None] * A_ref)
            i = hv  # B = 1: the kernel's leading axis is the value head
            assert rel_err(G[i, n], G_ref) < 1e-6, (hv, n)
            assert rel_err(Akk[i, n], A_ref) < 1e-5, (hv, n)
            assert rel_err(Tinv[i, n], T_ref) < 1e-5, (hv, n)


# ----------------------------------------------------------------------------- gradients


GRAD_CASES = [  # (T, H, HV, K, V, gate, lower_bound, chunk_size, segments), backends
    ((100, 1, 2, 16, 32, "bounded", -5.0, 64, True), ALL),
    ((63, 1, 2, 16, 16, "softplus", None, 32, False), NO_TPU),
    # K = 48 pads to 64 = two K slices of 32: the per-slice backward kernel and its padding
    ((70, 1, 1, 48, 24, "bounded", -5.0, 32, True), NO_TPU),
]


@pytest.mark.parametrize(("backend", "case"), _cases(GRAD_CASES))
def test_gradients_match_reference(backend, case):
    T, H, HV, K, V, gate, lb, C, use_seg = case
    B = 2
    inputs = make_inputs(T + 1, B, T, H, HV, K, V, gate=gate)
    seg = segments(B, T, seed=T + 2) if use_seg else None
    check_grads(backend, inputs, seg=seg, lower_bound=lb, chunk_size=C)


@pytest.mark.parametrize("backend", NO_TPU)
def test_reverse_cumsum_in_two_bf16_passes(backend):
    """With bf16 inputs, intra_bwd_channels' reverse cumsum of dG takes dG as bf16 hi + lo
    (``kda_body.reverse_cumsum``; one bf16 pass, dG's hi alone, moved dg by 2.4e-2 of its norm
    from the exact form, which the bound rejects): the gradients stay within
    test_gradients_bf16_inputs' tolerances of the definition. Packed documents, T not a
    multiple of the chunk, a float32 gate (dg float32)."""
    B, T, H, HV, K, V = 2, 75, 1, 2, 32, 32
    rng = np.random.default_rng()
    q, k, v, g, beta, h0 = make_inputs(int(rng.integers(1 << 30)), B, T, H, HV, K, V,
                                       dtype=jnp.bfloat16)
    g = g.astype(jnp.float32)
    seg = segments(B, T, seed=int(rng.integers(1 << 30)))
    if backend == "interpret":  # as in test_gradients_bf16_inputs
        q, k, v, g, beta, h0 = jax.device_put((q, k, v, g, beta, h0), jax.devices("cpu")[0])
    o_w = jnp.asarray(rng.standard_normal((B, T, HV, V)), jnp.float32)
    S_w = jnp.asarray(rng.standard_normal(h0.shape), jnp.float32)
    run = functools.partial(run_pallas, backend, seg=seg, chunk_size=32,
                            tuning=KernelTuning(bk=16))
    split = fast_jit(jax.grad(loss_fn(run, o_w, S_w), argnums=range(6)))(q, k, v, g, beta, h0)
    ref = lambda q, k, v, g, beta, h0: kda_recurrent(
        q, k, v, g, beta, scale=K ** -0.5, initial_state_BxHVxKxV=h0, segment_ids_BxT=seg)
    with jax.default_matmul_precision("highest"):
        want = fast_jit(jax.grad(loss_fn(ref, o_w, S_w), argnums=range(6)))(
            *(x.astype(jnp.float32) for x in (q, k, v, g, beta, h0)))
    tols = grad_tols("gpu")  # fla's, as test_gradients_bf16_inputs
    for name, a, b in zip(GRAD_NAMES, split, want, strict=True):
        assert bool(jnp.all(jnp.isfinite(a))), name
        assert rel_err(a, b) < tols[name], (name, rel_err(a, b))


@pytest.mark.parametrize("backend", NO_TPU)
def test_gradients_bf16_inputs(backend):
    """bf16 inputs: gradients come back in the inputs' dtypes and within fla's tolerances."""
    B, T, H, HV, K, V = 1, 64, 1, 1, 32, 32
    inputs = make_inputs(13, B, T, H, HV, K, V, dtype=jnp.bfloat16)
    # The interpreter runs on the CPU even on a GPU host: there XLA's GPU compiler gave the
    # interpreted kernel other float32 numerics (dg 0.030 from the reference, "highest"
    # precision or not), which are neither the CPU's nor the compiled kernel's.
    if backend == "interpret":
        inputs = jax.device_put(inputs, jax.devices("cpu")[0])

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a)[0].astype(jnp.float32))

    ref_fn = lambda q, k, v, g, b, h: kda_recurrent(
        q, k, v, g, b, scale=K ** -0.5, initial_state_BxHVxKxV=h, segment_ids_BxT=None)
    # Full float32 matmuls for the reference (TF32 by default on a GPU); the compiled kernels
    # set their own precision.
    with jax.default_matmul_precision("highest"):
        got = fast_jit(jax.grad(loss(lambda *a: run_pallas(backend, *a)), argnums=range(6)))(
            *inputs)
        want = fast_jit(jax.grad(loss(ref_fn), argnums=range(6)))(
            *(x.astype(jnp.float32) for x in inputs))
    tols = grad_tols("gpu")  # fla's tolerances, whatever the backend
    for name, a, b, x in zip(GRAD_NAMES, got, want, inputs, strict=True):
        assert a.dtype == x.dtype, name
        assert rel_err(a, b) < tols[name], (name, rel_err(a, b))


@pytest.mark.parametrize("backend", NO_TPU)
def test_extreme_gates_finite_and_exact(backend):
    """Channels near -1000 per step next to channels near 0, no bound: the safe path stays finite
    and matches the definition."""
    B, T, H, HV, K, V = 1, 50, 1, 1, 16, 16
    inputs = make_inputs(17, B, T, H, HV, K, V, gate="extreme")
    o, S = run_pallas(backend, *inputs, lower_bound=None, chunk_size=32)
    o_ref, S_ref = kda_numpy(*inputs[:5], scale=K ** -0.5, initial_state=inputs[5])
    assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(S)))
    assert rel_err(o, o_ref) < fwd_tol(backend, jnp.float32)
    check_grads(backend, inputs, seg=None, lower_bound=None, chunk_size=32)


# ----------------------------------------------------------------------------- plumbing


def test_lowers_for_gpu_and_tpu():
    """The compiled kernels (forward and backward) lower to Triton and to Mosaic from CPU: this
    catches lowering-rule and shape limits (power-of-two blocks, dot sizes) without a device."""
    B, T, H, HV, K, V = 1, 130, 1, 2, 128, 128
    q, k, v, g, beta, h0 = make_inputs(19, B, T, H, HV, K, V, dtype=jnp.bfloat16)
    seg = segments(B, T, 1)
    for backend, platform in (("gpu", "cuda"), ("tpu", "tpu")):
        # the bounded gate (score blocks around their midpoints) and the unbounded one (exact
        # diagonal blocks), with and without packed documents
        for lb, s in ((-5.0, None), (None, seg), (-5.0, seg)):
            def loss(q, k, v, g, beta, h0, backend=backend, lb=lb, s=s):
                o, S = kda_pallas(q, k, v, g, beta, scale=0.1, initial_state=h0,
                                  segment_ids=s, chunk_size=64, lower_bound=lb,
                                  backend=backend)
                return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)

            grad = jax.jit(jax.grad(loss, argnums=range(6)))
            with triton_report.as_if_on_h200():  # newer JAX: the card Triton kernels are for
                text = grad.trace(q, k, v, g, beta, h0).lower(
                    lowering_platforms=(platform,)).as_text()
            assert text.count("custom_call") >= 4, (backend, lb)


def test_float64_gradients_match_finite_differences_of_kda_numpy():
    """The float64 gradient reference (``float64_grads``) against central differences of
    ``kda_numpy``'s loss along a random direction per input, with two documents in a row and
    grouped value heads."""
    B, T, H, HV, K, V = 1, 7, 1, 2, 4, 3
    rng = np.random.default_rng()
    q, k, v, g, beta, h0 = (np.asarray(x, np.float64) for x in make_inputs(
        int(rng.integers(1 << 30)), B, T, H, HV, K, V))
    seg = np.asarray([[0, 0, 0, 1, 1, 1, 1]])
    o_w, S_w = rng.standard_normal((B, T, HV, V)), rng.standard_normal(h0.shape)

    def loss(q, k, v, g, beta, h0):
        o, S = kda_numpy(q, k, v, g, beta, scale=0.5, initial_state=h0, segment_ids=seg)
        return float(np.sum(o * o_w) + np.sum(S * S_w))

    grads = float64_grads(q, k, v, g, beta, h0, seg, o_w, S_w, 0.5)
    args = [q, k, v, g, beta, h0]
    for i, name in enumerate(GRAD_NAMES):
        d = rng.standard_normal(args[i].shape)
        eps = 1e-5
        plus, minus = list(args), list(args)
        plus[i], minus[i] = args[i] + eps * d, args[i] - eps * d
        fd = (loss(*plus) - loss(*minus)) / (2 * eps)
        assert abs(fd - np.sum(grads[i] * d)) < 1e-6 * max(1.0, abs(fd)), name


def inputs_at_the_bound(B, T, H, HV, K, V):
    """(seed, make_inputs' six arrays, segment ids): fresh random inputs with every third key
    channel exactly at the bound (-5) and packed documents, where the factored scores'
    exponents are largest."""
    seed = int(np.random.default_rng().integers(1 << 30))
    q, k, v, g, beta, h0 = make_inputs(seed, B, T, H, HV, K, V)
    g = jnp.where(jnp.arange(K) % 3 == 0, -5.0, g)
    return seed, (q, k, v, g, beta, h0), segments(B, T, seed=seed + 1)


def random_cotangent(out, seed):
    """Standard normal cotangents for (o, final state), o's in its dtype, from ``seed``."""
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(out[0].shape), out[0].dtype),
            jnp.asarray(rng.standard_normal(out[1].shape), jnp.float32))


def interpret_config(q, v, seg, C, lower_bound, tuning):
    """The KdaConfig of an interpret-mode call (make_config), to read the blocks it chose."""
    return pk.make_config(q, v, scale=1.0, segment_ids=seg, chunk_size=C,
                          lower_bound=lower_bound, mode="interpret", tuning=tuning)


def run_blocks(backend, q, k, v, g, beta, h0, *, seg, chunk_size=64, lower_bound=-5.0,
               tuning=None, **blocks):
    """``run_pallas`` with the score blocks make_config chose replaced by ``blocks`` (KdaConfig's
    fwd_rows, fwd_mid, bwd_rows): fwd_rows=cfg.sub, fwd_mid=0 (forward) and bwd_rows=0
    (backward) give the sub-chunks anchored at their first row, which make_config takes only
    where the midpoint would not make the blocks taller, so that the two forms of one call
    can be compared."""
    cfg = pk.make_config(q, v, scale=q.shape[-1] ** -0.5, segment_ids=seg,
                         chunk_size=chunk_size, lower_bound=lower_bound, mode=backend,
                         tuning=tuning or KernelTuning(), poison=True)
    blocks = {name: cfg.sub if value == "sub" else value for name, value in blocks.items()}
    cfg = dataclasses.replace(cfg, **blocks)
    seg = None if seg is None else seg.astype(jnp.int32)
    return pk._kda(q, k, v, g, beta, h0.astype(jnp.float32), seg, (), cfg)


@pytest.mark.parametrize("backend", ALL)
def test_mid_anchored_scores_match_the_definition(backend):
    """The forward's score blocks around their midpoints (make_config's, for a bounded gate):
    twice as tall (32 rows at lower_bound = -5, C = 64), each diagonal block factored around
    the midpoint of G over it and the blocks before it through its first row. Every third key
    channel sits exactly at the bound, so a block's first row has a row factor of e^77.5, the
    largest there is. Checked against the float64 recurrence (forward) and against sub-chunks
    anchored at their first row (``run_blocks``: forward and every gradient), with packed
    documents and T not a multiple of the chunk; a lower bound that already gives whole-chunk
    blocks leaves the blocks as they are."""
    B, T, H, HV, K, V, C = 1, 150, 1, 2, 32, 16, 64
    seed, (q, k, v, g, beta, h0), seg = inputs_at_the_bound(B, T, H, HV, K, V)
    narrow = KernelTuning(bk=16, bk_fwd=16)  # two K slices too
    config = functools.partial(interpret_config, q, v, seg, C)

    assert (config(-5.0, narrow).fwd_rows, config(-5.0, narrow).fwd_mid) == (32, 1)
    assert (config(-2.5, narrow).fwd_rows, config(-2.5, narrow).fwd_mid) == (64, 1)
    assert config(-1.0, narrow).fwd_mid == 0 and config(-5.0, KernelTuning()).fwd_mid == 1

    def out_and_grads(**blocks):
        def fn(q, k, v, g, beta, h0):
            return run_blocks(backend, q, k, v, g, beta, h0, seg=seg, chunk_size=C,
                              tuning=narrow, **blocks)

        def run(cot, *args):
            out, vjp = jax.vjp(fn, *args)
            return [*out, *vjp(cot)]
        # Jitted: eagerly, every op of the forward and the backward is a program of its own,
        # compiled on first use (several times slower).
        cot = random_cotangent(jax.eval_shape(fn, q, k, v, g, beta, h0), seed)
        return fast_jit(run)(cot, q, k, v, g, beta, h0)

    got = out_and_grads()
    o_ref, S_ref = kda_numpy(q, k, v, g, beta, scale=K ** -0.5, initial_state=h0,
                             segment_ids=np.asarray(seg))
    # The chunk's cumulative gate reaches C |lower_bound| = 320 on the channels at the bound,
    # where a float32 has a spacing of 3e-5: every decay factor exp(G_i - G_j) the blocks
    # multiply carries that much relative error (the row-by-row recurrence does not), so the
    # float32 forward at the bound is held to 5e-5 rather than 1e-5 (seen: 1e-6 to 2e-5).
    tol = max(fwd_tol(backend, q.dtype), 5e-5)
    assert rel_err(got[0], o_ref) < tol and rel_err(got[1], S_ref) < tol, (
        rel_err(got[0], o_ref), tol)
    sub_chunks = out_and_grads(fwd_rows="sub", fwd_mid=0)
    for name, a, b in zip(("o", "S", *GRAD_NAMES), got, sub_chunks, strict=True):
        assert bool(jnp.all(jnp.isfinite(a))), f"{backend}: {name} not finite"
        # the two factorings carry that spacing differently: 5e-5 as against the definition
        assert rel_err(a, b) < (5e-5 if backend != "gpu" else 5e-3), (backend, name,
                                                                      rel_err(a, b))


@pytest.mark.parametrize("mid_bwd", [0, 1], ids=["sub-chunks", "mid-blocks"])
@pytest.mark.parametrize("backend", ALL)
def test_gradients_of_a_small_cotangent_are_scaled_exactly(backend, mid_bwd):
    """The backward is linear in the cotangent, and scaling by a power of two rounds nothing:
    a cotangent times 2^-24 (the size of a mean loss's gradients over millions of tokens) must
    give every gradient times 2^-24. Every third key channel sits at the bound, where the
    backward's column side factors e^(G_i - G_j) into e^-75 and e^75 (around a 32-row block's
    midpoint, make_config's blocks, e^-77.5 and e^77.5 on both sides): without dA's rows
    scaled to O(1), those products of small gradients fall under float32's smallest normal and
    are flushed (dk and dg several percent off on CPU). Both forms: the blocks around their
    midpoints and the 16-row sub-chunks (``run_blocks``)."""
    B, T, H, HV, K, V = 1, 150, 1, 2, 32, 16
    seed, (q, k, v, g, beta, h0), seg = inputs_at_the_bound(B, T, H, HV, K, V)
    blocks = {} if mid_bwd else {"bwd_rows": 0}

    def fn(q, k, v, g, beta, h0):
        return run_blocks(backend, q, k, v, g, beta, h0, seg=seg, **blocks)

    cot = random_cotangent(jax.eval_shape(fn, q, k, v, g, beta, h0), seed)
    small = 2.0 ** -24
    # One compiled program for both cotangents (eagerly, every op of the forward and the
    # backward is a program of its own, compiled on first use: several times slower).
    grads_of = fast_jit(lambda cot, *args: jax.vjp(fn, *args)[1](cot))
    grads = grads_of(cot, q, k, v, g, beta, h0)
    grads_small = grads_of(tuple(c * small for c in cot), q, k, v, g, beta, h0)
    tol = 1e-4 if backend == "gpu" else 1e-6
    for name, a, b in zip(GRAD_NAMES, grads_small, grads, strict=True):
        assert rel_err(np.asarray(a, np.float64) / small, b) < tol, (backend, name)


@pytest.mark.parametrize("backend", ALL)
def test_score_gradients_at_the_bound_match_the_float64_recurrence(backend):
    """The backward's pairwise-decay sums at their extreme, both forms: make_config's 32-row
    blocks (diagonal blocks around their midpoints, dA's rows scaled by powers of two) and the
    16-row sub-chunks (``run_blocks``), against the float64 recurrence's gradients, with every
    third key channel at the bound, packed documents and T not a multiple of the chunk; at
    lower_bound = -2.5 the block is the whole chunk.

    At the bound dk and dg lose float32 accuracy: each side's factors e^(+-75) come from G
    (sums of up to 64 gates, so ~3e-5 absolute rounding), and dg takes the difference of the
    two sides. Over 25 seeds the largest errors were dk 8.5e-5 and dg 1.3e-3 for the
    sub-chunks, 9.7e-6 and 2.7e-4 for the taller blocks; q, v, beta, h0 stayed under 5e-5.
    make_config sets the blocks for bounded gates only."""
    B, T, H, HV, K, V, C = 1, 150, 1, 2, 32, 16, 64
    seed, (q, k, v, g, beta, h0), seg = inputs_at_the_bound(B, T, H, HV, K, V)
    narrow = KernelTuning(bk=16)  # two K slices too
    config = functools.partial(interpret_config, q, v, seg, C)
    assert config(-5.0, narrow).bwd_rows == 32 and config(-2.5, narrow).bwd_rows == 64
    assert config(-1.0, narrow).bwd_rows == 0 and config(None, narrow).bwd_rows == 0
    rng = np.random.default_rng(seed)
    o_w = jnp.asarray(rng.standard_normal((B, T, HV, V)), jnp.float32)
    S_w = jnp.asarray(rng.standard_normal(h0.shape), jnp.float32)
    tols = dict.fromkeys(GRAD_NAMES, 1e-4) | {"k": 3e-4, "g": 4e-3}
    if backend == "gpu":
        tols = {name: max(tol, grad_tols(backend)[name]) for name, tol in tols.items()}
    for lb, gate in ((-5.0, g), (-2.5, g / 2)):
        want = float64_grads(q, k, v, gate, beta, h0, seg, o_w, S_w, K ** -0.5)
        for blocks in ({}, {"bwd_rows": 0}):
            fn = functools.partial(run_blocks, backend, seg=seg, chunk_size=C, lower_bound=lb,
                                   tuning=narrow, **blocks)
            got = fast_jit(jax.grad(loss_fn(fn, o_w, S_w), argnums=range(6)))(
                q, k, v, gate, beta, h0)
            for name, a, b in zip(GRAD_NAMES, got, want, strict=True):
                assert bool(jnp.all(jnp.isfinite(a))), (backend, lb, blocks, name)
                assert rel_err(a, b) < tols[name], (backend, lb, blocks, name, rel_err(a, b))


def test_mid_anchored_scores_keep_small_keys_at_the_bound():
    """The forward's diagonal blocks (``kda_body._mid_anchored_diagonal``) at the extreme: one
    key channel decays at the bound on every row (G falls 155 over a 32-row block) and its key
    components are 2e-4. Around the block's midpoint the smallest factor is e^-77.5, so 2e-4
    times it is still a normal float32; through the middle row it would be e^-80 and flushed
    to zero on CPU (subnormal), dropping that channel's terms. Every pair j <= i against
    float64, in plain JAX (the kernel body outside Pallas)."""
    from pallas_kernels import kda_body as body
    C, K = 64, 16
    rng = np.random.default_rng()
    x = rng.standard_normal((C, K)) / np.sqrt(K)
    y = rng.standard_normal((C, K)) / np.sqrt(K)
    g = -5.0 / (1.0 + np.exp(-2.0 * rng.standard_normal((C, K))))
    g[:, 3], x[:, 3], y[:, 3] = -5.0, 0.5, 2e-4 * np.sign(y[:, 3])
    G = np.cumsum(g, axis=0)
    cfg = pk.make_config(jnp.zeros((1, C, 1, K)), jnp.zeros((1, C, 1, K)), scale=1.0,
                         segment_ids=None, chunk_size=C, lower_bound=-5.0, mode="interpret",
                         tuning=KernelTuning())
    assert cfg.fwd_mid and cfg.fwd_rows == 32
    (A,) = jax.jit(lambda x, y, G: body.decayed_scores([x], y, G, C - 1, cfg))(
        *(jnp.asarray(a, jnp.float32) for a in (x, y, G)))
    want = np.einsum("id,jd,ijd->ij", x, y, np.exp(np.minimum(G[:, None] - G[None], 0.0)))
    lower = np.tril(np.ones((C, C), bool))
    got = np.where(lower, np.asarray(A, np.float64), 0.0)
    err = np.abs(got - np.where(lower, want, 0.0))
    # the channel's own terms are 1e-4 (times a decay): a dropped one is an error of that size,
    # float32 rounding ~1e-6 of the O(1) scores
    assert err.max() < 1e-5, (err.max(), np.unravel_index(err.argmax(), err.shape))


def test_w_handoff_lowers_with_its_barrier(tmp_path):
    """The GPU layout's intra_fwd hands W's operand from some threads to others through W's
    buffer (``kda_body.fwd_intra``), which is only safe behind a barrier of the program's
    threads. Interpret mode runs in order and cannot miss it, so this reads the Triton IR of
    intra_fwd lowered for the GPU from CPU: one gpu.barrier."""
    found = triton_report.dump_ttir(str(tmp_path), KernelTuning(), B=1, T=128, H=2, D=128)
    assert Path(found["kda_intra_fwd"]).read_text().count("gpu.barrier") == 1


def test_bad_tuning_is_named():
    """A bad --tune item or value is refused, naming where it came from and the field."""
    with pytest.raises(ValueError, match=r"--tune: expected key=int with key in .* got 'warps=8'"):
        KernelTuning.parse("bk=32,warps=8", source="--tune")
    with pytest.raises(ValueError, match=r"--variants: expected key=int .* got 'bk=x'"):
        KernelTuning.parse("bk=x", source="--variants")
    with pytest.raises(ValueError, match=r"--tune: KernelTuning.bk must be a power of two >= 16, "
                                         r"got 0"):
        KernelTuning.parse("bk=0")
    with pytest.raises(ValueError, match=r"--tune: KernelTuning.bk_fwd must be a power of two "
                                         r">= 16, got 24"):
        KernelTuning.parse("bk_fwd=24")
    with pytest.raises(ValueError, match=r"KernelTuning.warps_seq must be .*, got 3"):
        KernelTuning(warps_seq=3)
    with pytest.raises(ValueError, match=r"KernelTuning.hopper must be -1 \(automatic\), 0 "
                                         r"\(Triton only\) or 1 \(Mosaic GPU\), got True"):
        KernelTuning(hopper=True)
    with pytest.raises(ValueError, match=r"--tune: KernelTuning.mgpu_state must be 0, 1, 2 or 3 "
                                         r"\(automatic\), got 4"):
        KernelTuning.parse("mgpu_state=4")
    assert KernelTuning.parse("") == KernelTuning()
    base = KernelTuning(warps_grad=8)
    assert KernelTuning.parse("bk=16", base=base) == dataclasses.replace(base, bk=16)


def test_tuning_reaches_the_kernels():
    """tuning= is passed down: bk=16 and bk_fwd=16 cut K = 32 into two slices (the forward's
    scores loop then runs as a loop), with the same result."""
    B, T, H, HV, K, V = 2, 50, 1, 2, 32, 16
    q, k, v, g, beta, h0 = make_inputs(29, B, T, H, HV, K, V)
    narrow = KernelTuning(bk=16, bk_fwd=16)
    config = lambda tuning: pk.make_config(q, v, scale=K ** -0.5, segment_ids=None,
                                           chunk_size=32, lower_bound=-5.0, mode="interpret",
                                           tuning=tuning)
    assert config(narrow).bk == 16 and config(KernelTuning()).bk == 32 == K
    # bk_fwd (default 64) is cut to the padded K, like bk
    assert config(narrow).bk_fwd == 16 and config(KernelTuning()).bk_fwd == 32
    assert hash(narrow) == hash(KernelTuning(bk=16, bk_fwd=16))  # static: keys jit caches

    def loops_in_intra_fwd(tuning):  # a K loop of one slice is a plain call, not a loop
        fn = functools.partial(run_pallas, "interpret", chunk_size=32, tuning=tuning)
        kernel = pallas_calls(fn, q, k, v, g, beta, h0)["kda_intra_fwd"]["jaxpr"]
        return sum(eqn.primitive.name in ("scan", "while") for eqn in kernel.eqns)

    assert loops_in_intra_fwd(narrow) > loops_in_intra_fwd(KernelTuning(bk=16)) == \
        loops_in_intra_fwd(KernelTuning(bk=16, bk_fwd=32))
    o, S = run_pallas("interpret", q, k, v, g, beta, h0, chunk_size=32, tuning=narrow)
    o_ref, S_ref = run_pallas("interpret", q, k, v, g, beta, h0, chunk_size=32)
    assert rel_err(o, o_ref) < 1e-6 and rel_err(S, S_ref) < 1e-6
    with pytest.raises(TypeError, match="kda_pallas: tuning must be a KernelTuning"):
        run_pallas("interpret", q, k, v, g, beta, h0, tuning={"bk": 16})


def pallas_calls(fn, *args) -> dict:
    """{Pallas kernel name: its pallas_call's params} of the kernels ``fn(*args)`` traces."""
    from jax.extend.core import jaxprs_in_params

    calls = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                name = eqn.params.get("name_and_src_info", eqn.params.get("name"))
                calls[str(getattr(name, "name", name))] = eqn.params
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return calls


def kernel_grids(fn, *args) -> dict:
    """{Pallas kernel name: its grid} of the kernels ``fn(*args)`` traces."""
    return {name: params["grid_mapping"].grid for name, params in pallas_calls(fn, *args).items()}


@pytest.mark.parametrize("backend", ["interpret", "tpu_interpret"])
def test_channels_grid_walks_the_k_slices_first(backend):
    """intra_bwd_channels' grid is (K slice, B*HV, N) in the GPU layout, the order
    Pallas-Triton launches with the first axis fastest, so a chunk's K slices run together;
    the TPU modes keep (B*HV, N, K slice). (The gradients through the permuted index maps:
    test_gradients_match_reference, two K slices and packed documents.)"""
    B, T, H, HV, K, V, C = 2, 70, 1, 2, 32, 16, 32
    rng = np.random.default_rng()
    q, k, v, g, beta, h0 = make_inputs(int(rng.integers(1 << 30)), B, T, H, HV, K, V)
    seg = segments(B, T, seed=int(rng.integers(1 << 30)))
    o_w = jnp.asarray(rng.standard_normal((B, T, HV, V)), jnp.float32)
    S_w = jnp.asarray(rng.standard_normal(h0.shape), jnp.float32)
    run = functools.partial(run_pallas, backend, seg=seg, chunk_size=C,
                            tuning=KernelTuning(bk=16))
    grid = kernel_grids(jax.grad(loss_fn(run, o_w, S_w), argnums=range(6)),
                        q, k, v, g, beta, h0)["kda_intra_bwd_channels"]
    # K slices: bk = 16 here; the TPU modes take K whole (lanes of 128 or the whole dim)
    BHV, N = B * HV, -(-T // C)
    assert grid == ((K // 16, BHV, N) if backend == "interpret" else (BHV, N, 1))


@pytest.mark.parametrize(("backend", "gate"), [
    *[pytest.param(b, "given", id=f"{b}-given-gate") for b in ALL],
    *[pytest.param(b, g, id=f"{b}-{g}-gate-in-kernel") for b in NO_TPU
      for g in ("softplus", "bounded")]])
def test_kernel_variants_equal_the_defaults(backend, gate):
    """The forward's variants give what the defaults give: output, final state and every
    gradient, with packed documents, two K slices (bk = 16), two sub-chunks per chunk, grouped
    value heads, T not a multiple of the chunk, the bounded gate (anchored diagonal blocks) and
    the softplus gate (exact ones), each gate given or computed in the kernel; and the
    definition within the usual tolerances. Variants: bk_fwd=32 (the forward's scores in one K
    slice, the backward's in two) and, with the gate given, bv_intra=16 (two V tiles in the
    intra-chunk kernels: the backward's part 1 then takes dR_k from dW, part 2 sums -dv S^T
    over the tiles). The TPU modes ignore bk_fwd and bv_intra."""
    B, T, H, HV, K, V, C = 2, 75, 1, 2, 32, 32, 32
    gate_in_kernel = gate != "given"
    lb = None if gate == "softplus" else -5.0
    q, k, v, g, beta, h0 = make_inputs(int(np.random.default_rng().integers(1 << 30)), B, T, H,
                                       HV, K, V, gate="softplus" if gate == "softplus" else "bounded")
    seg = segments(B, T, seed=int(np.random.default_rng().integers(1 << 30)))
    rng = np.random.default_rng()
    A_log = jnp.asarray(0.5 * rng.standard_normal(HV), jnp.float32) if gate_in_kernel else None
    dt_bias = jnp.asarray(rng.standard_normal((HV, K)), jnp.float32) if gate_in_kernel else None
    if gate_in_kernel:  # g becomes the gate's logits f
        g = jnp.asarray(3.0 * rng.standard_normal(g.shape), jnp.float32)
    o_w = jnp.asarray(rng.standard_normal((B, T, HV, V)), jnp.float32)
    S_w = jnp.asarray(rng.standard_normal(h0.shape), jnp.float32)
    narrow = KernelTuning(bk=16, bk_fwd=16)  # the first test above checks bk=16 itself

    def run(**changes):
        def fn(q, k, v, g, beta, h0):
            return kda_pallas(q, k, v, g, beta, scale=K ** -0.5, initial_state=h0,
                              segment_ids=seg, chunk_size=C, lower_bound=lb, backend=backend,
                              tuning=dataclasses.replace(narrow, **changes),
                              poison=True, A_log=A_log, dt_bias=dt_bias)
        def out_and_grads(*args):  # one program: the forward once, its outputs kept
            out, vjp = jax.vjp(fn, *args)
            return [*out, *vjp((o_w.astype(out[0].dtype), S_w))]

        return fast_jit(out_and_grads)(q, k, v, g, beta, h0)

    default = run()
    names = ("o", "S", *(f"d{n}" for n in GRAD_NAMES))
    # bk_fwd=32: the forward in one K slice, the backward in two
    variants = [{"bk_fwd": 32}]
    if gate == "given" and backend not in ("tpu", "tpu_interpret"):
        variants.append({"bv_intra": 16})
    for changes in variants:
        varied = run(**changes)
        # Both variants sum in another order: bv_intra=16 takes dR_k from dW and sums -dv S^T
        # over two tiles, bk_fwd the scores over K in one dot or two (rounding, ~1e-6). On the
        # GPU with float32 inputs (tf32 dots) bk_fwd's sums in another order go through the
        # inverse's single tf32 pass (~1e-4).
        tol = 5e-4 if backend == "gpu" and "bk_fwd" in changes else 1e-5
        for name, a, b in zip(names, varied, default, strict=True):
            assert bool(jnp.all(jnp.isfinite(a))), f"{backend} {changes}: {name} not finite"
            assert rel_err(a, b) < tol, (backend, changes, name, rel_err(a, b))
    # and the definition (the gate applied outside, the token-by-token recurrence)
    if gate == "softplus":
        g_def = -jnp.exp(A_log)[:, None] * jax.nn.softplus(g + dt_bias)
    elif gate == "bounded":
        g_def = lb * jax.nn.sigmoid(jnp.exp(A_log)[:, None] * (g + dt_bias))
    else:
        g_def = g
    with jax.default_matmul_precision("highest"):
        o_ref, S_ref = fast_jit(lambda *a: kda_recurrent(
            *a, scale=K ** -0.5, initial_state_BxHVxKxV=h0, segment_ids_BxT=seg))(
            q, k, v, g_def, beta)
    assert rel_err(varied[0], o_ref) < fwd_tol(backend, q.dtype)
    assert rel_err(varied[1], S_ref) < fwd_tol(backend, q.dtype)


def test_gate_path_selection():
    cfg = lambda lb: pk.make_config(jnp.zeros((1, 64, 1, 16)), jnp.zeros((1, 64, 1, 16)),
                                    scale=1.0, segment_ids=None, chunk_size=64,
                                    lower_bound=lb, mode="interpret",
                                    tuning=KernelTuning())
    assert cfg(-5.0).bounded and cfg(-5.0).sub == 16
    assert cfg(-1.0).bounded and cfg(-1.0).sub == 64  # 63 * 1 <= 80: one anchor per chunk
    assert not cfg(None).bounded and not cfg(-6.0).bounded


def test_poison_detects_unwritten_output():
    """The poison harness itself: a kernel that skips a row leaves NaN behind."""
    x = jax.ShapeDtypeStruct((1, 16, 1, 16), jnp.float32)
    cfg = pk.make_config(x, x, scale=1.0, segment_ids=None, chunk_size=16, lower_bound=-5.0,
                         mode="interpret", tuning=KernelTuning(), poison=True)

    def kernel(x_ref, o_ref):
        rows = jax.lax.broadcasted_iota(jnp.int32, (16, 16), 0)

        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = jnp.where(rows < 15, x_ref[...], o_ref[...])

    spec = pl.BlockSpec((16, 16), lambda i: (0, 0))
    fn = calls._call(kernel, cfg, grid=(1,), in_specs=[spec], out_specs=[spec],
                     out_shape=[jax.ShapeDtypeStruct((16, 16), jnp.float32)], name="probe")
    (out,) = fn(jnp.ones((16, 16), jnp.float32))
    assert bool(jnp.all(jnp.isnan(out[15]))) and bool(jnp.all(out[:15] == 1.0))
