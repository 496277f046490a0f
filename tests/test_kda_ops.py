"""The KDA reference ops against a float64 NumPy recurrence, and the chunked form against the
recurrent one, forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_k3.dispatch import choose_kda_impl as resolve_impl
from kimi_k3.ops import init_dt_bias, kda, kda_gate
from pallas_kernels import device
from pallas_kernels.triton_report import as_if_on_h200
from tests.helpers import fake_device, fast_jit, make_inputs
from tests.kda_numpy import kda_numpy, rel_err


def as64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


@pytest.mark.parametrize("impl", ["recurrent", "xla"])
@pytest.mark.parametrize("T", [1, 63, 64, 100, 1000])
def test_forward_matches_numpy_float32(rng, impl, T):
    B = 1 if T == 1000 else 2
    q, k, v, g, beta = make_inputs(rng, B=B, T=T)
    S0 = jnp.asarray(rng.standard_normal((B, 4, 16, 8)).astype(np.float32))
    o, S = kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, impl=impl)
    o_ref, S_ref = kda_numpy(*map(as64, (q, k, v, g, beta)), initial_state=as64(S0))
    assert o.dtype == jnp.float32 and S.dtype == jnp.float32
    assert o.shape == (B, T, 4, 8) and S.shape == (B, 4, 16, 8)
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(S, S_ref) < 1e-5


@pytest.mark.parametrize("impl", ["recurrent", "xla"])
def test_forward_bf16_inputs(rng, impl):
    q, k, v, g, beta = make_inputs(rng, T=100, dtype=jnp.bfloat16)
    o, S = kda(q, k, v, g, beta, output_final_state=True, impl=impl)
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    o_ref, S_ref = kda_numpy(*map(as64, (q, k, v, g, beta)))
    assert rel_err(o, o_ref) < 5e-3
    assert rel_err(S, S_ref) < 5e-3


@pytest.mark.parametrize("chunk_size", [1, 16, 32, 128])
def test_chunk_sizes_and_plain_heads(rng, chunk_size):
    """H == HV (no grouping) and chunk sizes around T, including a chunk longer than T."""
    q, k, v, g, beta = make_inputs(rng, B=1, T=77, H=3, HV=3, K=8, V=16)
    o, S = kda(q, k, v, g, beta, chunk_size=chunk_size, output_final_state=True, impl="xla")
    o_ref, S_ref = kda_numpy(*map(as64, (q, k, v, g, beta)))
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5


def test_scale_argument(rng):
    q, k, v, g, beta = make_inputs(rng, T=20)
    o, _ = kda(q, k, v, g, beta, scale=0.37, impl="xla")
    o_ref, _ = kda_numpy(*map(as64, (q, k, v, g, beta)), scale=0.37)
    assert rel_err(o, o_ref) < 1e-5
    # scale only multiplies q: the default is K ** -0.5.
    o_default, _ = kda(q, k, v, g, beta, impl="xla")
    o_explicit, _ = kda(q, k, v, g, beta, scale=16**-0.5, impl="xla")
    np.testing.assert_allclose(o_default, o_explicit, rtol=1e-6, atol=1e-7)


def _loss_fn(impl, w_o, w_S, segment_ids=None):
    def loss(q, k, v, g, beta, S0):
        o, S = kda(
            q, k, v, g, beta, initial_state=S0, output_final_state=True,
            segment_ids=segment_ids, chunk_size=16, impl=impl,
        )
        return jnp.sum(o * w_o) + jnp.sum(S * w_S)

    return loss


@pytest.mark.parametrize("gate", ["normal", "extreme"])
def test_gradients_xla_match_recurrent(rng, gate):
    q, k, v, g, beta = make_inputs(rng, B=2, T=50, gate=gate)
    S0 = jnp.asarray(rng.standard_normal((2, 4, 16, 8)).astype(np.float32))
    w_o = jnp.asarray(rng.standard_normal((2, 50, 4, 8)).astype(np.float32))
    w_S = jnp.asarray(rng.standard_normal((2, 4, 16, 8)).astype(np.float32))
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (2, 50)), axis=1))
    args = (q, k, v, g, beta, S0)
    grads = {}
    for impl in ("recurrent", "xla"):
        loss = _loss_fn(impl, w_o, w_S, seg)
        # Jitted: run eagerly, the gradient dispatches (and compiles) op by op, several times
        # slower than compiling it whole.
        grads[impl] = fast_jit(jax.grad(loss, argnums=tuple(range(6))))(*args)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    for name, gx, gr in zip(names, grads["xla"], grads["recurrent"], strict=True):
        assert np.all(np.isfinite(gx)), name
        assert rel_err(gx, gr) < 1e-4, (name, rel_err(gx, gr))


def test_gradients_recurrent_match_finite_differences(rng):
    """The definition's own gradient, checked numerically in float64 on a small case."""
    with jax.enable_x64(True):
        q, k, v, g, beta = (jnp.asarray(x, jnp.float64) for x in make_inputs(rng, B=1, T=6, K=4, V=3))
        w = jnp.asarray(rng.standard_normal((1, 6, 4, 3)))

        def loss(q, k, v, g, beta):
            o, _ = kda(q, k, v, g, beta, impl="recurrent")
            return jnp.sum(o.astype(jnp.float64) * w)

        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta)
        loss = jax.jit(loss)  # ten calls of one shape: one compile, not ten op-by-op runs
        # The recurrent impl computes in float32 inside, so compare against a float32-sized step.
        args = [q, k, v, g, beta]
        for i, grad in enumerate(grads):
            direction = jnp.asarray(rng.standard_normal(args[i].shape))
            eps = 1e-2
            plus = list(args)
            minus = list(args)
            plus[i] = args[i] + eps * direction
            minus[i] = args[i] - eps * direction
            fd = (loss(*plus) - loss(*minus)) / (2 * eps)
            an = jnp.sum(grad * direction)
            assert abs(float(fd - an)) < 2e-2 * max(1.0, abs(float(an))), (i, float(fd), float(an))


