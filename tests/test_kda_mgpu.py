"""The Mosaic GPU intra_fwd (pallas_kernels/kda_mgpu.py), intra_bwd_scores and
intra_bwd_channels (pallas_kernels/kda_mgpu_bwd.py) against the Triton ones, and their dispatch.

Where it runs: on CPU the Mosaic GPU kernel runs in Mosaic GPU interpret mode and the Triton
kernel in Pallas interpret mode (both float32 dots on bf16 operands: they agree to rounding);
on a Hopper (sm_90) GPU the Mosaic GPU kernel runs compiled (bf16 tensor cores, float32
accumulation) against the Triton kernel in interpret mode, held to bf16 tolerances. Lowering for CUDA is
checked on any machine (it needs no GPU).

Inputs are fresh random bf16 per run (the ``rng`` fixture prints the seed of a failure). Sizes
are small: interpret mode runs ~2-5 s per (head, chunk) program on CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda as pk
from pallas_kernels import kda_calls as calls
from pallas_kernels import kda_mgpu, kda_mgpu_bwd, kda_mgpu_state
from pallas_kernels.kda import HOPPER_ALL, HOPPER_BWD_SCORES, HOPPER_STATE, KernelTuning, kda_pallas
from pallas_kernels.kda_body import stores_scaled_blocks
from tests.compile_options import fast_jit
from tests.test_kda_pallas import numpy_kda, rel

ON_GPU = jax.default_backend() == "gpu"
HOPPER = ON_GPU and kda_mgpu.is_hopper()
NAMES = ("W", "U", "QG", "Kg", "Aqk", "gam", "G", "Akk", "Tinv")
# Relative errors (||x - ref|| / ||ref||). CPU: both interpreters take float32 dots of the same
# bf16 operands, so only float32 summation order and bf16 re-rounding differ. GPU: bf16 tensor
# cores against a float32 reference, and outputs stored in bf16.
# G and gam: float32 sums of up to 64 gates in another order (|G| up to 64 |lower_bound|, so
# ~1e-5 absolute; more with the tensor cores' accumulation), which e^G turns into relative
# errors of that size.
TOL = (dict.fromkeys(NAMES, 1e-2) | {"G": 1e-5, "gam": 1e-3} if ON_GPU
       else dict.fromkeys(NAMES, 2e-3) | {"G": 1e-5, "gam": 3e-4})


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


def config(q, v, *, mode, lower_bound=-5.0, chunk_size=64, hopper=HOPPER_ALL, seg=None):
    return pk.make_config(q, v, scale=q.shape[-1] ** -0.5, segment_ids=seg,
                          chunk_size=chunk_size, lower_bound=lower_bound, mode=mode,
                          tuning=KernelTuning(hopper=hopper))


def kernel_args(q, k, v, g, beta, cfg):
    """The padded kernel-layout arguments intra_fwd takes (as kda._forward builds them)."""
    return pk._prep(q, k, v, g, beta, None, cfg)[:5]


@pytest.fixture
def mgpu_calls(monkeypatch):
    """Counts the calls of kda_mgpu.intra_fwd (to see which kernel intra_fwd dispatched to)."""
    count = []
    real = kda_mgpu.intra_fwd

    def spy(*args, **kwargs):
        count.append(kwargs.get("interpret"))
        return real(*args, **kwargs)

    monkeypatch.setattr(kda_mgpu, "intra_fwd", spy)
    return count


@pytest.fixture
def mgpu_bwd_calls(monkeypatch):
    """Names of the kda_mgpu_bwd kernels called (which kernels the backward took)."""
    calls_made = []

    def spy_on(name):
        real = getattr(kda_mgpu_bwd, name)

        def spy(*args, **kwargs):
            calls_made.append(name)
            return real(*args, **kwargs)
        monkeypatch.setattr(kda_mgpu_bwd, name, spy)

    for name in ("intra_bwd_scores", "intra_bwd_channels"):
        spy_on(name)
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


@pytest.mark.parametrize(("B", "T", "H", "HV", "lower_bound", "residuals", "gate_dtype"), [
    pytest.param(1, 100, 1, 2, -5.0, True, jnp.float32, id="T100-grouped-sub16-residuals-g32"),
    pytest.param(2, 40, 1, 1, -1.0, False, jnp.bfloat16, id="T40-sub64-no-residuals-g16"),
])
def test_intra_fwd_matches_triton(rng, B, T, H, HV, lower_bound, residuals, gate_dtype):
    """Every output of the Mosaic GPU intra_fwd against the Triton kernel's (interpret mode),
    T not a multiple of C (a padded last chunk), one and four anchors per chunk, HV > H,
    float32 g (three bf16 planes) and bf16 g (one)."""
    q, k, v, g, beta = bf16_inputs(rng, B, T, H, HV, lower_bound=lower_bound,
                                   gate_dtype=gate_dtype)
    cfg = config(q, v, mode="gpu" if HOPPER else "interpret", lower_bound=lower_bound)
    args = kernel_args(q, k, v, g, beta, cfg)
    assert kda_mgpu.unsupported_reason(cfg, *args) is None
    interpret = None if HOPPER else kda_mgpu.interpret_params()
    got = fast_jit(lambda *a: kda_mgpu.intra_fwd(cfg, *a, residuals=residuals,
                                                interpret=interpret))(*args)
    # the Triton kernel with the Mosaic GPU kernel's score blocks (sub-chunks anchored at their
    # first row; KernelTuning.anchor_mid's blocks round differently, both to bf16 accuracy)
    ref_cfg = dataclasses.replace(cfg, mode="interpret", platform="cpu", hopper=False,
                                  fwd_rows=cfg.sub, fwd_mid=0)
    want = calls.intra_fwd(ref_cfg, *args, (), residuals=residuals)
    assert len(got) == len(want) == (9 if residuals else 6)
    for name, a, b in zip(NAMES[:len(got)], got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, a.dtype, b.dtype)
        assert bool(jnp.all(jnp.isfinite(a))), f"{name} not finite"
        err = rel(a, b)
        assert err < TOL[name], f"{name}: rel err {err:.2e} > {TOL[name]}"


def test_forward_with_mgpu_intra_matches_recurrence(rng, mgpu_calls):
    """kda_pallas with KernelTuning(hopper=HOPPER_ALL): the Mosaic GPU intra_fwd is the one taken, and the
    output and final state match the float64 recurrence as closely as the Triton path's do."""
    B, T, H, HV = 1, 80, 1, 1
    q, k, v, g, beta = bf16_inputs(rng, B, T, H, HV)
    h0 = jnp.asarray(0.3 * rng.standard_normal((B, HV, 128, 128)), jnp.float32)
    backend = "gpu" if HOPPER else "interpret"

    def run(hopper):
        return kda_pallas(q, k, v, g, beta, scale=128 ** -0.5, initial_state=h0,
                          segment_ids=None, chunk_size=64, lower_bound=-5.0, backend=backend,
                          tuning=KernelTuning(hopper=hopper), poison=True)

    o, S = run(HOPPER_ALL)
    assert len(mgpu_calls) == 1, "the Mosaic GPU intra_fwd was not used"
    o_tri, S_tri = run(0)
    assert len(mgpu_calls) == 1, "hopper=0 must keep the Triton intra_fwd"
    o_ref, S_ref = numpy_kda(q, k, v, g, beta, 128 ** -0.5, h0)
    for name, x, tri, ref in (("o", o, o_tri, o_ref), ("S", S, S_tri, S_ref)):
        assert bool(jnp.all(jnp.isfinite(x))), f"{name} not finite"
        err, err_tri = rel(x, ref), rel(tri, ref)
        # bf16 inputs and bf16 intermediates: errors of ~4e-3 against float64 are rounding
        assert err < max(2 * err_tri, 1e-2), f"{name}: {err:.2e} (Triton path {err_tri:.2e})"
        assert rel(x, tri) < 1e-2, f"{name}: Mosaic GPU vs Triton path {rel(x, tri):.2e}"


