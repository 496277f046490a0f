"""The Mosaic GPU intra_bwd_scores (pallas_kernels/kda_mgpu_bwd.py) and state passes
(pallas_kernels/kda_mgpu_state.py) against the Triton ones, and their dispatch
(``KernelTuning.hopper``: automatic, Triton only, or Mosaic GPU that must run).

Where it runs: on CPU the Mosaic GPU kernels run in Mosaic GPU interpret mode and the Triton
kernels in Pallas interpret mode (both float32 dots on bf16 operands: they agree to rounding);
on a Hopper (sm_90) GPU the Mosaic GPU kernels run compiled (bf16 tensor cores, float32
accumulation) against the Triton kernels in interpret mode, held to bf16 tolerances. Lowering
for CUDA is checked on any machine (it needs no GPU); a Hopper card is faked where the dispatch
asks for one (``tests.helpers.fake_device``).

Inputs are fresh random bf16 per run (the ``rng`` fixture prints the seed of a failure). Sizes
are small: interpret mode is slow on CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import device, kda_mgpu, kda_mgpu_bwd, kda_mgpu_state
from pallas_kernels import kda as pk
from pallas_kernels import kda_calls as calls
from pallas_kernels.kda import kda_pallas
from pallas_kernels.kda_body import stores_scaled_blocks
from pallas_kernels.tuning import KernelTuning
from tests.helpers import fake_device, fast_jit
from tests.kda_numpy import kda_numpy, rel_err

ON_GPU = jax.default_backend() == "gpu"
HOPPER = device.probe().mosaic_gpu  # the Mosaic GPU kernels compile for this machine's card

def bf16_inputs(rng, B, T, H, HV, K=128, V=128, lower_bound=-5.0, gate_dtype=jnp.float32):
    """q, k unit rows, v normal (bf16); g in [lower_bound, 0] (K3's bounded gate) and beta in
    (0, 1) in ``gate_dtype`` (the model passes float32 ones)."""
    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    g = lower_bound / (1.0 + np.exp(-2.0 * rng.standard_normal((B, T, HV, K))))
    arrs = (unit((B, T, H, K)), unit((B, T, H, K)), rng.standard_normal((B, T, HV, V)), g,
            1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, HV)))))
    return [jnp.asarray(x, jnp.bfloat16 if i < 3 else gate_dtype) for i, x in enumerate(arrs)]


def packed_ids(rng, B, T, C=64):
    """[B, T] int32 document ids 1, 2, ..: a document starting at a chunk's first row, one in
    the middle of the first chunk, and one at a random row."""
    starts = {C, int(rng.integers(5, C - 5)), int(rng.integers(1, T))} - {0}
    return jnp.asarray(np.broadcast_to(
        np.searchsorted(sorted(starts), np.arange(T), side="right") + 1, (B, T)), jnp.int32)


def config(q, v, *, mode, lower_bound=-5.0, chunk_size=64, hopper=1, seg=None):
    return pk.make_config(q, v, scale=q.shape[-1] ** -0.5, segment_ids=seg,
                          chunk_size=chunk_size, lower_bound=lower_bound, mode=mode,
                          tuning=KernelTuning(hopper=hopper))


@pytest.fixture
def mgpu_bwd_calls(monkeypatch):
    """Names of the kda_mgpu_bwd kernels called (whether the backward took the Mosaic GPU
    intra_bwd_scores)."""
    calls_made = []
    real = kda_mgpu_bwd.intra_bwd_scores

    def spy(*args, **kwargs):
        calls_made.append("intra_bwd_scores")
        return real(*args, **kwargs)

    monkeypatch.setattr(kda_mgpu_bwd, "intra_bwd_scores", spy)
    return calls_made


@pytest.fixture
def mgpu_state_calls(monkeypatch):
    """Names of the kda_mgpu_state passes called (whether the state passes took Mosaic GPU)."""
    calls_made = []
    for name in ("state_fwd", "state_bwd"):
        real = getattr(kda_mgpu_state, name)
        monkeypatch.setattr(kda_mgpu_state, name, lambda *a, name=name, real=real, **kw:
                            calls_made.append(name) or real(*a, **kw))
    return calls_made



@pytest.fixture(autouse=True)
def _reset_interpreter():
    yield
    if not HOPPER:  # after an exception the Mosaic GPU interpreter keeps stale state
        try:
            from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
            ipc.reset_gpu_interpret_mode_state()
        except (ImportError, AttributeError):
            pass


# ----------------------------------------------------------------------------- numerics


def test_forward_with_mgpu_state_pass_matches_recurrence(rng, mgpu_state_calls):
    """kda_pallas with KernelTuning(hopper=1): the Mosaic GPU state_fwd is the one taken, and the
    output and final state match the float64 recurrence as closely as the Triton path's do."""
    B, T, H, HV = 1, 80, 1, 1
    q, k, v, g, beta = bf16_inputs(rng, B, T, H, HV)
    h0 = jnp.asarray(0.3 * rng.standard_normal((B, HV, 128, 128)), jnp.float32)
    backend = "gpu" if HOPPER else "interpret"

    def run(hopper):
        return kda_pallas(q, k, v, g, beta, scale=128 ** -0.5, initial_state=h0,
                          segment_ids=None, chunk_size=64, lower_bound=-5.0, backend=backend,
                          tuning=KernelTuning(hopper=hopper), poison=True)

    o, S = run(1)
    assert mgpu_state_calls == ["state_fwd"], "the Mosaic GPU state_fwd was not used"
    o_tri, S_tri = run(0)
    assert mgpu_state_calls == ["state_fwd"], "hopper=0 must keep the Triton state_fwd"
    o_ref, S_ref = kda_numpy(q, k, v, g, beta, scale=128 ** -0.5, initial_state=h0)
    for name, x, tri, ref in (("o", o, o_tri, o_ref), ("S", S, S_tri, S_ref)):
        assert bool(jnp.all(jnp.isfinite(x))), f"{name} not finite"
        err, err_tri = rel_err(x, ref), rel_err(tri, ref)
        # bf16 inputs and bf16 intermediates: errors of ~4e-3 against float64 are rounding
        assert err < max(2 * err_tri, 1e-2), f"{name}: {err:.2e} (Triton path {err_tri:.2e})"
        assert rel_err(x, tri) < 1e-2, f"{name}: Mosaic GPU vs Triton path {rel_err(x, tri):.2e}"


@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
def test_gradient_with_mgpu_kernels(rng, mgpu_bwd_calls, mgpu_state_calls, packed):
    """KernelTuning(hopper=1) runs the Mosaic GPU state passes and intra_bwd_scores (packed
    documents too), and every gradient matches the all-Triton one's (hopper=0)."""
    B, T, H, HV = 1, 64, 1, 1
    q, k, v, g, beta = bf16_inputs(rng, B, T, H, HV)
    seg = packed_ids(rng, B, T) if packed else None
    h0 = jnp.asarray(0.3 * rng.standard_normal((B, HV, 128, 128)), jnp.float32)
    o_w = jnp.asarray(rng.standard_normal((B, T, HV, 128)), jnp.float32)
    backend = "gpu" if HOPPER else "interpret"

    def loss(hopper):
        def fn(q, k, v, g, beta, h0):
            o, S = kda_pallas(q, k, v, g, beta, scale=128 ** -0.5, initial_state=h0,
                              segment_ids=seg, chunk_size=64, lower_bound=-5.0,
                              backend=backend, tuning=KernelTuning(hopper=hopper))
            return jnp.sum(o.astype(jnp.float32) * o_w) + jnp.sum(S)
        return fast_jit(jax.grad(fn, argnums=range(6)))

    got = loss(1)(q, k, v, g, beta, h0)
    assert mgpu_bwd_calls == ["intra_bwd_scores"], f"Mosaic GPU backward: {mgpu_bwd_calls}"
    assert sorted(mgpu_state_calls) == ["state_bwd", "state_fwd"], mgpu_state_calls
    want = loss(0)(q, k, v, g, beta, h0)
    assert mgpu_bwd_calls == ["intra_bwd_scores"], "hopper=0 must keep the Triton kernels"
    assert len(mgpu_state_calls) == 2, "hopper=0 must keep the Triton state passes"
    # GPU: the two paths' bf16 products are summed in other orders and dg, dbeta take
    # differences of nearly equal terms (the GPU tests' tolerances are looser for them too).
    # CPU: a bf16 intermediate (V', dv, dA) rounded from slightly different float32 values can
    # differ by one bf16 ulp (2^-8 relative), which moves a gradient over one chunk of one head
    # by up to ~1e-3 of its norm.
    names = ("q", "k", "v", "g", "beta", "h0")
    tols = (dict.fromkeys(names, 1e-2) | {"g": 3e-2, "beta": 3e-2} if ON_GPU
            else dict.fromkeys(names, 2.0 ** -8))
    for name, a, b in zip(names, got, want, strict=True):
        assert bool(jnp.all(jnp.isfinite(a))), f"d{name} not finite"
        assert rel_err(a, b) < tols[name], f"d{name}: rel err {rel_err(a, b):.2e} > {tols[name]}"



def test_gate_in_kernel_takes_the_mgpu_scores_kernel(rng, mgpu_bwd_calls):
    """With the gate in the kernel the forward and intra_bwd_channels compute the gate from its
    logits (Triton), but intra_bwd_scores reads only the forward's G: it takes the Mosaic GPU
    kernel (hopper=1, as the automatic choice does on a Hopper card), with every gradient (the
    gate's parameters included) that of the all-Triton path."""
    B, T, H, HV = 1, 64, 1, 1
    q, k, v, f, beta = bf16_inputs(rng, B, T, H, HV)
    f = jnp.asarray(rng.standard_normal(f.shape), jnp.float32)  # the gate's logits
    A_log = jnp.asarray(0.5 * rng.standard_normal((HV,)), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal((HV, 128)), jnp.float32)
    o_w = jnp.asarray(rng.standard_normal((B, T, HV, 128)), jnp.float32)
    backend = "gpu" if HOPPER else "interpret"

    def grads(hopper):
        def fn(q, k, v, f, beta, A_log, dt_bias):
            o, _ = kda_pallas(q, k, v, f, beta, scale=128 ** -0.5, initial_state=None,
                              segment_ids=None, chunk_size=64, lower_bound=-5.0,
                              backend=backend, tuning=KernelTuning(hopper=hopper),
                              A_log=A_log, dt_bias=dt_bias)
            return jnp.sum(o.astype(jnp.float32) * o_w)
        return fast_jit(jax.grad(fn, argnums=range(7)))(q, k, v, f, beta, A_log, dt_bias)

    got = grads(1)
    assert mgpu_bwd_calls == ["intra_bwd_scores"], mgpu_bwd_calls
    want = grads(0)
    assert mgpu_bwd_calls == ["intra_bwd_scores"], "hopper=0 must keep the Triton kernels"
    names = ("q", "k", "v", "f", "beta", "A_log", "dt_bias")
    tols = (dict.fromkeys(names, 1e-2) | {"f": 3e-2, "beta": 3e-2, "A_log": 3e-2,
                                          "dt_bias": 3e-2} if ON_GPU
            else dict.fromkeys(names, 2.0 ** -8))
    for name, a, b in zip(names, got, want, strict=True):
        assert bool(jnp.all(jnp.isfinite(a))), f"d{name} not finite"
        assert rel_err(a, b) < tols[name], f"d{name}: rel err {rel_err(a, b):.2e} > {tols[name]}"


@pytest.mark.parametrize(("packed", "D"), [(False, 128), (True, 128), (True, 64)],
                         ids=["one-document", "packed", "packed-64"])
def test_intra_bwd_scores_matches_triton(rng, packed, D):
    """dv, dbeta, dAqk, dAkk and their transposes from the Mosaic GPU intra_bwd_scores against
    the Triton kernel's (interpret mode): T not a multiple of C, two chunks, HV > H, packed
    documents (one starting at a chunk's first row, one inside a chunk), and heads of 128 and
    of 64 (configs/small.py's K = V). Inputs: the forward's G, Akk, Tinv, W, U (Triton,
    interpret), random h, V', dV', dO."""
    B, T, H, HV = 1, 100, 1, 2
    q, k, v, g, beta = bf16_inputs(rng, B, T, H, HV, K=D, V=D)
    seg = packed_ids(rng, B, T) if packed else None
    cfg = config(q, v, mode="gpu" if HOPPER else "interpret", seg=seg)
    qp, kp, vp, gp, bp, segs = pk._prep(q, k, v, g, beta, seg, cfg)
    ref_cfg = dataclasses.replace(cfg, mode="interpret", platform="cpu", hopper=0)
    W, U, _, _, _, _, G, Akk, Tinv = calls.intra_fwd(ref_cfg, qp, kp, vp, gp, bp, segs,
                                                      residuals=True)
    BHV, N, C = B * HV, cfg.N, cfg.C

    def rand(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    assert calls.scores_mode(cfg, kp, vp, G, bp, jnp.bfloat16) == ("compiled" if HOPPER
                                                                   else "interpret")
    args = (kp, vp, G, bp, segs, W, U, Akk, Tinv, rand(BHV, N, D, D), rand(BHV, N, C, D),
            rand(BHV, N, C, D), rand(B, N * C, HV, D))
    interpret = None if HOPPER else kda_mgpu.interpret_params()
    got = fast_jit(lambda *a: kda_mgpu_bwd.intra_bwd_scores(
        cfg, *a, dv_dtype=jnp.bfloat16, interpret=interpret))(*args)
    want = calls.intra_bwd_scores(ref_cfg, *args, dv_dtype=jnp.bfloat16)
    # CPU: the same bf16 products in float32; dAkk (bf16) may differ in the last bit where
    # the two kernels sum dL in another order
    tol = 1e-2 if ON_GPU else 3e-4
    assert calls.da_names(cfg) == calls.DA_NAMES + calls.DA_DOWN_NAMES  # cfg.bwd_rows' blocks
    # the matrices with their scaling undone: on the GPU the two kernels' sums differ by
    # ~1e-2, and a power of two chosen from them by a factor of 2 where they straddle one
    # (each kernel's own scaling is exact: test_scores_scale_the_diagonal_blocks_exactly)
    got, want = ([*out[:2], *unscaled(out[2:], cfg.bwd_rows)] for out in (got, want))
    for name, a, b in zip(("dv", "dbeta", *calls.DA_NAMES), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, a.dtype, b.dtype)
        assert bool(np.all(np.isfinite(a))), f"{name} not finite"
        assert rel_err(a, b) < tol, f"{name}: rel err {rel_err(a, b):.2e} > {tol}"
    # the transposes are exact
    for x, xt in ((got[2], got[4]), (got[3], got[5])):
        np.testing.assert_array_equal(x, np.swapaxes(xt, -1, -2))


def unscaled(dA, r: int):
    """dAqk, dAkk, dAqkT, dAkkT as float64 NumPy arrays with the scaling of the diagonal blocks
    of their rows (r rows) undone; dA: the four and their scales, as intra_bwd_scores stores
    them for cfg.bwd_rows' blocks (calls.da_names)."""
    mats, downs = [[np.asarray(x, np.float64) for x in dA[i:i + 4]] for i in (0, 4)]
    C = mats[0].shape[-1]
    same = (np.arange(C)[:, None] // r) == (np.arange(C)[None, :] // r)
    return [np.where(same, x * d, x) for x, d in zip(mats, downs, strict=True)]


@pytest.mark.parametrize("impl", ["triton", "mosaic_gpu"])
def test_scores_scale_the_diagonal_blocks_exactly(rng, impl):
    """With cfg.bwd_rows' blocks intra_bwd_scores stores the diagonal block of each row of
    the four score gradients scaled by a power of two (the largest entry there in [1, 2)),
    and the powers of two that undo it: undone, the matrices equal those stored without the
    blocks (bwd_rows = 0) bit for bit. dO is scaled by 2^-100 (a mean loss's cotangents are
    small: unscaled, the blocks' products with their factors down to e^-77.5 would be
    flushed), and the first chunk's dO and dV' are zero (its blocks hold zeros, as does the
    first row of each of dAkk's, strictly lower: the least scale, 2^-126)."""
    B, T, H, HV = 1, 100, 1, 2
    q, k, v, g, beta = bf16_inputs(rng, B, T, H, HV, K=64, V=64)
    cfg = config(q, v, mode="gpu" if HOPPER else "interpret")
    assert cfg.bwd_rows == 32 and stores_scaled_blocks(cfg)
    qp, kp, vp, gp, bp, segs = pk._prep(q, k, v, g, beta, None, cfg)
    ref_cfg = dataclasses.replace(cfg, mode="interpret", platform="cpu", hopper=0)
    W, U, _, _, _, _, G, Akk, Tinv = calls.intra_fwd(ref_cfg, qp, kp, vp, gp, bp, segs,
                                                      residuals=True)
    BHV, N, C, D = B * HV, cfg.N, cfg.C, 64

    def rand(*shape, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape), jnp.bfloat16)

    dVp = rand(BHV, N, C, D).at[:, 0].set(0)
    dO = rand(B, N * C, HV, D, scale=2.0 ** -100).at[:, :C].set(0)
    args = (kp, vp, G, bp, segs, W, U, Akk, Tinv, rand(BHV, N, D, D), rand(BHV, N, C, D),
            dVp, dO)
    if impl == "triton":
        run = functools.partial(calls.intra_bwd_scores, dv_dtype=jnp.bfloat16)
        cfgs = (ref_cfg, dataclasses.replace(ref_cfg, bwd_rows=0))
    else:
        interpret = None if HOPPER else kda_mgpu.interpret_params()
        run = functools.partial(kda_mgpu_bwd.intra_bwd_scores, dv_dtype=jnp.bfloat16,
                                interpret=interpret)
        cfgs = (cfg, dataclasses.replace(cfg, bwd_rows=0))
    scaled, plain = (fast_jit(lambda *a, c=c: run(c, *a))(*args) for c in cfgs)
    assert len(scaled) == 10 and len(plain) == 6
    # Bit for bit but for the Triton kernel in interpret mode on a GPU: there XLA compiles
    # each config's kernel body apart, and sums may round differently (dbeta by ~1e-6); a
    # scale that went wrong would be off by a factor of 2 or more.
    exact = impl == "mosaic_gpu" or not ON_GPU
    for name, a, b in zip(("dv", "dbeta", *calls.DA_NAMES),
                          [*scaled[:2], *unscaled(scaled[2:], 32)], plain, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if exact:
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))
    same = (np.arange(C)[:, None] // 32) == (np.arange(C)[None, :] // 32)
    for name, x, down in zip(calls.DA_NAMES, scaled[2:6], scaled[6:], strict=True):
        down = np.asarray(down)[..., 0]
        m = np.max(np.where(same, np.abs(np.asarray(x, np.float64)), 0), axis=-1)
        assert down.dtype == np.float32 and np.all(np.frexp(down)[0] == 0.5), name  # 2^e
        lit = m > 0
        assert lit.any() and (~lit).any(), name
        # [1, 2); [1, 2] in interpret mode on a GPU, where XLA (excess precision allowed)
        # drops the kernel's bf16 round trip before the row maxima, so a maximum just under a
        # power of two can round up to it when the scaled block is stored
        top = 2.0 if exact else np.nextafter(2.0, 3.0)
        assert np.all((m[lit] >= 1) & (m[lit] < top)), (name, m[lit].min(), m[lit].max())
        assert np.all(down[~lit] == 2.0 ** -126), name


@pytest.mark.parametrize(("residuals", "D"), [(False, 128), (True, 128), (True, 64)],
                         ids=["o-only", "residuals", "residuals-64"])
@pytest.mark.parametrize("form", [0, 1, 2], ids=["one-wg", "two-wg", "wide"])
def test_state_fwd_matches_triton(rng, residuals, D, form):
    """O, the final state and (with residuals) h and V' of the Mosaic GPU forward state pass
    against the Triton kernel's (interpret mode; compiled on a Hopper card): two rows of four
    chunks, two value heads, random intermediates, decays from 1e-3 to 1 and a random initial
    state. Every form (``KernelTuning.mgpu_state``): two V tiles of 64 columns of one or two
    warpgroups (the chain and the output in parallel), and all 128 columns in one CTA of two;
    and heads of 64 (configs/small.py's K = V: one V tile, a [64, 64] state)."""
    B, T, H, HV = 2, 250, 1, 2
    cfg = config(jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16),
                 jax.ShapeDtypeStruct((B, T, HV, D), jnp.bfloat16),
                 mode="gpu" if HOPPER else "interpret")
    cfg = dataclasses.replace(cfg, mgpu_state=form)
    BHV, N, C = B * HV, cfg.N, cfg.C
    assert N == 4 and kda_mgpu_state.unsupported_reason(cfg, jnp.bfloat16) is None

    def rand(*shape):
        return jnp.asarray(0.3 * rng.standard_normal(shape), jnp.bfloat16)

    args = (rand(BHV, N, C, D), rand(BHV, N, C, D), rand(BHV, N, C, D),
            rand(BHV, N, C, D), rand(BHV, N, C, C),
            jnp.asarray(np.exp(rng.uniform(-7.0, 0.0, (BHV, N, 1, D))), jnp.float32),
            jnp.asarray(rng.standard_normal((BHV, D, D)), jnp.float32))
    interpret = None if HOPPER else kda_mgpu.interpret_params()
    got = fast_jit(lambda *a: kda_mgpu_state.state_fwd(
        cfg, *a, out_dtype=jnp.bfloat16, residuals=residuals, interpret=interpret))(*args)
    ref_cfg = dataclasses.replace(cfg, mode="interpret", platform="cpu", hopper=0)
    want = calls.state_fwd(ref_cfg, *args, out_dtype=jnp.bfloat16, residuals=residuals)
    assert len(got) == len(want) == 2 + 2 * residuals
    # CPU: the same bf16 products in float32, summed in another order, so a bf16 output (and
    # what a rounded V' feeds) may differ in its last bit: up to ~1e-4 in the norm
    tol = 1e-2 if ON_GPU else 1e-3
    names = ("o", "final state", "h", "V'")[:len(want)]
    for name, a, b in zip(names, got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, a.dtype, b.dtype)
        assert bool(jnp.all(jnp.isfinite(a))), f"{name} not finite"
        assert rel_err(a, b) < tol, f"{name}: rel err {rel_err(a, b):.2e} > {tol}"


@pytest.mark.parametrize("form", [1, 2, 3], ids=["two-wg", "wide", "auto"])
def test_state_pass_forms_give_the_same_gradients(rng, monkeypatch, form):
    """kda_pallas with ``mgpu_state`` 1 or 2 runs that form of both state passes (3, the
    automatic choice, here the two-warpgroup forward and the one-warpgroup backward), and the
    output, final state and every gradient (the backward reads the forward's h and V') are
    those of the one-warpgroup passes: T = 150 (a partial last chunk), two value heads per q/k
    head, a random initial state."""
    B, T, H, HV = 1, 150, 1, 2
    q, k, v, g, beta = bf16_inputs(rng, B, T, H, HV)
    h0 = jnp.asarray(0.3 * rng.standard_normal((B, HV, 128, 128)), jnp.float32)
    o_w = jnp.asarray(rng.standard_normal((B, T, HV, 128)), jnp.float32)
    backend = "gpu" if HOPPER else "interpret"
    taken = []
    for name in ("_state_fwd_two_wg", "_state_bwd_two_wg", "_state_bwd_wide"):
        real = getattr(kda_mgpu_state, name)
        monkeypatch.setattr(kda_mgpu_state, name, lambda *a, name=name, real=real, **kw:
                            taken.append((name, kw.get("bv"))) or real(*a, **kw))

    def run(form):
        def fn(q, k, v, g, beta, h0, o_w):
            o, S = kda_pallas(q, k, v, g, beta, scale=128 ** -0.5, initial_state=h0,
                              segment_ids=None, chunk_size=64, lower_bound=-5.0,
                              backend=backend, poison=True,
                              tuning=KernelTuning(hopper=1, mgpu_state=form))
            return jnp.sum(o.astype(jnp.float32) * o_w) + jnp.sum(S), (o, S)
        # o_w an argument, not a constant: the program of mgpu_state=0, the same in every case
        # of this test, is then compiled once and read from the session's compilation cache
        # (traced each time, so the forms it takes are still checked).
        return fast_jit(jax.grad(fn, argnums=range(6), has_aux=True))(q, k, v, g, beta, h0, o_w)

    got, (o, S) = run(form)
    assert sorted(taken) == {1: [("_state_bwd_two_wg", None), ("_state_fwd_two_wg", 64)],
                             2: [("_state_bwd_wide", None), ("_state_fwd_two_wg", 128)],
                             3: [("_state_fwd_two_wg", 64)]}[form], taken
    taken.clear()
    want, (o0, S0) = run(0)
    assert not taken, f"mgpu_state=0 took {taken}"
    # the same bf16 products summed in another order: a rounded V' may differ in its last bit
    tol = 1e-2 if ON_GPU else 1e-3
    names = ("o", "S", "dq", "dk", "dv", "dg", "dbeta", "dh0")
    for name, a, b in zip(names, (o, S, *got), (o0, S0, *want), strict=True):
        assert bool(jnp.all(jnp.isfinite(a))), f"{name} not finite"
        assert rel_err(a, b) < tol, f"{name}: rel err {rel_err(a, b):.2e} > {tol}"


def test_automatic_state_pass_forms():
    """mgpu_state=3 picks the forms by the number of chains: the wide forms when 64-column CTAs,
    one per SM, would take more than one wave; else the two-warpgroup forward and the
    one-warpgroup backward. The default tuning takes it."""
    assert KernelTuning().mgpu_state == kda_mgpu_state.AUTO
    bf = jnp.bfloat16

    def chosen(B, HV, form=kda_mgpu_state.AUTO, D=128):
        cfg = config(jax.ShapeDtypeStruct((B, 128, 1, D), bf),
                     jax.ShapeDtypeStruct((B, 128, HV, D), bf), mode="interpret")
        return kda_mgpu_state.forms(dataclasses.replace(cfg, mgpu_state=form))

    wide, split, one = kda_mgpu_state.WIDE, kda_mgpu_state.SPLIT, kda_mgpu_state.ONE_WG
    assert chosen(8, 16) == (wide, wide)  # configs/1b.py's shape: 256 CTAs of 64 columns
    assert chosen(1, 16) == (split, one)  # one long row: 32 CTAs
    assert chosen(1, 66) == (split, one)  # 132 CTAs: one wave
    assert chosen(1, 67) == (wide, wide)
    # heads of 64: one 64-column CTA per chain
    assert chosen(32, 12, D=64) == (wide, wide)  # configs/small.py: 384 chains
    assert chosen(1, 132, D=64) == (split, one) and chosen(1, 133, D=64) == (wide, wide)
    for form in (0, 1, 2):
        assert chosen(8, 16, form) == (form, form)


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("form", [0, 1, 2], ids=["one-wg", "two-wg", "wide"])
def test_state_bwd_matches_triton(rng, form, D):
    """dh, dV' and dS0 of the Mosaic GPU reverse state pass against the Triton kernel's
    (interpret mode; compiled on a Hopper card): two rows of four chunks walked last to first,
    two value heads, random intermediates and dO, decays from 1e-3 to 1, a random gradient of
    the final state. Every form (``KernelTuning.mgpu_state``): two V tiles of 64 columns of one
    or two warpgroups (the products off the chain on the second), and all 128 in one CTA; and
    heads of 64 (one V tile, a [64, 64] state)."""
    B, T, H, HV = 2, 250, 1, 2
    cfg = config(jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16),
                 jax.ShapeDtypeStruct((B, T, HV, D), jnp.bfloat16),
                 mode="gpu" if HOPPER else "interpret")
    cfg = dataclasses.replace(cfg, mgpu_state=form)
    BHV, N, C = B * HV, cfg.N, cfg.C

    def rand(*shape):
        return jnp.asarray(0.3 * rng.standard_normal(shape), jnp.bfloat16)

    args = (rand(B, N * C, HV, D), rand(BHV, N, C, D), rand(BHV, N, C, D),
            rand(BHV, N, C, D), rand(BHV, N, C, C),
            jnp.asarray(np.exp(rng.uniform(-7.0, 0.0, (BHV, N, 1, D))), jnp.float32),
            jnp.asarray(rng.standard_normal((BHV, D, D)), jnp.float32))
    interpret = None if HOPPER else kda_mgpu.interpret_params()
    got = fast_jit(lambda *a: kda_mgpu_state.state_bwd(cfg, *a, interpret=interpret))(*args)
    ref_cfg = dataclasses.replace(cfg, mode="interpret", platform="cpu", hopper=0)
    want = calls.state_bwd(ref_cfg, *args)
    tol = 1e-2 if ON_GPU else 1e-3  # as in the forward's test
    for name, a, b in zip(("dh", "dV'", "dS0"), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, a.dtype, b.dtype)
        assert bool(jnp.all(jnp.isfinite(a))), f"{name} not finite"
        assert rel_err(a, b) < tol, f"{name}: rel err {rel_err(a, b):.2e} > {tol}"