@pytest.mark.parametrize("impl", ["recurrent", "xla"])
def test_packed_segments_equal_documents_one_by_one(rng, impl):
    T = 90
    q, k, v, g, beta = make_inputs(rng, B=2, T=T)
    S0 = jnp.asarray(rng.standard_normal((2, 4, 16, 8)).astype(np.float32))
    # Row 0: three documents with boundaries off the chunk grid; row 1: one document.
    seg = np.zeros((2, T), np.int32)
    seg[0, 17:61] = 1
    seg[0, 61:] = 2
    # Jitted: run eagerly, each call dispatches (and compiles) op by op, several times slower.
    run = fast_jit(kda, static_argnames=("output_final_state", "chunk_size", "impl"))
    o, S = run(
        q, k, v, g, beta, initial_state=S0, segment_ids=jnp.asarray(seg),
        output_final_state=True, chunk_size=16, impl=impl,
    )
    pieces = [(0, 0, 17), (0, 17, 61), (0, 61, T), (1, 0, T)]
    for b, s, e in pieces:
        sl = lambda x, b=b, s=s, e=e: x[b : b + 1, s:e]
        # The initial state applies to the first document of each row only.
        init = S0[b : b + 1] if s == 0 else None
        o_doc, S_doc = run(
            sl(q), sl(k), sl(v), sl(g), sl(beta), initial_state=init,
            output_final_state=True, chunk_size=16, impl=impl,
        )
        assert rel_err(o[b : b + 1, s:e], o_doc) < 1e-5, (b, s, e)
        if e == T:
            assert rel_err(S[b : b + 1], S_doc) < 1e-5
    # And against the float64 definition with resets.
    o_ref, S_ref = kda_numpy(
        *map(as64, (q, k, v, g, beta)), initial_state=as64(S0), segment_ids=seg
    )
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5


@pytest.mark.parametrize("impl", ["recurrent", "xla"])
def test_extreme_gates_finite_and_correct(rng, impl):
    q, k, v, g, beta = make_inputs(rng, B=1, T=130, gate="extreme")
    o, S = kda(q, k, v, g, beta, output_final_state=True, impl=impl)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(S))
    o_ref, S_ref = kda_numpy(*map(as64, (q, k, v, g, beta)))
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5
    grads = fast_jit(jax.grad(
        lambda *a: jnp.sum(kda(*a, impl=impl)[0] ** 2), argnums=(0, 1, 2, 3, 4)
    ))(q, k, v, g, beta)
    for grad in grads:
        assert np.all(np.isfinite(grad))


def test_xla_memory_is_linear_in_T():
    """No T x T (or T x C x K per sequence) buffer: peak temp memory of the compiled gradient
    grows about linearly in T."""

    def temp_bytes(T):
        shapes = [(1, T, 2, 32), (1, T, 2, 32), (1, T, 2, 32), (1, T, 2, 32), (1, T, 2)]
        args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
        f = jax.jit(jax.grad(lambda *a: jnp.sum(kda(*a, impl="xla")[0]), argnums=(0, 1, 2, 3, 4)))
        mem = f.lower(*args).compile().memory_analysis()
        return mem.temp_size_in_bytes

    small, large = temp_bytes(2048), temp_bytes(8192)
    # 4x the tokens: linear growth gives ~4x; quadratic would give ~16x.
    assert large < 6 * small, (small, large)