@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
def test_gradient_with_mgpu_residuals(rng, mgpu_bwd_calls, packed):
    """The backward reads the Mosaic GPU intra_fwd's residuals (G, Akk, Tinv) and runs the
    Mosaic GPU intra_bwd_scores and intra_bwd_channels: every gradient with HOPPER_ALL matches
    the all-Triton one's. Packed documents: intra_bwd_scores alone takes them (the forward and
    intra_bwd_channels stay Triton), with the same gradients."""
    B, T, H, HV = 1, 64, 1, 1
    q, k, v, g, beta = bf16_inputs(rng, B, T, H, HV)
    seg = packed_ids(rng, B, T) if packed else None
    h0 = jnp.asarray(0.3 * rng.standard_normal((B, HV, 128, 128)), jnp.float32)
    o_w = jnp.asarray(rng.standard_normal((B, T, HV, 128)), jnp.float32)
    backend = "gpu" if HOPPER else "interpret"

    # The Mosaic GPU intra_fwd factors the scores in 16-row sub-chunks: the Triton path here
    # does too (anchor_mid=0), so the two differ by the backward kernels and rounding only
    def loss(hopper, anchor_mid=0):
        def fn(q, k, v, g, beta, h0):
            o, S = kda_pallas(q, k, v, g, beta, scale=128 ** -0.5, initial_state=h0,
                              segment_ids=seg, chunk_size=64, lower_bound=-5.0,
                              backend=backend, tuning=KernelTuning(hopper=hopper,
                                                                   anchor_mid=anchor_mid))
            return jnp.sum(o.astype(jnp.float32) * o_w) + jnp.sum(S)
        return fast_jit(jax.grad(fn, argnums=range(6)))

    got = loss(HOPPER_ALL)(q, k, v, g, beta, h0)
    bwd = ["intra_bwd_scores"] if packed else ["intra_bwd_scores", "intra_bwd_channels"]
    assert mgpu_bwd_calls == bwd, f"Mosaic GPU backward kernels used: {mgpu_bwd_calls}"
    want = loss(0)(q, k, v, g, beta, h0)
    assert mgpu_bwd_calls == bwd, "hopper=0 must keep the Triton backward kernels"
    # GPU: the two paths' Tinv differ (tf32 in Triton's, ~16 bits here) and dg, dbeta take
    # differences of nearly equal terms (the GPU tests' tolerances are looser for them too).
    # CPU: both save Tinv in bf16, rounded from slightly different float32 values, so single
    # entries can differ by one bf16 ulp (2^-8 relative); over one chunk of one head that moved
    # a gradient by up to 1.5e-3 of its norm (13 seeds; 1e-3 failed about one run in five).
    names = ("q", "k", "v", "g", "beta", "h0")
    tols = (dict.fromkeys(names, 1e-2) | {"g": 3e-2, "beta": 3e-2} if ON_GPU
            else dict.fromkeys(names, 2.0 ** -8))
    for name, a, b in zip(names, got, want, strict=True):
        assert bool(jnp.all(jnp.isfinite(a))), f"d{name} not finite"
        assert rel(a, b) < tols[name], f"d{name}: rel err {rel(a, b):.2e} > {tols[name]}"


