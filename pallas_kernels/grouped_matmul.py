"""Grouped matmuls over row blocks, with the rows gathered inside the kernel (Pallas; Triton on
the GPU, interpret mode elsewhere).

The rows of a mixture of experts' dispatch live in a *blocked* layout: expert g's rows occupy
whole blocks of BM rows, blocks [block_start_g, block_end_g), the last one padded. Row p of the
layout is either row ``rows[p]`` of a source matrix (a token) or padding (``rows[p] < 0``).
Each block holds one expert's rows, so it is one dense [BM, K] x [K, N] tile product:

    gmm:    out[p] = src[p] @ W[g(p)]              p < NB * BM,  g(p) = block_group[p // BM]
            src[p] = x[rows[p]] (gathered; 0 where rows[p] < 0), or x[p] when ``rows`` is None
            W[g] = rhs[g] [K, N], or rhs[g]^T when ``transpose_rhs`` (rhs [G, N, K])
            blocks with block_group < 0 (past the used ones) are written as zeros
    wgrad:  out[g] = sum_{p in g's blocks} a[p]^T b[p]           [G, K, N]
            a[p] = x[rows_a[p]] or x[p];  b[p] = y[rows_b[p]] or y[p]  (the same gathers)

Gathering inside the kernel is why these exist: the dispatch never writes the [tokens x top_k,
D] copy of its input (or, in the backward pass, of the output's cotangent); each tile loads its
BM rows straight from the token matrix. The loop over K (gmm) or over the group's rows, a
``wgrad_block_m`` slice of a block at a time (wgrad), accumulates in float32; outputs are in
the inputs' dtype (gmm) or ``out_dtype``.

    gmm grid (N / BN, NB);  wgrad grid (K / BK, N / BN, G)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import device
from pallas_kernels.tuning import pow2_tile

f32 = jnp.float32
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second (and third) axis


@dataclasses.dataclass(frozen=True)
class GmmTiles:
    """Launch parameters: ``block_m`` rows per block of the layout (the layout's own block, set
    when the layout is built), output tiles of ``block_n`` columns, ``block_k``-deep steps of
    the contraction, Triton warps and pipeline stages; ``wgrad_*`` the same for the weight
    gradient's [block_k, block_n] output tiles, whose contraction over a group's rows steps
    ``wgrad_block_m`` rows at a time (a divisor of ``block_m``: the products want tall row
    blocks, the weight gradient's transposed operands short steps)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    warps: int = 8
    stages: int = 3
    wgrad_block_k: int = 128
    wgrad_block_n: int = 128
    wgrad_warps: int = 4
    wgrad_stages: int = 3
    wgrad_block_m: int = 64

    def __post_init__(self):
        if self.wgrad_block_m <= 0 or self.block_m % self.wgrad_block_m:
            raise ValueError(f"GmmTiles: wgrad_block_m = {self.wgrad_block_m} must be a positive "
                             f"divisor of block_m = {self.block_m}")


DEFAULT_TILES = GmmTiles()


def _tile(size: int, want: int, name: str) -> int:
    """The largest power of two <= ``want`` dividing ``size`` (at least 16: Triton's dots)."""
    tile = pow2_tile(size, want)
    if tile is None:
        raise ValueError(f"grouped matmul: {name} = {size} must be a multiple of 16")
    return tile


def _load_rows(ref, rows_BM, cols, masked: bool):
    """ref[rows, cols] for the gathered rows (zeros where rows < 0). ``masked`` (Triton on the
    GPU): a masked load, so padding rows are never read and Triton copies the tile straight
    into shared memory. Otherwise (interpret mode, which has no masked gather): row 0 loaded in
    their place, then zeroed."""
    valid_BM = rows_BM >= 0
    safe_BM = jnp.where(valid_BM, rows_BM, 0)
    pl_triton = device.pallas_triton() if masked else None
    if pl_triton is not None:
        mask = jnp.broadcast_to(valid_BM[:, None], (rows_BM.shape[0], cols.size))
        return pl_triton.load(ref.at[safe_BM, cols], mask=mask, other=0)
    x = ref[safe_BM, cols]
    return jnp.where(valid_BM[:, None], x, jnp.zeros((), x.dtype))


def _interpret(interpret):
    return jax.default_backend() != "gpu" if interpret is None else interpret


def gmm(lhs: jax.Array, rhs: jax.Array, block_group: jax.Array, rows: jax.Array | None = None,
        *, transpose_rhs: bool = False, tiles: GmmTiles = DEFAULT_TILES,
        interpret: bool | None = None) -> jax.Array:
    """out [NB * BM, N] (module docstring). lhs [R, K] (gathered by ``rows`` [NB * BM] int32)
    or [NB * BM, K]; rhs [G, K, N] ([G, N, K] with ``transpose_rhs``); block_group [NB] int32.
    """
    NB = block_group.shape[0]
    BM = tiles.block_m
    M = NB * BM
    K = lhs.shape[1]
    N = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if (rhs.shape[2] if transpose_rhs else rhs.shape[1]) != K:
        raise ValueError(f"gmm: lhs {lhs.shape} and rhs {rhs.shape} do not contract "
                         f"(transpose_rhs={transpose_rhs})")
    if rows is None and lhs.shape[0] != M:
        raise ValueError(f"gmm: lhs has {lhs.shape[0]} rows, the layout {NB} x {BM} = {M}")
    BN, BK = _tile(N, tiles.block_n, "N"), _tile(K, tiles.block_k, "K")
    gathered = rows is not None
    rows = rows if gathered else jnp.zeros((M,), jnp.int32)
    interpret = _interpret(interpret)
    if not interpret and NB > _MAX_GRID_Y:
        raise ValueError(f"gmm: {NB} row blocks of {BM} exceed CUDA's {_MAX_GRID_Y} blocks on "
                         f"the grid's second axis; use a larger tiles.block_m")

    def kernel(group_ref, rows_ref, lhs_ref, rhs_ref, out_ref):
        # A row block's column tiles run side by side (on the GPU the first grid axis is
        # CUDA's fastest): they read the same rows and the same expert's weights.
        j, b = pl.program_id(0), pl.program_id(1)
        g = group_ref[b]
        n_cols = pl.ds(j * BN, BN)
        if gathered:
            rows_BM = rows_ref[pl.ds(b * BM, BM)]

        @pl.when(g < 0)
        def _():
            out_ref[pl.ds(b * BM, BM), n_cols] = jnp.zeros((BM, BN), out_ref.dtype)

        @pl.when(g >= 0)
        def _():
            def step(i, acc_BMxBN):
                k_cols = pl.ds(i * BK, BK)
                if gathered:
                    x_BMxBK = _load_rows(lhs_ref, rows_BM, k_cols, not interpret)
                else:
                    x_BMxBK = lhs_ref[pl.ds(b * BM, BM), k_cols]
                if transpose_rhs:
                    w_BNxBK = rhs_ref[g, n_cols, k_cols]
                    prod = jax.lax.dot_general(x_BMxBK, w_BNxBK, (((1,), (1,)), ((), ())),
                                               preferred_element_type=f32)
                else:
                    w_BKxBN = rhs_ref[g, k_cols, n_cols]
                    prod = jax.lax.dot_general(x_BMxBK, w_BKxBN, (((1,), (0,)), ((), ())),
                                               preferred_element_type=f32)
                return acc_BMxBN + prod

            acc = jax.lax.fori_loop(0, K // BK, step, jnp.zeros((BM, BN), f32))
            out_ref[pl.ds(b * BM, BM), n_cols] = acc.astype(out_ref.dtype)

    return pl.pallas_call(
        kernel,
        grid=(N // BN, NB),
        in_specs=[_whole(block_group), _whole(rows), _whole(lhs), _whole(rhs)],
        out_specs=_whole_shape((M, N)),
        out_shape=_out_struct((M, N), lhs.dtype, block_group, rows, lhs, rhs),
        interpret=interpret,
        compiler_params=None if interpret else device.triton_compiler_params(
            tiles.warps, tiles.stages),
        name="gmm_t" if transpose_rhs else "gmm",
    )(block_group, rows, lhs, rhs)


def wgrad(a: jax.Array, b: jax.Array, block_start: jax.Array, block_end: jax.Array,
          rows_a: jax.Array | None = None, rows_b: jax.Array | None = None, *,
          out_dtype=f32, tiles: GmmTiles = DEFAULT_TILES, acc: jax.Array | None = None,
          interpret: bool | None = None) -> jax.Array:
    """out [G, K, N] = per group g, sum over its blocks [block_start_g, block_end_g) of
    a[p]^T b[p]; a [R_a, K] gathered by ``rows_a`` or in the layout, b likewise.

    ``acc`` [G, K, N]: out = acc + that sum, in ``acc``'s dtype, written over ``acc``'s buffer
    (each tile read into the float32 accumulator before the products, rounded once at the
    end): a running sum of gradients over micro-batches without a gradient of its own."""
    G = block_start.shape[0]
    BM, SM = tiles.block_m, tiles.wgrad_block_m
    steps = BM // SM  # contraction steps per block of the layout
    K, N = a.shape[1], b.shape[1]
    BK = _tile(K, tiles.wgrad_block_k, "K")
    BN = _tile(N, tiles.wgrad_block_n, "N")
    ga, gb = rows_a is not None, rows_b is not None
    rows_a = rows_a if ga else jnp.zeros((BM,), jnp.int32)
    rows_b = rows_b if gb else jnp.zeros((BM,), jnp.int32)
    interpret = _interpret(interpret)

    summed = acc is not None

    def kernel(start_ref, end_ref, rows_a_ref, rows_b_ref, a_ref, b_ref, *refs):
        acc_ref, out_ref = refs if summed else (None, refs[0])
        # The group is the grid's slowest axis (on the GPU the first is CUDA's fastest): the
        # tiles of one group, which read the same rows, run side by side and share the L2.
        i, j, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        k_cols, n_cols = pl.ds(i * BK, BK), pl.ds(j * BN, BN)

        def step(s, acc_BKxBN):
            rows = pl.ds(s * SM, SM)
            x_SMxBK = (_load_rows(a_ref, rows_a_ref[rows], k_cols, not interpret) if ga
                       else a_ref[rows, k_cols])
            y_SMxBN = (_load_rows(b_ref, rows_b_ref[rows], n_cols, not interpret) if gb
                       else b_ref[rows, n_cols])
            return acc_BKxBN + jax.lax.dot_general(
                x_SMxBK, y_SMxBN, (((0,), (0,)), ((), ())), preferred_element_type=f32)

        start = (acc_ref[g, k_cols, n_cols].astype(f32) if summed
                 else jnp.zeros((BK, BN), f32))
        total = jax.lax.fori_loop(start_ref[g] * steps, end_ref[g] * steps, step, start)
        out_ref[g, k_cols, n_cols] = total.astype(out_ref.dtype)

    operands = (block_start, block_end, rows_a, rows_b, a, b) + ((acc,) if summed else ())
    if summed and acc.shape != (G, K, N):
        raise ValueError(f"wgrad: acc must be [G, K, N] = {(G, K, N)}, got {acc.shape}")
    return pl.pallas_call(
        kernel,
        grid=(K // BK, N // BN, G),
        in_specs=[_whole(x) for x in operands],
        out_specs=_whole_shape((G, K, N)),
        out_shape=_out_struct((G, K, N), acc.dtype if summed else out_dtype, *operands),
        input_output_aliases={len(operands) - 1: 0} if summed else {},
        interpret=interpret,
        compiler_params=None if interpret else device.triton_compiler_params(
            tiles.wgrad_warps, tiles.wgrad_stages),
        name="gmm_wgrad",
    )(*operands)


def _out_struct(shape, dtype, *operands) -> jax.ShapeDtypeStruct:
    """The output's type. Inside ``jax.shard_map`` with its type check, a Pallas output must
    say over which manual mesh axes it varies: over every axis any operand varies over."""
    types = [getattr(jax.typeof(x), "manual_axis_type", None) for x in operands]
    types = [t for t in types if t is not None]
    if not types:
        return jax.ShapeDtypeStruct(shape, dtype)
    varying = frozenset().union(*(t.varying for t in types))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=types[0].update(varying=varying))


def _whole(x: jax.Array) -> pl.BlockSpec:
    return _whole_shape(x.shape)


def _whole_shape(shape) -> pl.BlockSpec:
    """The whole array to every program: the kernels index it themselves."""
    return pl.BlockSpec(tuple(shape), lambda *_: (0,) * len(shape))