def test_state_pass_dispatch():
    """The state passes take their Mosaic GPU form (hopper=1 here) for what it supports (bf16
    intermediates, O and dO, K and V of 128 or 64, C = 64), interpret mode standing in for the
    card, and refuse anything else by name; hopper=0 keeps the Triton kernels."""
    bf = jnp.bfloat16
    cfg = config(jax.ShapeDtypeStruct((1, 128, 1, 128), bf),
                 jax.ShapeDtypeStruct((1, 128, 1, 128), bf), mode="interpret")
    assert calls.state_mode(cfg, bf) == "interpret"
    with pytest.raises(ValueError, match=r"state passes, which cannot take this call: output "
                                         r"dtype float32"):
        calls.state_mode(cfg, jnp.float32)
    assert calls.state_mode(dataclasses.replace(cfg, hopper=0), bf) is None
    for changes in ({"K": 64, "k_dim": 64}, {"K": 64, "V": 64, "k_dim": 64, "v_dim": 64}):
        assert calls.state_mode(dataclasses.replace(cfg, **changes), bf) == "interpret"
    for changes, why in (({"K": 32, "k_dim": 32}, "K, V = 32, 128"),
                         ({"V": 256, "v_dim": 256}, "K, V = 128, 256"), ({"C": 32}, "chunk 32"),
                         ({"cd": "float32"}, "compute dtype float32"),
                         ({"mode": "tpu_interpret"}, "backend 'tpu_interpret' has no Mosaic GPU")):
        with pytest.raises(ValueError, match=re.escape(why)):
            calls.state_mode(dataclasses.replace(cfg, **changes), bf)