def test_gate_in_kernel_takes_the_mgpu_scores_kernel(rng, mgpu_bwd_calls):
    """With the gate in the kernel the forward and intra_bwd_channels compute the gate from its
    logits (Triton), but intra_bwd_scores reads only the forward's G: it takes the Mosaic GPU
    kernel (the default's HOPPER_BWD_SCORES bit), with every gradient (the gate's parameters
    included) that of the all-Triton path."""
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

    got = grads(HOPPER_BWD_SCORES | HOPPER_STATE)
    assert mgpu_bwd_calls == ["intra_bwd_scores"], mgpu_bwd_calls
    want = grads(0)
    assert mgpu_bwd_calls == ["intra_bwd_scores"], "hopper=0 must keep the Triton kernels"
    names = ("q", "k", "v", "f", "beta", "A_log", "dt_bias")
    tols = (dict.fromkeys(names, 1e-2) | {"f": 3e-2, "beta": 3e-2, "A_log": 3e-2,
                                          "dt_bias": 3e-2} if ON_GPU
            else dict.fromkeys(names, 2.0 ** -8))
    for name, a, b in zip(names, got, want, strict=True):
        assert bool(jnp.all(jnp.isfinite(a))), f"d{name} not finite"
        assert rel(a, b) < tols[name], f"d{name}: rel err {rel(a, b):.2e} > {tols[name]}"


