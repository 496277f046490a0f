"""The SwiGLU activation's backward pass as a Pallas kernel (GPU; interpret mode elsewhere).

The MLP's input projection writes gate and up side by side, h [N, 2, F] (``layers/mlp.py``), and
the activation is y = SiLU(g) * u with g = h[:, 0], u = h[:, 1]. Its gradient, with
s = sigmoid(g):

    dg = dy * u * s * (1 + g (1 - s))          du = dy * g * s

goes back into the same [N, 2, F] layout for the projection's weight and input gradients.

Why a kernel: XLA wrote the two halves as pad + add into [N, 2, F], each output element
reading g, u and dy, so every input was read twice (gate and up of a row lie F elements
apart): about twice the traffic of reading h and dy once and writing dh
(benchmarks/swiglu_bench.py measures it). Here each program reads its [BN, 2, BF] tile of h
and [BN, BF] tile of dy once and writes both halves of dh.

    grid (N_pad / BN, F / BF); float32 arithmetic, dh in h's dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import device
from pallas_kernels.tuning import pow2_tile

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class SwigluTiles:
    """Launch parameters: BN rows and BF columns of each half per program (powers of two),
    Triton warps."""

    rows: int = 16
    columns: int = 256
    warps: int = 4


DEFAULT_TILES = SwigluTiles()


def columns_for(F: int, tiles: SwigluTiles = DEFAULT_TILES) -> int | None:
    """The column tile for a width F: the largest power of two <= tiles.columns that divides
    F and is at least 16, or None when there is none (the layer then keeps XLA's form)."""
    return pow2_tile(F, tiles.columns)


def swiglu_reference(h_Nx2xF: jax.Array) -> jax.Array:
    """y = SiLU(gate) * up, [..., F] in h's dtype for h [..., 2, F] (gate, up): the layer's
    activation as XLA fuses it, and what the kernel differentiates."""
    return jax.nn.silu(h_Nx2xF[..., 0, :]) * h_Nx2xF[..., 1, :]


def swiglu_backward(h_Nx2xF: jax.Array, dy_NxF: jax.Array, *, tiles: SwigluTiles = DEFAULT_TILES,
                    interpret: bool | None = None) -> jax.Array:
    """dh [N, 2, F] in h's dtype for the cotangent dy [N, F] of ``swiglu_reference``.
    ``interpret`` defaults to True off the GPU."""
    if h_Nx2xF.ndim != 3 or h_Nx2xF.shape[1] != 2:
        raise ValueError(f"swiglu_backward: h must have shape [N, 2, F], got {h_Nx2xF.shape}")
    N, _, F = h_Nx2xF.shape
    if dy_NxF.shape != (N, F):
        raise ValueError(f"swiglu_backward: dy must have shape {(N, F)} for h {h_Nx2xF.shape}, "
                         f"got {dy_NxF.shape}")
    BF = columns_for(F, tiles)
    if BF is None:
        raise ValueError(f"swiglu_backward: the width F must be a multiple of 16, got {F}")
    BN = tiles.rows
    Np = -(-N // BN) * BN
    if Np != N:  # whole row tiles (a copy; B x T of the configs needs none)
        h_Nx2xF = jnp.pad(h_Nx2xF, ((0, Np - N), (0, 0), (0, 0)))
        dy_NxF = jnp.pad(dy_NxF, ((0, Np - N), (0, 0)))
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret

    def kernel(h_ref, dy_ref, dh_ref):
        g_BNxBF = h_ref[:, 0, :].astype(f32)
        u_BNxBF = h_ref[:, 1, :].astype(f32)
        dy_BNxBF = dy_ref[...].astype(f32)
        s_BNxBF = jax.nn.sigmoid(g_BNxBF)
        silu_BNxBF = g_BNxBF * s_BNxBF
        # d SiLU(g) / dg = s (1 + g (1 - s)), with 1 - s as sigmoid(-g): the subtraction would
        # lose 1 - s's digits for large g (an error of ~|g| eps where the term is ~|g| e^-g).
        dsilu_BNxBF = s_BNxBF * (1.0 + g_BNxBF * jax.nn.sigmoid(-g_BNxBF))
        dh_ref[:, 0, :] = (dy_BNxBF * u_BNxBF * dsilu_BNxBF).astype(dh_ref.dtype)
        dh_ref[:, 1, :] = (dy_BNxBF * silu_BNxBF).astype(dh_ref.dtype)

    dh = pl.pallas_call(
        kernel,
        grid=(Np // BN, F // BF),
        in_specs=[pl.BlockSpec((BN, 2, BF), lambda i, j: (i, 0, j)),
                  pl.BlockSpec((BN, BF), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((BN, 2, BF), lambda i, j: (i, 0, j)),
        out_shape=jax.ShapeDtypeStruct((Np, 2, F), h_Nx2xF.dtype),
        interpret=interpret,
        compiler_params=None if interpret else device.triton_compiler_params(tiles.warps, stages=1),
        name="swiglu_bwd",
    )(h_Nx2xF, dy_NxF)
    return dh[:N]