# ----------------------------------------------------------------------------- lowering


# sm_90: 228 KB of shared memory per SM, 1 KB of it reserved per block: two blocks per SM (the
# overlap the kernel relies on) if each takes at most 113 KB.
SMEM_TWO_BLOCKS = 113 * 1024
# what a launch took beyond Pallas' estimate (a profile of intra_bwd_scores at 64), rounded up
SMEM_LAUNCH_MARGIN = 8 * 1024
# one block per SM: the backward kernels (227 KB of dynamic shared memory at most)
SMEM_PER_BLOCK = 227 * 1024


@pytest.fixture
def smem(monkeypatch):
    """The shared memory (bytes) of each Mosaic GPU kernel lowered while the test runs, from
    Pallas' own resource estimate (run_scoped buffers at their peak). Private API: where this
    JAX does not expose it the list stays empty and the tests check the lowering only."""
    sizes = []
    try:
        from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering
        estimate = mgpu_lowering._estimate_resources

        def spy(ctx, jaxpr):
            out = estimate(ctx, jaxpr)
            sizes.append(out.smem_scratch_bytes)
            return out

        monkeypatch.setattr(mgpu_lowering, "_estimate_resources", spy)
    except (ImportError, AttributeError):
        pass
    return sizes


def state_pass_config(D: int, form: int):
    """The lowering tests' state-pass config: B = 2, Tp = 256, 2 q/k and 4 value heads of D,
    backend "gpu", ``mgpu_state=form``."""
    bf = jnp.bfloat16
    cfg = config(jax.ShapeDtypeStruct((2, 256, 2, D), bf),
                 jax.ShapeDtypeStruct((2, 256, 4, D), bf), mode="gpu")
    return dataclasses.replace(cfg, mgpu_state=form)


