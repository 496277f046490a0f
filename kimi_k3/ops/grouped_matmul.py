"""Grouped matmul: rows sorted by group, each group times its own matrix.

    out[a] = lhs[a] @ rhs[g(a)]     for a < sum(sizes), with g(a) the group whose rows
                                    [start_g, start_g + sizes_g) hold a (start_g = sum_{h<g} sizes_h)
    out[a] = 0                      for a >= sum(sizes)   (rows that belong to no group)

lhs [A, K], rhs [G, K, N], sizes [G] int32 -> out [A, N] in lhs's dtype. The gradients:

    d lhs[a]  = d out[a] @ rhs[g(a)]^T                   (a grouped matmul with rhs transposed)
    d rhs[g]  = sum_{a in group g} lhs[a]^T d out[a]      (a grouped reduction over the rows)

Two implementations with this one signature:

    "xla"          ``jax.lax.ragged_dot`` (its gradients are XLA's). Everywhere; XLA's GPU
                   lowering multiplies every row by every group's matrix (moe_bench times it).
    "mosaic_gpu"   Hopper (sm_90) kernels from JAX's Pallas Mosaic GPU ops (warpgroup matmuls,
                   TMA): ``ragged_dot_mgpu.ragged_dot`` for the output and d lhs,
                   ``transposed_ragged_dot_mgpu.transposed_ragged_dot`` for d rhs; bf16/fp16,
                   K, N multiples of the blocks (:func:`mosaic_gpu_fits`). GPU only: Mosaic GPU
                   has no interpret mode, so its tests run on the card.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import device

GROUPED_MATMULS = ("xla", "mosaic_gpu")

# Tiles of the Hopper kernels: 128 x 128 output tiles, 64-deep steps, 4 in flight
# (4 x (128 x 64 + 64 x 128) x 2 bytes = 128 KiB of shared memory, within the 227 KiB of sm_90).
_BLOCK_M, _BLOCK_N, _BLOCK_K, _STEPS, _GRID_N = 128, 128, 64, 4, 1


def _mosaic_modules():
    """The two kernel modules, or None where this JAX lacks them or cannot import them."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    except Exception:
        return None
    return ragged_dot_mgpu, transposed_ragged_dot_mgpu


def mosaic_gpu_fits(K: int, N: int, dtype) -> str | None:
    """None if the Hopper kernels take lhs [A, K] @ rhs [G, K, N] in ``dtype``, else why not."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (bfloat16 or float16 only)"
    for name, size in (("K", K), ("N", N)):
        if size % _BLOCK_N:
            return f"{name} = {size} (a multiple of {_BLOCK_N})"
    if _mosaic_modules() is None:
        return "this JAX has no jax.experimental.pallas.ops.gpu.ragged_dot_mgpu"
    return None


def _zero_past(out_AxN: jax.Array, sizes_G: jax.Array) -> jax.Array:
    """Rows at or past sum(sizes) are not written by the kernels: zero them."""
    rows_A = jnp.arange(out_AxN.shape[0], dtype=jnp.int32)
    return jnp.where((rows_A < jnp.sum(sizes_G))[:, None], out_AxN, jnp.zeros((), out_AxN.dtype))


# Jitted so that every call site of the same shapes (the layers of a scanned unit, the forward
# and its recomputation) shares one lowering: Mosaic GPU kernels are slow to lower.
@functools.partial(jax.jit, static_argnames="transpose_rhs")
def mosaic_products(lhs_AxK, rhs_GxKxN, sizes_G, transpose_rhs=False):
    """out[a] = lhs[a] @ rhs[g(a)] (rhs[g]^T with ``transpose_rhs``) for rows sorted by group,
    through the Hopper kernel; rows past sum(sizes) zero."""
    fwd, _ = _mosaic_modules()
    out = fwd.ragged_dot(lhs_AxK, rhs_GxKxN, group_sizes=sizes_G, block_m=_BLOCK_M,
                         block_n=_BLOCK_N, block_k=_BLOCK_K, max_concurrent_steps=_STEPS,
                         grid_block_n=_GRID_N, transpose_rhs=transpose_rhs)
    return _zero_past(out, sizes_G)


@jax.custom_vjp
def _mgpu(lhs_AxK, rhs_GxKxN, sizes_G):
    return mosaic_products(lhs_AxK, rhs_GxKxN, sizes_G)


def _mgpu_fwd(lhs_AxK, rhs_GxKxN, sizes_G):
    return mosaic_products(lhs_AxK, rhs_GxKxN, sizes_G), (lhs_AxK, rhs_GxKxN, sizes_G)


@jax.jit
def mosaic_weight_grad(lhs_AxK, dout_AxN, sizes_G):
    """d rhs[g] = lhs_g^T d out_g: the contraction runs over the rows of each group."""
    _, wgrad = _mosaic_modules()
    return wgrad.transposed_ragged_dot(
        lhs_AxK, dout_AxN, group_sizes=sizes_G, block_m=_BLOCK_M, block_n=_BLOCK_N,
        block_k=_BLOCK_K, max_concurrent_steps=_STEPS, grid_block_n=_GRID_N)


def _mgpu_bwd(res, dout_AxN):
    lhs_AxK, rhs_GxKxN, sizes_G = res
    dout_AxN = _zero_past(dout_AxN.astype(lhs_AxK.dtype), sizes_G)
    # d lhs = d out @ rhs^T per group: rhs [G, K, N] read as [G, N', K'] with N' = K, K' = N.
    dlhs_AxK = mosaic_products(dout_AxN, rhs_GxKxN, sizes_G, transpose_rhs=True)
    drhs_GxKxN = mosaic_weight_grad(lhs_AxK, dout_AxN, sizes_G)
    sizes_zero = jnp.zeros(sizes_G.shape, jax.dtypes.float0)
    return dlhs_AxK, drhs_GxKxN.astype(rhs_GxKxN.dtype), sizes_zero


_mgpu.defvjp(_mgpu_fwd, _mgpu_bwd)


@functools.partial(jax.named_call, name="grouped_matmul")
def grouped_matmul(lhs_AxK: jax.Array, rhs_GxKxN: jax.Array, sizes_G: jax.Array,
                   impl: str = "xla") -> jax.Array:
    """lhs [A, K] (rows sorted by group), rhs [G, K, N], sizes [G] -> [A, N] in lhs's dtype;
    rows past sum(sizes) give zeros. ``impl``: "xla" | "mosaic_gpu" (see the module)."""
    if impl not in GROUPED_MATMULS:
        raise ValueError(f"grouped_matmul: impl must be one of {GROUPED_MATMULS}, got {impl!r}")
    (_, K), (G, K2, N) = lhs_AxK.shape, rhs_GxKxN.shape
    if K != K2 or sizes_G.shape != (G,):
        raise ValueError(f"grouped_matmul: lhs {lhs_AxK.shape}, rhs {rhs_GxKxN.shape} and sizes "
                         f"{sizes_G.shape} do not fit ([A, K], [G, K, N], [G])")
    sizes_G = sizes_G.astype(jnp.int32)
    if impl == "xla":
        return jax.lax.ragged_dot(lhs_AxK, rhs_GxKxN.astype(lhs_AxK.dtype), sizes_G)
    why = mosaic_gpu_fits(K, N, lhs_AxK.dtype) or device.probe().why_not("mosaic_gpu")
    if why is not None:
        raise ValueError(f"grouped_matmul: impl='mosaic_gpu' cannot run here: {why}")
    return _mgpu(lhs_AxK, rhs_GxKxN.astype(lhs_AxK.dtype), sizes_G)
