"""kimi_k3.ops.grouped_matmul against a float64 NumPy loop over the groups (outputs and both
gradients); the Hopper kernels against it on an sm_90 GPU (the cases join the list there)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_k3.dispatch import choose_expert_matmul
from kimi_k3.ops.grouped_matmul import grouped_matmul, mosaic_gpu_fits
from pallas_kernels import device


def _sizes(rng, G: int, A: int, past: int) -> np.ndarray:
    """G group sizes (some zero) summing to A - past: the last ``past`` rows are in no group."""
    cuts = np.sort(rng.integers(0, A - past + 1, size=G - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [A - past]]))
    if G > 2:  # at least one empty group, wherever it falls
        e = int(rng.integers(0, G - 1))
        sizes[e + 1] += sizes[e]
        sizes[e] = 0
    return sizes.astype(np.int32)


def _numpy(lhs, rhs, sizes, dout):
    """float64: out[a] = lhs[a] @ rhs[g(a)], zero past sum(sizes); d lhs, d rhs of sum(out * dout)."""
    lhs, rhs, dout = (np.asarray(a, np.float64) for a in (lhs, rhs, dout))
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    dlhs, drhs = np.zeros_like(lhs), np.zeros_like(rhs)
    start = 0
    for g, n in enumerate(sizes):
        rows = slice(start, start + int(n))
        out[rows] = lhs[rows] @ rhs[g]
        dlhs[rows] = dout[rows] @ rhs[g].T
        drhs[g] = lhs[rows].T @ dout[rows]
        start += int(n)
    return out, dlhs, drhs


CASES = [("xla", 7, 37, 5, 6, 3, jnp.float32, 1e-5)]  # impl, G, A, K, N, rows past, dtype, tol
if device.probe().mosaic_gpu:
    CASES += [("mosaic_gpu", 8, 1000, 256, 384, 40, jnp.bfloat16, 2e-2),
              ("mosaic_gpu", 64, 4096, 2048, 1024, 0, jnp.bfloat16, 2e-2)]


@pytest.mark.parametrize("impl,G,A,K,N,past,dtype,tol", CASES)
def test_grouped_matmul_matches_float64(rng, impl, G, A, K, N, past, dtype, tol):
    sizes = _sizes(rng, G, A, past)
    lhs = rng.standard_normal((A, K)).astype(np.float32)
    rhs = (rng.standard_normal((G, K, N)) / np.sqrt(K)).astype(np.float32)
    dout = rng.standard_normal((A, N)).astype(np.float32)

    def loss(lhs_, rhs_):
        out = grouped_matmul(lhs_.astype(dtype), rhs_.astype(dtype), jnp.asarray(sizes), impl)
        return jnp.sum(out.astype(jnp.float32) * dout), out

    with jax.default_matmul_precision("highest"):
        (_, out), (dlhs, drhs) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
            jnp.asarray(lhs), jnp.asarray(rhs))
    want = _numpy(lhs, rhs, sizes, dout)
    for name, got, ref in zip(("out", "d lhs", "d rhs"), (out, dlhs, drhs), want, strict=True):
        got = np.asarray(got, np.float64)
        assert np.all(np.isfinite(got)), name
        err = np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30)
        assert err < tol, (name, err)
    assert np.all(np.asarray(out)[A - past:] == 0)  # rows in no group


def test_mosaic_gpu_is_refused_where_it_cannot_run():
    assert "dtype float32" in mosaic_gpu_fits(256, 256, jnp.float32)
    assert "K = 200" in mosaic_gpu_fits(200, 256, jnp.bfloat16)
    if not device.probe().mosaic_gpu:
        with pytest.raises(ValueError, match="impl='mosaic_gpu' cannot run here"):
            grouped_matmul(jnp.ones((8, 128), jnp.bfloat16), jnp.ones((2, 128, 128), jnp.bfloat16),
                           jnp.array([4, 4]), "mosaic_gpu")
        with pytest.raises(ValueError, match="expert_matmul='mosaic_gpu' cannot run here"):
            choose_expert_matmul("mosaic_gpu", tokens_move=False, dims=(128, 128),
                                 dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="impl must be one of"):
        grouped_matmul(jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.array([4, 4]), "triton")
    with pytest.raises(ValueError, match="do not fit"):
        grouped_matmul(jnp.ones((8, 4)), jnp.ones((2, 5, 3)), jnp.array([4, 4]))