def state_pass_shapes(cfg):
    """Shapes of state_fwd's arguments W, U, QG, Kg, Aqk, gam, h0t, and of state_bwd's (dO in
    the user layout first), for ``cfg``."""
    bf, f = jnp.bfloat16, jnp.float32
    BHV, N, C, D = cfg.B * cfg.HV, cfg.N, cfg.C, cfg.V
    fwd = [jax.ShapeDtypeStruct(sh, dt) for sh, dt in (
        *[((BHV, N, C, D), bf)] * 4, ((BHV, N, C, C), bf), ((BHV, N, 1, D), f),
        ((BHV, D, D), f))]
    return fwd, [jax.ShapeDtypeStruct((cfg.B, N * C, cfg.HV, D), bf), *fwd[1:]]


def scores_shapes(B, Tp, H, HV, N, C, D):
    """Shapes of intra_bwd_scores' arguments but the segments: k, v, G, beta, then W, U, Akk,
    Tinv, h, V', dV', dO."""
    bf, f = jnp.bfloat16, jnp.float32
    cc, st, cv = (B * HV, N, C, C), (B * HV, N, D, D), (B * HV, N, C, D)
    return [jax.ShapeDtypeStruct(sh, dt) for sh, dt in (
        ((B, Tp, H, D), bf), ((B, Tp, HV, D), bf), ((B * HV, N, C, D), f),
        ((B, Tp, HV, 1), f), (cv, bf), (cv, bf), (cc, f), (cc, bf), (st, bf), (cv, bf),
        (cv, bf), ((B, Tp, HV, D), bf))]