def test_auto_is_xla_on_cpu():
    if jax.default_backend() == "cpu":
        assert resolve_impl("auto") == "xla"
    assert resolve_impl("recurrent") == "recurrent"


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_auto_is_pallas_on_accelerators(backend, monkeypatch):
    # The kernel must lower for the backend (Triton IR / Mosaic, without the device); "auto"
    # then takes it, and falls back to "xla" where it cannot lower.
    import importlib

    family = {"gpu": "triton", "tpu": "mosaic_tpu"}[backend]
    # The probe itself, uncached: newer JAX lowers Triton kernels on a CPU machine only for a
    # card named by the abstract mesh, and an answer cached without one would say no.
    with as_if_on_h200():
        assert device._probe.__wrapped__(backend).why_not(family) is None
    device.probe(backend)  # cached before default_backend is patched below: the probe asks it
    dispatch = importlib.import_module("kimi_k3.dispatch")
    fake_device(monkeypatch, backend, **{family: True})
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: backend)
    assert resolve_impl("auto") == "pallas"
    fake_device(monkeypatch, backend, **{family: False})
    assert resolve_impl("auto") == "xla"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(impl="cuda"), "impl must be one of"),
        (dict(chunk_size=48), "chunk_size must be a positive power of two, got 48"),
        (dict(chunk_size=0), "chunk_size must be a positive power of two, got 0"),
        (dict(lower_bound=3.0), "lower_bound must be None"),
        (dict(initial_state=jnp.zeros((2, 4, 16, 9))), r"initial_state must be \[B, HV, K, V\]"),
        (dict(initial_state=jnp.zeros((2, 4, 16, 8), jnp.bfloat16)), "initial_state must be float32"),
        (dict(segment_ids=jnp.zeros((2, 7), jnp.int32)), r"segment_ids must be \[B, T\]"),
        (dict(segment_ids=jnp.zeros((2, 10), jnp.float32)), "segment_ids must be integer"),
    ],
)
def test_bad_arguments(rng, kwargs, match):
    q, k, v, g, beta = make_inputs(rng, T=10)
    with pytest.raises(ValueError, match=match):
        kda(q, k, v, g, beta, **kwargs)


def test_bad_shapes(rng):
    q, k, v, g, beta = make_inputs(rng, T=10)
    with pytest.raises(ValueError, match="v's head count HV=3 must be a multiple of q/k's head count H=2"):
        kda(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    with pytest.raises(ValueError, match="kda: k must match q's shape"):
        kda(q, k[:, :5], v, g, beta)
    with pytest.raises(ValueError, match=r"kda: g must be \[B, T, HV, K\]"):
        kda(q, k, v, g[..., :3], beta)
    with pytest.raises(ValueError, match=r"kda: beta must be \[B, T, HV\]"):
        kda(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match=r"kda: q must be \[B, T, H, K\]"):
        kda(q[0], k, v, g, beta)


def test_final_state_only_when_asked(rng):
    q, k, v, g, beta = make_inputs(rng, T=5)
    assert kda(q, k, v, g, beta, impl="xla")[1] is None


# ------------------------------------------------------------------------------------- gates


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def test_gate_forms_match_numpy(rng):
    f = rng.standard_normal((2, 7, 3, 8)).astype(np.float32) * 3
    A_log = rng.standard_normal(3).astype(np.float32)
    dt_bias = rng.standard_normal((3, 8)).astype(np.float32)
    x = f.astype(np.float64) + dt_bias
    A = np.exp(A_log.astype(np.float64))[:, None]
    soft = -A * np.log1p(np.exp(x))
    bounded = -5.0 * _sigmoid(A * x)
    g_soft = kda_gate(jnp.asarray(f), jnp.asarray(A_log), jnp.asarray(dt_bias))
    g_bnd = kda_gate(jnp.asarray(f), jnp.asarray(A_log), jnp.asarray(dt_bias), lower_bound=-5.0)
    assert g_soft.dtype == jnp.float32
    assert rel_err(g_soft, soft) < 1e-6 and rel_err(g_bnd, bounded) < 1e-6
    assert np.all(np.asarray(g_bnd) >= -5.0) and np.all(np.asarray(g_bnd) <= 0.0)
    assert np.all(np.asarray(g_soft) <= 0.0)
    # A flat dt_bias [HV * K] is accepted too.
    g_flat = kda_gate(jnp.asarray(f), jnp.asarray(A_log), jnp.asarray(dt_bias.reshape(-1)))
    np.testing.assert_array_equal(g_flat, g_soft)


def test_gate_bad_arguments(rng):
    f = jnp.asarray(rng.standard_normal((1, 2, 3, 4)).astype(np.float32))
    with pytest.raises(ValueError, match=r"A_log must have shape \(3,\)"):
        kda_gate(f, jnp.zeros(4), jnp.zeros((3, 4)))
    with pytest.raises(ValueError, match="dt_bias must have shape"):
        kda_gate(f, jnp.zeros(3), jnp.zeros((4, 3)))
    with pytest.raises(ValueError, match="lower_bound must be None .* got 5"):
        kda_gate(f, jnp.zeros(3), jnp.zeros((3, 4)), lower_bound=5)


def test_dt_bias_init_is_inverse_softplus_of_log_uniform_dt():
    dt_bias = init_dt_bias(jax.random.PRNGKey(np.random.default_rng().integers(1 << 30)), (4096,))
    dt = np.log1p(np.exp(np.asarray(dt_bias, np.float64)))
    assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 1e-1 * (1 + 1e-4)
    # log-uniform: the median of log(dt) sits at the middle of the log-range.
    assert abs(np.median(np.log(dt)) - 0.5 * (np.log(1e-3) + np.log(1e-1))) < 0.15