def channels_args(rng, B, T, H, HV, gate_dtype=jnp.float32):
    """(cfg, the arguments of intra_bwd_channels after cfg): q, k and the forward's G from real
    inputs (the Triton intra_fwd, interpret mode); the state-pass tensors h, dh, V', dO, part
    1's dv and the score gradients dAqk (lower triangle), dAkk (strict) and their transposes
    random bf16."""
    q, k, v, g, beta = bf16_inputs(rng, B, T, H, HV, gate_dtype=gate_dtype)
    cfg = config(q, v, mode="gpu" if HOPPER else "interpret")
    qp, kp, vp, gp, bp = kernel_args(q, k, v, g, beta, cfg)
    ref_cfg = dataclasses.replace(cfg, mode="interpret", platform="cpu", hopper=False)
    G = calls.intra_fwd(ref_cfg, qp, kp, vp, gp, bp, (), residuals=True)[6]
    BHV, N, C = B * HV, cfg.N, cfg.C

    def rand(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    dA = [jnp.tril(rand(BHV, N, C, C), -i) for i in (0, 1)]
    dA += [jnp.swapaxes(x, -1, -2) for x in dA]
    rest = (rand(BHV, N, 128, 128), rand(BHV, N, 128, 128), rand(BHV, N, C, 128),
            rand(B, N * C, HV, 128), rand(B, N * C, HV, 128))
    return cfg, (qp, kp, G, (), dA, *rest)


def test_intra_bwd_channels_matches_triton(rng):
    """dq, dk, dg of the Mosaic GPU intra_bwd_channels against the Triton kernel's (interpret
    mode): T not a multiple of C (a padded last chunk), two chunks, two K slices, four anchors
    per chunk (sub 16), float32 dq, dk (as for HV > H) and g. (HV > H: the scores test and
    the gradient's lowering; the head indexing is the same.)"""
    cfg, args = channels_args(rng, B=1, T=100, H=1, HV=1)
    kw = dict(dqk_dtype=jnp.float32, dg_dtype=jnp.float32)
    assert cfg.sub == 16 and kda_mgpu_bwd.unsupported_reason(cfg, **kw) is None
    interpret = None if HOPPER else kda_mgpu.interpret_params()
    got = fast_jit(lambda *a: kda_mgpu_bwd.intra_bwd_channels(cfg, *a, **kw, interpret=interpret),
                  static_argnums=3)(*args)
    # the Triton kernel on the four matrices alone, as the Mosaic GPU kernel takes them
    # (calls.bwd_config: no anchor_mid_bwd blocks)
    ref_cfg = dataclasses.replace(cfg, mode="interpret", platform="cpu", hopper=False, bwd_rows=0)
    want = calls.intra_bwd_channels(ref_cfg, *args, **kw)
    # CPU: both take the same bf16 products (hi + lo splits included) in float32
    tol = 1e-2 if ON_GPU else 1e-5
    for name, a, b in zip(("dq", "dk", "dg"), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, a.dtype, b.dtype)
        assert bool(jnp.all(jnp.isfinite(a))), f"{name} not finite"
        assert rel(a, b) < tol, f"{name}: rel err {rel(a, b):.2e} > {tol}"


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
    ref_cfg = dataclasses.replace(cfg, mode="interpret", platform="cpu", hopper=False)
    W, U, _, _, _, _, G, Akk, Tinv = calls.intra_fwd(ref_cfg, qp, kp, vp, gp, bp, segs,
                                                      residuals=True)
    BHV, N, C = B * HV, cfg.N, cfg.C

    def rand(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    assert calls.hopper_intra_mode(cfg, kp, kp, vp, G, bp, pk.HOPPER_BWD_SCORES) is not None
    args = (kp, vp, G, bp, segs, W, U, Akk, Tinv, rand(BHV, N, D, D), rand(BHV, N, C, D),
            rand(BHV, N, C, D), rand(B, N * C, HV, D))
    interpret = None if HOPPER else kda_mgpu.interpret_params()
    got = fast_jit(lambda *a: kda_mgpu_bwd.intra_bwd_scores(
        cfg, *a, dv_dtype=jnp.bfloat16, interpret=interpret))(*args)
    want = calls.intra_bwd_scores(ref_cfg, *args, dv_dtype=jnp.bfloat16)
    # CPU: the same bf16 products in float32; dAkk (bf16) may differ in the last bit where
    # the two kernels sum dL in another order
    tol = 1e-2 if ON_GPU else 3e-4
    assert calls.da_names(cfg) == calls.DA_NAMES + calls.DA_DOWN_NAMES  # anchor_mid_bwd's
    # the matrices with their scaling undone: on the GPU the two kernels' sums differ by
    # ~1e-2, and a power of two chosen from them by a factor of 2 where they straddle one
    # (each kernel's own scaling is exact: test_scores_scale_the_diagonal_blocks_exactly)
    got, want = ([*out[:2], *unscaled(out[2:], cfg.bwd_rows)] for out in (got, want))
    for name, a, b in zip(("dv", "dbeta", *calls.DA_NAMES), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, a.dtype, b.dtype)
        assert bool(np.all(np.isfinite(a))), f"{name} not finite"
        assert rel(a, b) < tol, f"{name}: rel err {rel(a, b):.2e} > {tol}"
    # the transposes are exact
    for x, xt in ((got[2], got[4]), (got[3], got[5])):
        np.testing.assert_array_equal(x, np.swapaxes(xt, -1, -2))


def unscaled(dA, r: int):
    """dAqk, dAkk, dAqkT, dAkkT as float64 NumPy arrays with the scaling of the diagonal blocks
    of their rows (r rows) undone; dA: the four and their scales, as intra_bwd_scores stores
    them for anchor_mid_bwd's blocks (calls.da_names)."""
    mats, downs = [[np.asarray(x, np.float64) for x in dA[i:i + 4]] for i in (0, 4)]
    C = mats[0].shape[-1]
    same = (np.arange(C)[:, None] // r) == (np.arange(C)[None, :] // r)
    return [np.where(same, x * d, x) for x, d in zip(mats, downs, strict=True)]


@pytest.mark.parametrize("impl", ["triton", "mosaic_gpu"])
def test_scores_scale_the_diagonal_blocks_exactly(rng, impl):
    """With anchor_mid_bwd's blocks intra_bwd_scores stores the diagonal block of each row of
    the four score gradients scaled by a power of two (the largest entry there in [1, 2)),
    and the powers of two that undo it: undone, the matrices equal those stored without the
    blocks (bwd_rows = 0) bit for bit. dO is scaled by 2^-100 (a mean loss's cotangents are
    small: unscaled, the blocks' products with their factors down to e^-77.5 would be
    flushed), and the first chunk's dO and dV' are zero (its blocks hold zeros, as does the
    first row of each of dAkk's, strictly lower: the least scale, 2^-126)."""
    B, T, H, HV = 1, 100, 1, 2
    q, k, v, g, beta = bf16_inputs(rng, B, T, H, HV, K=64, V=64)
    cfg = config(q, v, mode="gpu" if HOPPER else "interpret", hopper=pk.HOPPER_BWD_SCORES)
    assert cfg.bwd_rows == 32 and stores_scaled_blocks(cfg)
    qp, kp, vp, gp, bp, segs = pk._prep(q, k, v, g, beta, None, cfg)
    ref_cfg = dataclasses.replace(cfg, mode="interpret", platform="cpu", hopper=False)
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
    # each config's kernel body apart, and sums may round differently (dbeta by 1e-6 on an
    # H100); a scale that went wrong would be off by a factor of 2 or more.
    exact = impl == "mosaic_gpu" or not ON_GPU
    for name, a, b in zip(("dv", "dbeta", *calls.DA_NAMES),
                          [*scaled[:2], *unscaled(scaled[2:], 32)], plain, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if exact:
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            assert rel(a, b) < 1e-5, (name, rel(a, b))
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
    ref_cfg = dataclasses.replace(cfg, mode="interpret", platform="cpu", hopper=False)
    want = calls.state_fwd(ref_cfg, *args, out_dtype=jnp.bfloat16, residuals=residuals)
    assert len(got) == len(want) == 2 + 2 * residuals
    # CPU: the same bf16 products in float32, summed in another order, so a bf16 output (and
    # what a rounded V' feeds) may differ in its last bit: up to ~1e-4 in the norm
    tol = 1e-2 if ON_GPU else 1e-3
    names = ("o", "final state", "h", "V'")[:len(want)]
    for name, a, b in zip(names, got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, a.dtype, b.dtype)
        assert bool(jnp.all(jnp.isfinite(a))), f"{name} not finite"
        assert rel(a, b) < tol, f"{name}: rel err {rel(a, b):.2e} > {tol}"


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
        def fn(q, k, v, g, beta, h0):
            o, S = kda_pallas(q, k, v, g, beta, scale=128 ** -0.5, initial_state=h0,
                              segment_ids=None, chunk_size=64, lower_bound=-5.0,
                              backend=backend, poison=True,
                              tuning=KernelTuning(hopper=HOPPER_STATE, mgpu_state=form))
            return jnp.sum(o.astype(jnp.float32) * o_w) + jnp.sum(S), (o, S)
        return fast_jit(jax.grad(fn, argnums=range(6), has_aux=True))(q, k, v, g, beta, h0)

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
        assert rel(a, b) < tol, f"{name}: rel err {rel(a, b):.2e} > {tol}"


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
    ref_cfg = dataclasses.replace(cfg, mode="interpret", platform="cpu", hopper=False)
    want = calls.state_bwd(ref_cfg, *args)
    tol = 1e-2 if ON_GPU else 1e-3  # as in the forward's test
    for name, a, b in zip(("dh", "dV'", "dS0"), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, a.dtype, b.dtype)
        assert bool(jnp.all(jnp.isfinite(a))), f"{name} not finite"
        assert rel(a, b) < tol, f"{name}: rel err {rel(a, b):.2e} > {tol}"


def test_state_pass_dispatch():
    """The state passes take their Mosaic GPU form only with HOPPER_STATE and for what it
    supports (bf16 intermediates, O and dO, K and V of 128 or 64, C = 64); interpret mode
    stands in for the card."""
    bf = jnp.bfloat16
    cfg = config(jax.ShapeDtypeStruct((1, 128, 1, 128), bf),
                 jax.ShapeDtypeStruct((1, 128, 1, 128), bf), mode="interpret")
    assert calls._hopper_state_mode(cfg, bf) == "interpret"
    assert calls._hopper_state_mode(cfg, jnp.float32) is None  # output dtype
    off = dataclasses.replace(cfg, hopper=HOPPER_ALL & ~pk.HOPPER_STATE)
    assert calls._hopper_state_mode(off, bf) is None
    for changes in ({"K": 64, "k_dim": 64}, {"K": 64, "V": 64, "k_dim": 64, "v_dim": 64}):
        assert calls._hopper_state_mode(dataclasses.replace(cfg, **changes), bf) == "interpret"
    for changes in ({"K": 32, "k_dim": 32}, {"V": 256, "v_dim": 256}, {"C": 32},
                    {"cd": "float32"}, {"mode": "tpu_interpret"}):
        assert calls._hopper_state_mode(dataclasses.replace(cfg, **changes), bf) is None, changes


# ----------------------------------------------------------------------------- lowering


# sm_90: 228 KB of shared memory per SM, 1 KB of it reserved per block: two blocks per SM (the
# overlap the kernel relies on) if each takes at most 113 KB.
SMEM_TWO_BLOCKS = 113 * 1024
# what a launch took beyond Pallas' estimate (intra_bwd_scores at 64, session ad: 139.4 KB
# against 136), rounded up
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


@pytest.mark.parametrize(("residuals", "gate_dtype"), [
    (False, jnp.bfloat16), (True, jnp.bfloat16), (False, jnp.float32), (True, jnp.float32)])
def test_cuda_lowering(residuals, gate_dtype, smem):
    """The kernel lowers for CUDA (Mosaic GPU's frontend and layout checks) without a GPU, and
    its shared memory (Pallas' own estimate, where this JAX exposes it) lets two blocks share
    an sm_90 SM."""
    bf = jnp.bfloat16
    args = [jax.ShapeDtypeStruct(s, dt) for s, dt in (  # q, k, v, g, beta; H = 2, HV = 4
        ((2, 256, 2, 128), bf), ((2, 256, 2, 128), bf), ((2, 256, 4, 128), bf),
        ((2, 256, 4, 128), gate_dtype), ((2, 256, 4, 1), gate_dtype))]
    cfg = config(args[0], args[2], mode="gpu")
    fn = jax.jit(lambda *a: kda_mgpu.intra_fwd(cfg, *a, residuals=residuals))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    if smem:
        assert 0 < max(smem) <= SMEM_TWO_BLOCKS, f"SMEM {max(smem)} B > {SMEM_TWO_BLOCKS} B"


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


@pytest.mark.parametrize(("dqk_dtype", "dg_dtype"), [
    (jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32)])
def test_cuda_lowering_of_intra_bwd(dqk_dtype, dg_dtype, smem):
    """intra_bwd_scores (with and without packed segments) and intra_bwd_channels lower for
    CUDA without a GPU and fit one sm_90 block's SMEM (Pallas' estimate), the latter with bf16
    and float32 outputs."""
    bf = jnp.bfloat16
    B, Tp, H, HV, N, C = 2, 256, 2, 4, 4, 64
    cfg = config(jax.ShapeDtypeStruct((B, Tp, H, 128), bf),
                 jax.ShapeDtypeStruct((B, Tp, HV, 128), bf), mode="gpu")
    cc, st, cv = (B * HV, N, C, C), (B * HV, N, 128, 128), (B * HV, N, C, 128)
    args = [jax.ShapeDtypeStruct(sh, dt) for sh, dt in (
        ((B, Tp, H, 128), bf), ((B, Tp, H, 128), bf), ((B * HV, N, C, 128), jnp.float32),
        *[(cc, bf)] * 4, (st, bf), (st, bf), (cv, bf), ((B, Tp, HV, 128), bf),
        ((B, Tp, HV, 128), bf))]

    def fn(q, k, G, d0, d1, d2, d3, *rest):
        return kda_mgpu_bwd.intra_bwd_channels(cfg, q, k, G, (), (d0, d1, d2, d3), *rest,
                                               dqk_dtype=dqk_dtype, dg_dtype=dg_dtype)

    # intra_bwd_scores with and without packed segments (kda_body's a, lm, segc, segr)
    cfg_seg = dataclasses.replace(cfg, has_seg=True)
    segs = [jax.ShapeDtypeStruct(sh, jnp.float32) for sh in [(B, N, C, 1)] * 3 + [(B, N, 1, C)]]

    def scores(cfg, k, v, G, beta, segs, W, U, Akk, Tinv, h, Vp, dVp, dO):
        return kda_mgpu_bwd.intra_bwd_scores(cfg, k, v, G, beta, segs, W, U, Akk, Tinv, h, Vp,
                                             dVp, dO, dv_dtype=bf)

    s_args = scores_shapes(B, Tp, H, HV, N, C, 128)
    for f, a in ((fn, args),
                 (functools.partial(scores, cfg), s_args[:4] + [()] + s_args[4:]),
                 (functools.partial(scores, cfg_seg), s_args[:4] + [segs] + s_args[4:])):
        smem.clear()
        text = jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
        if smem:
            assert 0 < max(smem) <= SMEM_PER_BLOCK, f"SMEM {max(smem)} B > {SMEM_PER_BLOCK} B"


def test_cuda_lowering_of_intra_bwd_scores_at_64(smem):
    """intra_bwd_scores with heads of 64 (configs/small.py: K = V = 64), packed segments or
    not, lowers for CUDA without a GPU, with less SMEM than at 128, and two blocks share an
    sm_90 SM: Pallas' estimate with room for what the launch adds (139.4 KB launched where the
    estimate read 136 in session ad's profile, one block per SM then). At 128 one block."""
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


def test_cuda_lowering_of_forward_and_gradient(monkeypatch, mgpu_bwd_calls):
    """The whole kda_pallas forward and gradient with HOPPER_ALL on backend "gpu", as if on sm_90
    (the intra_fwd dispatch and the Mosaic GPU backward kernels included), lower for CUDA."""
    monkeypatch.setattr(kda_mgpu, "is_hopper", lambda: True)
    shapes = ((1, 128, 1, 128), (1, 128, 1, 128), (1, 128, 2, 128), (1, 128, 2, 128),
              (1, 128, 2))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]

    def loss(q, k, v, g, beta):
        o, S = kda_pallas(q, k, v, g, beta, scale=0.1, initial_state=None, segment_ids=None,
                          chunk_size=64, lower_bound=-5.0, backend="gpu",
                          tuning=KernelTuning(hopper=HOPPER_ALL))
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)

    for fn in (loss, jax.grad(loss, argnums=(0, 1, 2, 3, 4))):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
    assert mgpu_bwd_calls == ["intra_bwd_scores", "intra_bwd_channels"]


# ----------------------------------------------------------------------------- dispatch


def test_hopper_kernels_by_default_only_on_hopper_cards():
    """default_tuning turns on the Mosaic GPU kernels measured faster on the H200 (the backward's
    intra_bwd_scores and both state passes) for Hopper device kinds only; KernelTuning() itself
    keeps Triton."""
    assert KernelTuning().hopper == 0
    for kind in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA GH200 480GB", "NVIDIA H800"):
        assert pk.default_tuning(kind).hopper == HOPPER_BWD_SCORES | HOPPER_STATE, kind
    for kind in ("cpu", "NVIDIA A100-SXM4-80GB", "NVIDIA B200", "TPU v5 lite", None):
        assert pk.default_tuning(kind).hopper == 0, kind
    for bad in (-1, HOPPER_ALL + 1, True):
        with pytest.raises(ValueError, match="KernelTuning.hopper must be a sum of HOPPER_"):
            KernelTuning(hopper=bad)


@pytest.mark.parametrize("case", [
    "hopper_off", "segments", "gate_in_kernel", "unbounded", "chunk32", "K64", "float32",
    "tpu_interpret", "gpu_not_sm90",
])
def test_fallback_for_unsupported_configs(case, monkeypatch):
    """hopper_intra_mode (intra_fwd's dispatch) gives None (the Triton kernel) for every config
    the Mosaic GPU kernel does not implement, and "interpret" for the supported one."""
    B, T, H, HV, K, V, dt = 1, 64, 1, 1, 128, 128, jnp.bfloat16
    if case == "K64":
        K = 64
    if case == "float32":
        dt = jnp.float32
    q = jax.ShapeDtypeStruct((B, T, H, K), dt)
    v = jax.ShapeDtypeStruct((B, T, HV, V), dt)
    kw = dict(mode="interpret", lower_bound=-5.0, chunk_size=64, hopper=HOPPER_ALL, seg=None)
    kw.update({"hopper_off": dict(hopper=HOPPER_ALL & ~1), "segments": dict(seg=jnp.zeros((B, T), jnp.int32)),
               "unbounded": dict(lower_bound=None), "chunk32": dict(chunk_size=32),
               "tpu_interpret": dict(mode="tpu_interpret"),
               "gpu_not_sm90": dict(mode="gpu")}.get(case, {}))
    cfg = config(q, v, **kw)
    if case == "gate_in_kernel":
        cfg = dataclasses.replace(cfg, gate="bounded", gate_bound=-5.0)
    if case == "gpu_not_sm90":
        monkeypatch.setattr(kda_mgpu, "is_hopper", lambda: False)
    x_k = jax.ShapeDtypeStruct((B, T, H, cfg.K), dt)
    x_v = jax.ShapeDtypeStruct((B, T, HV, cfg.V), dt)
    x_g = jax.ShapeDtypeStruct((B, T, HV, cfg.K), dt)
    b = jax.ShapeDtypeStruct((B, T, HV, 1), dt)
    assert calls.hopper_intra_mode(cfg, x_k, x_k, x_v, x_g, b) is None
    supported = config(jax.ShapeDtypeStruct((B, T, H, 128), jnp.bfloat16),
                       jax.ShapeDtypeStruct((B, T, HV, 128), jnp.bfloat16), mode="interpret")
    x_k, x_v = (jax.ShapeDtypeStruct((B, T, n, 128), jnp.bfloat16) for n in (H, HV))
    b = jax.ShapeDtypeStruct((B, T, HV, 1), jnp.bfloat16)
    assert calls.hopper_intra_mode(supported, x_k, x_k, x_v, x_v, b) == "interpret"


def test_fallback_runs_the_triton_kernel(mgpu_calls):
    """An unsupported call with HOPPER_ALL (float32, K = 16, unbounded gate) runs end to end on the
    Triton intra_fwd and never enters the Mosaic GPU one."""
    rng = np.random.default_rng(0)
    B, T, H, K = 1, 40, 1, 16
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, K)) / 4, jnp.float32) for _ in range(3))
    g = jnp.asarray(-rng.random((B, T, H, K)), jnp.float32)
    beta = jnp.asarray(rng.random((B, T, H)), jnp.float32)
    o, S = kda_pallas(q, k, v, g, beta, scale=K ** -0.5, initial_state=None, segment_ids=None,
                      chunk_size=64, lower_bound=None, backend="interpret",
                      tuning=KernelTuning(hopper=HOPPER_ALL))
    assert not mgpu_calls
    o_ref, S_ref = numpy_kda(q, k, v, g, beta, K ** -0.5)
    assert rel(o, o_ref) < 1e-5 and rel(S, S_ref) < 1e-5