@pytest.mark.parametrize("residuals", [False, True])
@pytest.mark.parametrize("form", [0, 1, 2], ids=["one-wg", "two-wg", "wide"])
def test_cuda_lowering_of_state_passes(residuals, form, smem):
    """The two state passes of every form (``KernelTuning.mgpu_state``) lower for CUDA without a
    GPU, and the shared memory of each (Pallas' estimate) fits: for form 0 two blocks share an
    sm_90 SM (256 CTAs in one wave at B*HV = 128); the double-buffered forms 1 and 2 need more
    than two could have, and fit one."""
    bf = jnp.bfloat16
    cfg = state_pass_config(128, form)
    lo, hi = (0, SMEM_TWO_BLOCKS) if form == 0 else (SMEM_TWO_BLOCKS, SMEM_PER_BLOCK)
    fwd_args, bwd_args = state_pass_shapes(cfg)
    fn = jax.jit(lambda *a: kda_mgpu_state.state_fwd(cfg, *a, out_dtype=bf, residuals=residuals))
    text = fn.trace(*fwd_args).lower(lowering_platforms=("cuda",)).as_text()
    # each form under its own kernel name, which profiles (Nsight Compute) report
    names = {0: ("kda_state_fwd", "kda_state_bwd"),
             1: ("kda_state_fwd_two_wg_64", "kda_state_bwd_two_wg"),
             2: ("kda_state_fwd_two_wg_128", "kda_state_bwd_wide")}[form]
    assert "mosaic_gpu" in text and f"{names[0]}_mosaic_gpu" in text
    if smem:
        assert lo < max(smem) <= hi, f"forward: SMEM {max(smem)} B not in ({lo}, {hi}]"
    smem.clear()  # and the reverse pass (dO [B, Tp, HV, V] first)
    fn = jax.jit(lambda *a: kda_mgpu_state.state_bwd(cfg, *a))
    text = fn.trace(*bwd_args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and f"{names[1]}_mosaic_gpu" in text
    if smem:
        assert lo < max(smem) <= hi, f"backward: SMEM {max(smem)} B not in ({lo}, {hi}]"


@pytest.mark.parametrize("form", [0, 1, 2], ids=["one-wg", "two-wg", "wide"])
def test_cuda_lowering_of_state_passes_at_64(form, smem):
    """With heads of 64 (configs/small.py) both state passes of every form lower for CUDA and
    fit: form 0 two blocks per SM, as at 128; the others one (at 64 the wide forms take the
    64 columns there are)."""
    bf = jnp.bfloat16
    cfg = state_pass_config(64, form)
    hi = SMEM_TWO_BLOCKS if form == 0 else SMEM_PER_BLOCK
    fwd_args, bwd_args = state_pass_shapes(cfg)
    passes = (
        (lambda *a: kda_mgpu_state.state_fwd(cfg, *a, out_dtype=bf, residuals=True), fwd_args),
        (lambda *a: kda_mgpu_state.state_bwd(cfg, *a), bwd_args))
    for fn, a in passes:
        smem.clear()
        text = jax.jit(fn).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
        if smem:
            assert 0 < max(smem) <= hi, (form, max(smem), hi)


def test_cuda_lowering_of_intra_bwd_scores(smem):
    """intra_bwd_scores, with and without packed segments, lowers for CUDA without a GPU and
    fits one sm_90 block's SMEM (Pallas' estimate)."""
    bf = jnp.bfloat16
    B, Tp, H, HV, N, C = 2, 256, 2, 4, 4, 64
    cfg = config(jax.ShapeDtypeStruct((B, Tp, H, 128), bf),
                 jax.ShapeDtypeStruct((B, Tp, HV, 128), bf), mode="gpu")
    # with and without packed segments (kda_body's a, lm, segc, segr)
    cfg_seg = dataclasses.replace(cfg, has_seg=True)
    segs = [jax.ShapeDtypeStruct(sh, jnp.float32) for sh in [(B, N, C, 1)] * 3 + [(B, N, 1, C)]]

    def scores(cfg, k, v, G, beta, segs, W, U, Akk, Tinv, h, Vp, dVp, dO):
        return kda_mgpu_bwd.intra_bwd_scores(cfg, k, v, G, beta, segs, W, U, Akk, Tinv, h, Vp,
                                             dVp, dO, dv_dtype=bf)

    s_args = scores_shapes(B, Tp, H, HV, N, C, 128)
    for f, a in ((functools.partial(scores, cfg), s_args[:4] + [()] + s_args[4:]),
                 (functools.partial(scores, cfg_seg), s_args[:4] + [segs] + s_args[4:])):
        smem.clear()
        text = jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
        if smem:
            assert 0 < max(smem) <= SMEM_PER_BLOCK, f"SMEM {max(smem)} B > {SMEM_PER_BLOCK} B"


def test_cuda_lowering_of_intra_bwd_scores_at_64(smem):
    """intra_bwd_scores with heads of 64 (configs/small.py: K = V = 64), packed segments or
    not, lowers for CUDA without a GPU, with less SMEM than at 128, and two blocks share an
    sm_90 SM: Pallas' estimate with room for what the launch adds (SMEM_LAUNCH_MARGIN). At 128
    one block."""
    bf, f = jnp.bfloat16, jnp.float32
    B, Tp, H, HV, N, C = 2, 256, 2, 4, 4, 64

    def peak(D, packed):
        cfg = config(jax.ShapeDtypeStruct((B, Tp, H, D), bf),
                     jax.ShapeDtypeStruct((B, Tp, HV, D), bf), mode="gpu")
        cfg = dataclasses.replace(cfg, has_seg=packed)
        segs = [jax.ShapeDtypeStruct(sh, f) for sh in [(B, N, C, 1)] * 3 + [(B, N, 1, C)]]
        args = scores_shapes(B, Tp, H, HV, N, C, D)

        def scores(k, v, G, beta, segs, *rest):
            return kda_mgpu_bwd.intra_bwd_scores(cfg, k, v, G, beta, segs, *rest, dv_dtype=bf)

        smem.clear()
        text = jax.jit(scores).trace(*args[:4], segs if packed else (), *args[4:]).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "kda_intra_bwd_scores_mgpu" in text
        return max(smem) if smem else None

    for packed in (False, True):
        at64, at128 = peak(64, packed), peak(128, packed)
        if at64 is not None:
            assert 0 < at64 < at128 <= SMEM_PER_BLOCK, (packed, at64, at128)
            assert at64 + SMEM_LAUNCH_MARGIN <= SMEM_TWO_BLOCKS, (packed, at64)


@pytest.mark.parametrize("mosaic_gpu", [True, False], ids=["hopper", "other-card"])
def test_cuda_lowering_of_forward_and_gradient(monkeypatch, mgpu_bwd_calls, mgpu_state_calls,
                                               mosaic_gpu):
    """The whole kda_pallas forward and gradient with the default tuning (hopper=-1) on backend
    "gpu" lower for CUDA: on a Hopper card (faked) with the Mosaic GPU state passes and
    intra_bwd_scores, on any other card with the Triton kernels only."""
    fake_device(monkeypatch, "gpu", mosaic_gpu=mosaic_gpu)
    shapes = ((1, 128, 1, 128), (1, 128, 1, 128), (1, 128, 2, 128), (1, 128, 2, 128),
              (1, 128, 2))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]

    def loss(q, k, v, g, beta):
        o, S = kda_pallas(q, k, v, g, beta, scale=0.1, initial_state=None, segment_ids=None,
                          chunk_size=64, lower_bound=-5.0, backend="gpu",
                          tuning=KernelTuning())
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)

    for fn in (loss, jax.grad(loss, argnums=(0, 1, 2, 3, 4))):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert ("mosaic_gpu" in text) == mosaic_gpu
    assert mgpu_bwd_calls == (["intra_bwd_scores"] if mosaic_gpu else [])
    want = ["state_fwd", "state_fwd", "state_bwd"] if mosaic_gpu else []
    assert mgpu_state_calls == want


