"""Routed SwiGLU experts on one device's tokens, dropless: the mixture of experts' inner loop.

Token n (of R) chose the experts ids[n, j] with weights w[n, j] (j < k); an id of E or more
means an expert this call does not hold (another device serves it; it contributes nothing):

    y_n = sum_{j: ids[n,j] < E} w[n,j] SwiGLU_{ids[n,j]}(x_n)
    SwiGLU_e(x) = (silu(x W_i,e^gate) * (x W_i,e^up)) W_o,e

x [R, D], ids [R, k] int32, w [R, k] float32, wi [E, D, 2, F] (gate, up), wo [E, F, D]
-> y [R, D] float32. Two implementations, one signature (``impl``):

    "sorted"   the assignments sorted by expert, their rows gathered into an [R k, D] copy, two
               grouped matmuls (``kimi_k3.ops.grouped_matmul``: ``matmul`` "xla" or
               "mosaic_gpu"), then scattered back: the reference.
    "blocked"  the assignments placed in a blocked layout (``blocked_layout``: each expert's rows
               in whole blocks of BM), and Pallas kernels (``pallas_kernels.grouped_matmul``)
               that gather each block's token rows themselves: no [R k, D] copy of x in the
               forward pass nor of dy in the backward, and the routing weights folded into the
               hidden activations, so the output is a plain sum over each token's k rows:

                   h = gather(x) W_i    a = silu(h_gate) h_up    a_w = w * a    z = a_w W_o
                   y_n = sum_j z[pos[n, j]]

               Backward, with dy_n gathered the same way:
                   d a_w = gather(dy) W_o^T        dW_o = a_w^T gather(dy)   (per expert)
                   d w[n, j] = <a, d a_w>[pos]     d a = w d a_w   -> d h (SwiGLU's derivative)
                   d x_n = sum_j (d h W_i^T)[pos[n, j]]     dW_i = gather(x)^T d h
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kimi_k3.ops.grouped_matmul import grouped_matmul
from pallas_kernels import grouped_matmul as gmm_kernels

ROUTED_IMPLS = ("sorted", "blocked")


# ---------------------------------------------------------------------------------------------
# The reference: sorted rows, grouped matmuls
# ---------------------------------------------------------------------------------------------


def inverse(perm_A: jax.Array) -> jax.Array:
    """The permutation that undoes ``perm``."""
    return jnp.zeros_like(perm_A).at[perm_A].set(jnp.arange(perm_A.shape[0], dtype=perm_A.dtype))


def routed_sorted(x_RxD, ids_RxK, w_RxK, wi, wo, matmul: str = "xla"):
    """``impl="sorted"`` (module docstring); ``matmul``: ``grouped_matmul``'s impl."""
    R, K = ids_RxK.shape
    E, D, _, F = wi.shape
    wi, wo = wi.astype(x_RxD.dtype), wo.astype(x_RxD.dtype)
    e_A = ids_RxK.reshape(-1)  # A = R K assignments, row-major
    # The stages carry the blocked form's scope names, so that a profile of either form
    # (benchmarks/step_profile.py) reads the same.
    with jax.named_scope("moe_dispatch"):
        perm_A = jnp.argsort(e_A, stable=True)
        sizes_E = jnp.zeros((E,), jnp.int32).at[e_A].add(1, mode="drop")
        x_AxD = x_RxD[perm_A // K]
    with jax.named_scope("moe_experts"):
        h_Ax2F = grouped_matmul(x_AxD, wi.reshape(E, D, 2 * F), sizes_E, matmul)
        h_Ax2xF = h_Ax2F.reshape(-1, 2, F)
        y_AxD = grouped_matmul(jax.nn.silu(h_Ax2xF[:, 0]) * h_Ax2xF[:, 1], wo, sizes_E, matmul)
    with jax.named_scope("moe_combine"):
        y_AxD = jnp.where((e_A[perm_A] < E)[:, None], y_AxD, 0)  # rows of no expert here
        y_RxKxD = y_AxD[inverse(perm_A)].reshape(R, K, -1)
        return jnp.einsum("rk,rkd->rd", w_RxK, y_RxKxD.astype(jnp.float32))


# ---------------------------------------------------------------------------------------------
# The blocked layout and its kernels
# ---------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockedLayout:
    """Where each assignment sits among NB blocks of BM rows (M = NB BM rows in all).

    pos [R, k]: its row (M for an expert not held here); rows [M]: the token of each row (-1:
    padding); block_group [NB]: the expert of each block (-1: unused); block_start, block_end
    [E]: each expert's blocks. NB = ceil(R k / BM) + E covers every routing.
    """

    pos: jax.Array
    rows: jax.Array
    block_group: jax.Array
    block_start: jax.Array
    block_end: jax.Array


def blocked_layout(ids_RxK: jax.Array, num_experts: int, block_m: int) -> BlockedLayout:
    """The layout of ``ids`` (values in [0, E]; E and above: not held here), each expert's rows
    in token order."""
    R, K = ids_RxK.shape
    E, BM, A = num_experts, block_m, ids_RxK.size
    NB = -(-A // BM) + E
    M = NB * BM
    e_A = jnp.minimum(ids_RxK.reshape(-1), E)
    sizes_E = jnp.zeros((E,), jnp.int32).at[e_A].add(1, mode="drop")
    blocks_E = -(-sizes_E // BM)
    block_end_E = jnp.cumsum(blocks_E).astype(jnp.int32)
    block_start_E = block_end_E - blocks_E
    first_E = jnp.cumsum(sizes_E) - sizes_E  # each expert's first assignment in sorted order
    perm_A = jnp.argsort(e_A, stable=True)
    e_sorted_A = e_A[perm_A]
    held_A = e_sorted_A < E
    e_safe_A = jnp.minimum(e_sorted_A, E - 1)
    rank_A = jnp.arange(A, dtype=jnp.int32) - first_E[e_safe_A]
    pos_sorted_A = jnp.where(held_A, block_start_E[e_safe_A] * BM + rank_A, M)
    pos_A = jnp.zeros((A,), jnp.int32).at[perm_A].set(pos_sorted_A.astype(jnp.int32))
    rows_M = jnp.full((M,), -1, jnp.int32).at[pos_A].set(
        jnp.arange(A, dtype=jnp.int32) // K, mode="drop")
    b_NB = jnp.arange(NB, dtype=jnp.int32)
    group_NB = jnp.searchsorted(block_end_E, b_NB, side="right").astype(jnp.int32)
    group_NB = jnp.where(b_NB < block_end_E[-1], group_NB, -1)
    return BlockedLayout(pos_A.reshape(R, K), rows_M, group_NB, block_start_E, block_end_E)


def _gather_sum(z_MxD: jax.Array, pos_RxK: jax.Array) -> jax.Array:
    """y_n = sum_j z[pos[n, j]] in float32 (rows past z: 0), one fused gather-and-add."""
    K = pos_RxK.shape[1]
    return sum(jnp.take(z_MxD, pos_RxK[:, j], axis=0, mode="fill", fill_value=0)
               .astype(jnp.float32) for j in range(K))


def _swiglu_parts(h_Mx2F: jax.Array, F: int):
    g = h_Mx2F[:, :F].astype(jnp.float32)
    u = h_Mx2F[:, F:].astype(jnp.float32)
    return g, u, jax.nn.sigmoid(g)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _blocked(x_RxD, w_RxK, wi_ExDx2F, wo_ExFxD, layout, sums, tiles, remat):
    return _blocked_fwd(x_RxD, w_RxK, wi_ExDx2F, wo_ExFxD, layout, sums, tiles, remat)[0]


def _blocked_fwd(x_RxD, w_RxK, wi_ExDx2F, wo_ExFxD, layout, sums, tiles, remat):
    dt = x_RxD.dtype
    F = wo_ExFxD.shape[1]
    M = layout.rows.shape[0]
    with jax.named_scope("moe_experts"):
        h_Mx2F = gmm_kernels.gmm(x_RxD, wi_ExDx2F.astype(dt), layout.block_group, layout.rows,
                                 tiles=tiles)
        g, u, s = _swiglu_parts(h_Mx2F, F)
    with jax.named_scope("moe_dispatch"):
        w_M = jnp.zeros((M,), jnp.float32).at[layout.pos.reshape(-1)].set(
            w_RxK.reshape(-1).astype(jnp.float32), mode="drop")
    with jax.named_scope("moe_experts"):
        aw_MxF = (g * s * u * w_M[:, None]).astype(dt)
        z_MxD = gmm_kernels.gmm(aw_MxF, wo_ExFxD.astype(dt), layout.block_group, tiles=tiles)
    with jax.named_scope("moe_combine"):
        y_RxD = _gather_sum(z_MxD, layout.pos)
    return y_RxD, (x_RxD, w_M, wi_ExDx2F, wo_ExFxD, None if remat else h_Mx2F, layout, sums)


def _blocked_bwd(tiles, remat, res, dy_RxD):
    with jax.named_scope("moe_experts"):
        return _blocked_bwd_kernels(tiles, remat, res, dy_RxD)


def _blocked_bwd_kernels(tiles, remat, res, dy_RxD):
    x_RxD, w_M, wi_ExDx2F, wo_ExFxD, h_Mx2F, layout, sums = res
    sum_wi, sum_wo = sums if sums is not None else (None, None)
    dt = x_RxD.dtype
    if remat:
        h_Mx2F = gmm_kernels.gmm(x_RxD, wi_ExDx2F.astype(dt), layout.block_group, layout.rows,
                                 tiles=tiles)
    F = wo_ExFxD.shape[1]
    R, K = layout.pos.shape
    dy_RxD = dy_RxD.astype(dt)
    # z's rows are summed into their tokens: dz[p] = dy[rows[p]], gathered inside the kernels.
    daw_MxF = gmm_kernels.gmm(dy_RxD, wo_ExFxD.astype(dt), layout.block_group, layout.rows,
                              transpose_rhs=True, tiles=tiles)
    g, u, s = _swiglu_parts(h_Mx2F, F)
    a_MxF = g * s * u
    aw_MxF = (a_MxF * w_M[:, None]).astype(dt)
    dwo = gmm_kernels.wgrad(aw_MxF, dy_RxD, layout.block_start, layout.block_end,
                            rows_b=layout.rows, out_dtype=wo_ExFxD.dtype, tiles=tiles,
                            acc=sum_wo)
    daw_MxF = daw_MxF.astype(jnp.float32)
    dw_M = jnp.sum(daw_MxF * a_MxF, axis=1)
    dw_RxK = jnp.take(dw_M, layout.pos.reshape(-1), mode="fill", fill_value=0).reshape(R, K)
    da_MxF = daw_MxF * w_M[:, None]
    # SwiGLU's derivative: d silu(g)/dg = s (1 + g (1 - s)), 1 - s as sigmoid(-g) (no
    # cancellation for large g).
    dg = da_MxF * u * s * (1.0 + g * jax.nn.sigmoid(-g))
    du = da_MxF * g * s
    dh_Mx2F = jnp.concatenate([dg, du], axis=1).astype(dt)
    dxg_MxD = gmm_kernels.gmm(dh_Mx2F, wi_ExDx2F.astype(dt), layout.block_group,
                              transpose_rhs=True, tiles=tiles)
    with jax.named_scope("moe_combine"):
        dx_RxD = _gather_sum(dxg_MxD, layout.pos).astype(dt)
    dwi = gmm_kernels.wgrad(x_RxD, dh_Mx2F, layout.block_start, layout.block_end,
                            rows_a=layout.rows, out_dtype=wi_ExDx2F.dtype, tiles=tiles,
                            acc=sum_wi)
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jax.dtypes.float0), layout)
    return dx_RxD, dw_RxK.astype(w_M.dtype), dwi, dwo, zeros, None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def _varying_alike(*arrays):
    """``arrays`` made to vary over the same manual mesh axes (inside ``jax.shard_map``): a
    weight gathered whole on each device meets tokens that differ per device, and the custom
    gradient below returns per-device partial sums; ``pcast`` to varying makes autodiff add
    them up (its transpose is a psum). Outside ``shard_map`` nothing changes."""
    types = [getattr(jax.typeof(a), "manual_axis_type", None) for a in arrays]
    if any(t is None for t in types):
        return arrays
    union = frozenset().union(*(t.varying for t in types))
    return tuple(jax.lax.pcast(a, tuple(sorted(union - t.varying)), to="varying")
                 if union - t.varying else a for a, t in zip(arrays, types, strict=True))


def routed_blocked(x_RxD, ids_RxK, w_RxK, wi, wo,
                   tiles: gmm_kernels.GmmTiles = gmm_kernels.DEFAULT_TILES, remat: bool = False,
                   sums=None):
    """``impl="blocked"`` (module docstring). The weights keep their dtype for their gradients
    (float32 parameters get float32 dW, summed in the kernel's float32 accumulator). ``remat``:
    keep x, not h, for the backward pass, which computes h again (one more matmul).

    ``sums``: (S_i like wi, S_o like wo), running sums of earlier micro-batches' gradients,
    not differentiated. The gradients returned for wi and wo are then S_i + dW_i and S_o + dW_o,
    added inside the weight-gradient kernels into the sums' own buffers (``wgrad(acc=...)``):
    a micro-batch's gradient of the experts is never held apart from its sum. Only where
    nothing sums these gradients again afterwards (one device)."""
    E, D, _, F = wi.shape
    with jax.named_scope("moe_dispatch"):
        layout = blocked_layout(ids_RxK, E, tiles.block_m)
        layout = jax.tree.map(jax.lax.stop_gradient, layout)
    x_RxD, w_RxK, wi, wo = _varying_alike(x_RxD, w_RxK.astype(jnp.float32), wi, wo,
                                          *jax.tree.leaves(layout))[:4]
    if sums is not None:
        sums = (jax.lax.stop_gradient(sums[0]).reshape(E, D, 2 * F),
                jax.lax.stop_gradient(sums[1]))
    return _blocked(x_RxD, w_RxK, wi.reshape(E, D, 2 * F), wo, layout, sums, tiles, remat)


def routed_experts(x_RxD: jax.Array, ids_RxK: jax.Array, w_RxK: jax.Array, wi: jax.Array,
                   wo: jax.Array, impl: str = "sorted", matmul: str = "xla",
                   remat: bool = False, sums=None) -> jax.Array:
    """y [R, D] float32 (module docstring). ``impl``: "sorted" (with ``matmul`` "xla" |
    "mosaic_gpu") or "blocked" (``remat``, ``sums``: see ``routed_blocked``)."""
    if impl not in ROUTED_IMPLS:
        raise ValueError(f"routed_experts: impl must be one of {ROUTED_IMPLS}, got {impl!r}")
    if impl == "sorted":
        if sums is not None:
            raise ValueError("routed_experts: gradient sums need impl='blocked'")
        return routed_sorted(x_RxD, ids_RxK, w_RxK, wi, wo, matmul)
    return routed_blocked(x_RxD, ids_RxK, w_RxK, wi, wo, remat=remat, sums=sums)