@pytest.mark.parametrize("hopper", [pk.HOPPER_BWD_SCORES, HOPPER_ALL], ids=["triton", "mosaic_gpu"])
def test_channels_refuse_score_gradients_of_another_config(hopper):
    """intra_bwd_channels takes what intra_bwd_scores stored for the same config
    (calls.da_names, calls.bwd_config): the four matrices without their scales are refused
    with the names it expects, and where the Mosaic GPU kernel takes the call, which reads the
    matrices unscaled, so are scaled ones (anchor_mid_bwd's blocks left on)."""
    B, T, H, D = 1, 64, 1, 128
    x = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    cfg = config(x, x, mode="interpret", hopper=hopper)
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
    if hopper == HOPPER_ALL:
        with pytest.raises(ValueError, match=r"Mosaic GPU kernel takes cfg.bwd_rows = 0"):
            channels((cc,) * 4 + (down,) * 4)
    else:
        channels((cc,) * 4 + (down,) * 4)  # the Triton kernel takes them


@pytest.mark.parametrize("case", ["supported", "hopper_off", "scores_only", "channels_only",
                                  "K64", "segments", "out_dtypes", "gate_in_kernel"])
def test_bwd_dispatch(case, mgpu_bwd_calls):
    """intra_bwd_scores and intra_bwd_channels (traced only: jax.eval_shape) take the Mosaic GPU
    kernels for the supported config and the Triton kernels otherwise: their HOPPER_* bit not
    set (only intra_fwd's; only one of the two: that one alone switches), any config
    hopper_intra_mode turns down (the forward's checks: K = 64, ...; packed segments and K = 64
    for intra_bwd_channels, which intra_bwd_scores takes), or output dtypes they do not write (dv
    not bf16; dq, dk or dg not bf16 / float32). With the gate in the kernel intra_bwd_scores
    still takes it (it reads the forward's G) and intra_bwd_channels, which computes df, not."""
    B, T, H, D = 1, 64, 1, 64 if case == "K64" else 128
    x = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    seg = jnp.zeros((B, T), jnp.int32) if case == "segments" else None
    bits = {"hopper_off": pk.HOPPER_INTRA_FWD, "scores_only": pk.HOPPER_BWD_SCORES,
            "channels_only": pk.HOPPER_BWD_CHANNELS}.get(case, HOPPER_ALL)
    # the four matrices alone, as intra_bwd hands them where the Mosaic GPU intra_bwd_channels
    # runs (calls.bwd_config)
    cfg = dataclasses.replace(config(x, x, mode="interpret", hopper=bits, seg=seg), bwd_rows=0)
    gated = case == "gate_in_kernel"
    if gated:
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
    gate = ((sds(B, T, H, K, dt=jnp.float32), (sds(H, 1, K, dt=jnp.float32),) * 2) if gated
            else (None, ()))
    jax.eval_shape(lambda *a: calls.intra_bwd_channels(
        cfg, *a[:3], segs, a[3:7], *a[7:], *gate, dqk_dtype=jnp.float16 if odd else jnp.float32,
        dg_dtype=jnp.float32), k, k, G, cc, cc, cc, cc, st, st, cv, v, v)
    want = {"supported": ["intra_bwd_scores", "intra_bwd_channels"],
            "scores_only": ["intra_bwd_scores"], "segments": ["intra_bwd_scores"],
            "K64": ["intra_bwd_scores"],
            "channels_only": ["intra_bwd_channels"],
            "gate_in_kernel": ["intra_bwd_scores"]}.get(case, [])
    assert mgpu_bwd_calls == want, case