# ----------------------------------------------------------------------------- dispatch


def dispatch(cfg, dv_dtype=jnp.bfloat16, kernels=("intra_bwd_scores", "state passes")):
    """calls.scores_mode and calls.state_mode (the ``kernels`` named) of ``cfg`` for arguments
    of its shapes and compute dtype (float32 G and beta), as a tuple."""
    B, T, N, C, K, V = cfg.B, cfg.T, cfg.N, cfg.C, cfg.K, cfg.V
    dt = jnp.dtype(cfg.cd)
    k, v = jax.ShapeDtypeStruct((B, T, cfg.H, K), dt), jax.ShapeDtypeStruct((B, T, cfg.HV, V), dt)
    G = jax.ShapeDtypeStruct((B * cfg.HV, N, C, K), jnp.float32)
    beta = jax.ShapeDtypeStruct((B, T, cfg.HV, 1), jnp.float32)
    modes = {"intra_bwd_scores": lambda: calls.scores_mode(cfg, k, v, G, beta, dv_dtype),
             "state passes": lambda: calls.state_mode(cfg, dt)}
    return tuple(modes[name]() for name in kernels)


def test_mosaic_gpu_kernels_by_default_only_on_hopper_cards(monkeypatch):
    """KernelTuning() (hopper=-1, automatic) takes the Mosaic GPU kernels in compiled "gpu" mode
    where device.probe finds Mosaic GPU (a Hopper card), and the Triton kernels on any other
    card and in interpret mode; hopper=0 keeps Triton everywhere, hopper=1 takes the Mosaic GPU
    interpreter in interpret mode. Bad values are named."""
    assert KernelTuning().hopper == -1
    x = jax.ShapeDtypeStruct((1, 128, 1, 128), jnp.bfloat16)
    for mosaic_gpu in (True, False):
        fake_device(monkeypatch, "gpu", mosaic_gpu=mosaic_gpu)
        want = "compiled" if mosaic_gpu else None
        assert dispatch(config(x, x, mode="gpu", hopper=-1)) == (want, want), mosaic_gpu
        assert dispatch(config(x, x, mode="gpu", hopper=0)) == (None, None)
        assert dispatch(config(x, x, mode="interpret", hopper=-1)) == (None, None)
    assert dispatch(config(x, x, mode="interpret", hopper=1)) == ("interpret", "interpret")
    for bad in (-2, 2, True):
        with pytest.raises(ValueError, match=r"KernelTuning.hopper must be -1 \(automatic\), 0"):
            KernelTuning(hopper=bad)


@pytest.mark.parametrize("case", ["supported", "unbounded", "chunk32", "K32", "float32",
                                  "dv_float32", "segments", "gate_in_kernel", "tpu_interpret",
                                  "gpu_not_sm90"])
def test_unsupported_calls_fall_back_or_raise(case, monkeypatch):
    """Where a Mosaic GPU kernel cannot take a call (one it does not implement, a mode without
    Mosaic GPU, a card without it), hopper=-1 takes the Triton kernel silently and hopper=1
    raises ValueError naming the kernel and why; where it can (packed segments and the gate in
    the kernel included: neither kernel computes the gate), both take it. Compiled "gpu" mode
    on a Hopper card (faked)."""
    fake_device(monkeypatch, "gpu", mosaic_gpu=case != "gpu_not_sm90")
    B, T, H, D, dt = 1, 64, 1, 32 if case == "K32" else 128, jnp.bfloat16
    if case == "float32":
        dt = jnp.float32
    x = jax.ShapeDtypeStruct((B, T, H, D), dt)
    kw = dict(mode="gpu", lower_bound=-5.0, chunk_size=64, seg=None)
    kw.update({"unbounded": dict(lower_bound=None), "chunk32": dict(chunk_size=32),
               "segments": dict(seg=jnp.zeros((B, T), jnp.int32)),
               "tpu_interpret": dict(mode="tpu_interpret")}.get(case, {}))
    cfg = config(x, x, hopper=1, **kw)
    if case == "gate_in_kernel":
        cfg = dataclasses.replace(cfg, gate="bounded", gate_bound=-5.0)
    both = {"chunk32": "chunk 32 != 64", "K32": "K, V = 32, 32", "float32":
            "compute dtype float32", "tpu_interpret": "backend 'tpu_interpret' has no Mosaic GPU",
            "gpu_not_sm90": device.probe("gpu").why_not("mosaic_gpu")}
    why = {"intra_bwd_scores": {"unbounded": "unbounded gate", "dv_float32": "dv dtype float32",
                                **both}.get(case),
           "state passes": both.get(case)}
    dv_dtype = jnp.float32 if case == "dv_float32" else jnp.bfloat16
    for hopper in (-1, 1):
        c = dataclasses.replace(cfg, hopper=hopper)
        for kernel, reason in why.items():
            if reason is None:
                assert dispatch(c, dv_dtype, (kernel,)) == ("compiled",), (case, kernel, hopper)
            elif hopper == -1:
                assert dispatch(c, dv_dtype, (kernel,)) == (None,), (case, kernel)
            else:
                with pytest.raises(ValueError, match=rf"hopper=1 runs the Mosaic GPU {kernel}, "
                                                     rf"which cannot take this call: "
                                                     rf"{re.escape(reason)}"):
                    dispatch(c, dv_dtype, (kernel,))


@pytest.mark.parametrize("case", ["other_card", "unsupported_call", "tpu_mode"])
def test_explicit_hopper_that_cannot_run_raises(case, monkeypatch):
    """kda_pallas with KernelTuning(hopper=1) raises ValueError, naming why, where the Mosaic GPU
    kernels cannot run: compiled "gpu" mode on a card without Mosaic GPU (device.probe's
    reason), a call they do not implement (float32 inputs), a TPU mode; hopper=-1 runs the same
    call on the Triton (or TPU) kernels. Forward and gradient, traced (jax.eval_shape)."""
    dt = jnp.float32 if case == "unsupported_call" else jnp.bfloat16
    x = jax.ShapeDtypeStruct((1, 128, 1, 128), dt)
    g = jax.ShapeDtypeStruct((1, 128, 1, 128), jnp.float32)
    beta = jax.ShapeDtypeStruct((1, 128, 1), jnp.float32)
    backend = {"other_card": "gpu", "unsupported_call": "interpret",
               "tpu_mode": "tpu_interpret"}[case]
    fake_device(monkeypatch, "gpu", mosaic_gpu=False)
    why = {"other_card": device.probe("gpu").why_not("mosaic_gpu"),
           "unsupported_call": "compute dtype float32",
           "tpu_mode": "backend 'tpu_interpret' has no Mosaic GPU"}[case]

    def grads(hopper):
        def loss(q, k, v, g, beta):
            o, S = kda_pallas(q, k, v, g, beta, scale=0.1, initial_state=None,
                              segment_ids=None, chunk_size=64, lower_bound=-5.0,
                              backend=backend, tuning=KernelTuning(hopper=hopper))
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)
        return jax.eval_shape(jax.grad(loss, argnums=range(5)), x, x, x, g, beta)

    with pytest.raises(ValueError, match=rf"KernelTuning.hopper=1 runs the Mosaic GPU .*: "
                                         rf"{re.escape(why)}"):
        grads(1)
    assert [a.shape for a in grads(-1)] == [x.shape] * 4 + [beta.shape]


def test_explicit_hopper_is_refused_before_the_forward_runs():
    """A call the backward's Mosaic GPU scores kernel cannot take (an unbounded gate: the state
    passes can) is refused by the forward already, naming that kernel and why."""
    x = jax.ShapeDtypeStruct((1, 128, 1, 128), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((1, 128, 1, 128), jnp.float32)
    beta = jax.ShapeDtypeStruct((1, 128, 1), jnp.float32)

    def forward(hopper, lower_bound):
        return jax.eval_shape(lambda q, k, v, g, beta: kda_pallas(
            q, k, v, g, beta, scale=0.1, initial_state=None, segment_ids=None, chunk_size=64,
            lower_bound=lower_bound, backend="interpret", tuning=KernelTuning(hopper=hopper)),
            x, x, x, g, beta)

    with pytest.raises(ValueError, match="Mosaic GPU intra_bwd_scores, .*unbounded gate"):
        forward(1, None)
    assert forward(-1, None)[0].shape == x.shape
    assert forward(1, -5.0)[0].shape == x.shape


def test_channels_refuse_score_gradients_of_another_config():
    """intra_bwd_channels takes what intra_bwd_scores stored for the same config
    (calls.da_names): the four matrices without their scales are refused with the names it
    expects, and the four with their scales (cfg.bwd_rows' blocks) taken."""
    B, T, H, D = 1, 64, 1, 128
    x = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    cfg = config(x, x, mode="interpret", hopper=0)
    assert cfg.bwd_rows == 32 and calls.da_names(cfg) == calls.DA_NAMES + calls.DA_DOWN_NAMES
    N, C = cfg.N, cfg.C

    def sds(*shape, dt=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dt)

    cc, down = sds(B * H, N, C, C), sds(B * H, N, C, 1, dt=jnp.float32)
    st, cv, v = sds(B * H, N, D, D), sds(B * H, N, C, D), sds(B, T, H, D)

    def channels(dA):
        jax.eval_shape(lambda *a: calls.intra_bwd_channels(
            cfg, *a[:3], (), dA, *a[3:], dqk_dtype=jnp.bfloat16, dg_dtype=jnp.float32),
            v, v, sds(B * H, N, C, D, dt=jnp.float32), st, st, cv, v, v)

    with pytest.raises(ValueError, match=r"dA must hold .*dAqk_down.* got 4 arrays"):
        channels((cc,) * 4)
    channels((cc,) * 4 + (down,) * 4)


@pytest.mark.parametrize("case", ["supported", "hopper_off", "K64", "segments", "out_dtypes",
                                  "gate_in_kernel", "unbounded"])
def test_bwd_dispatch(case, monkeypatch, mgpu_bwd_calls):
    """calls.intra_bwd_scores (traced only: jax.eval_shape) takes the Mosaic GPU kernel on a
    Hopper card (faked, compiled "gpu" mode, the default hopper=-1) for the calls it
    implements (heads of 64 or 128, packed segments, the gate in the kernel: it reads the
    forward's G) and the Triton kernel otherwise: hopper=0, dv not bf16, an unbounded gate."""
    fake_device(monkeypatch, "gpu", mosaic_gpu=True)
    B, T, H, D = 1, 64, 1, 64 if case == "K64" else 128
    x = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    seg = jnp.zeros((B, T), jnp.int32) if case == "segments" else None
    cfg = config(x, x, mode="gpu", hopper=0 if case == "hopper_off" else -1, seg=seg,
                 lower_bound=None if case == "unbounded" else -5.0)
    if case == "gate_in_kernel":
        cfg = dataclasses.replace(cfg, gate="bounded", gate_bound=-5.0)
    N, C, K, V = cfg.N, cfg.C, cfg.K, cfg.V

    def sds(*shape, dt=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dt)

    segs = tuple(jnp.zeros((B, N, C, 1), jnp.float32) for _ in range(3)) + (
        jnp.zeros((B, N, 1, C), jnp.float32),) if cfg.has_seg else ()
    k, v, G = sds(B, T, H, K), sds(B, T, H, V), sds(B * H, N, C, K, dt=jnp.float32)
    beta, cc = sds(B, T, H, 1, dt=jnp.float32), sds(B * H, N, C, C)
    st, cv = sds(B * H, N, V, K), sds(B * H, N, C, V)
    odd = case == "out_dtypes"
    jax.eval_shape(lambda *a: calls.intra_bwd_scores(
        cfg, *a[:4], segs, *a[4:], dv_dtype=jnp.float32 if odd else jnp.bfloat16),
        k, v, G, beta, sds(B * H, N, C, K), cv, sds(B * H, N, C, C, dt=jnp.float32), cc, st, cv,
        cv, v)
    taken = case in ("supported", "K64", "segments", "gate_in_kernel")
    assert mgpu_bwd_calls == (["intra_bwd_scores"] if taken else []), case
