"""The short convolution's weight gradient as a Pallas kernel (GPU; interpret mode elsewhere).

    dw[w, c] = sum_{b, t} same_lag(b, t) * x_{b, t-lag}[c] * dy_{b, t}[c],     lag = W - 1 - w

for the causal depthwise convolution of ``kimi_k3.layers.short_conv`` (y_t = sum_w w[w]
x_{t-lag}, taps only inside the token's own document). ``x_ext`` [B, W-1+T, C] holds the W-1
inputs before the first token, and same_lag(b, t) says x_{t-lag} has token t's segment id (the
inputs before the sequence count as the first token's document, as in the layer).

Why a kernel: this is a sum over every token (B T rows) per channel. Left to XLA:GPU it fused
with the other consumers of x and dy (the input gradient, the SiLU's backward, the recomputed
convolution) into one multi-output reduction that ran at 3.9 ms per KDA layer in the 1B step,
where reading x and dy takes about 0.1 ms. Here the sum is a kernel of its own:

    grid (B, T_pad / R, C_pad / BC); program (b, r, j) reads dy rows [r R, r R + R) and the
    W shifted windows of x_ext it needs (rows r R + w, w = 0..W-1: R + W - 1 rows in all) of
    channel tile j, and writes the W partial sums of its R rows: partial [B, T_pad/R, W_pad, C_pad]
    float32. The caller's sum over (B, T_pad/R) is a small reduction (16 x fewer rows).

Rows and channels are padded with zeros to whole tiles (nothing padded contributes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Pallas-Triton (deprecated in JAX 0.11, may disappear: then XLA's sum is used)
    from jax.experimental.pallas import triton as pl_triton
except ImportError:  # pragma: no cover - depends on the installed JAX
    pl_triton = None

f32 = jnp.float32

ROWS = 256  # R: tokens per program (a power of two; fewer for short sequences)
BLOCK_C = 128  # BC: channels per program


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def conv_weight_grad(x_ext_BxTWxC: jax.Array, dy_BxTxC: jax.Array, seg_BxT: jax.Array,
                     width: int, *, interpret: bool | None = None) -> jax.Array:
    """dw [W, C] float32 for x_ext [B, W-1+T, C], dy [B, T, C] (any float dtype), segment ids
    seg [B, T] int32, W = ``width``. ``interpret`` defaults to True off the GPU."""
    B, T, C = dy_BxTxC.shape
    W = width
    if x_ext_BxTWxC.shape != (B, W - 1 + T, C):
        raise ValueError(f"conv_weight_grad: x_ext must be [B, W-1+T, C] = {(B, W - 1 + T, C)}, "
                         f"got {x_ext_BxTWxC.shape}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    R = min(ROWS, _next_pow2(T))
    BC = min(BLOCK_C, _next_pow2(C))
    Tp, Cp, Wp = _round_up(T, R), _round_up(C, BC), _next_pow2(W)
    # Zeros past the last token and channel; x_ext gets the same rows past its end (its
    # windows reach row Tp - 1 + W - 1), and the segment ids of the W-1 inputs before the first
    # token are the first token's. (No copies when T and C are whole tiles already.)
    dy = _pad(dy_BxTxC, Tp - T, Cp - C)
    x = _pad(x_ext_BxTWxC, Tp - T, Cp - C)
    seg = seg_BxT.astype(jnp.int32)
    seg_ext = jnp.concatenate([jnp.broadcast_to(seg[:, :1], (B, W - 1)), seg], axis=1)
    seg_ext = jnp.pad(seg_ext, ((0, 0), (0, Tp - T)), constant_values=-1)
    TWp = Tp + W - 1

    def kernel(x_ref, dy_ref, seg_ref, o_ref):
        t0 = pl.program_id(1) * R
        dy = dy_ref[...].astype(f32)  # [R, BC]
        seg_t = seg_ref[pl.ds(t0 + W - 1, R)]  # token t's id (x_ext row t + W - 1)
        for w in range(Wp):
            if w >= W:  # the padding rows of the power-of-two output block
                o_ref[pl.ds(w, 1), :] = jnp.zeros((1, BC), f32)
                continue
            # Tap w multiplies x_{t-lag}, lag = W-1-w: x_ext row t + w.
            x = x_ref[pl.ds(t0 + w, R), :].astype(f32)
            same = seg_ref[pl.ds(t0 + w, R)] == seg_t
            prod = jnp.where(same[:, None], x * dy, 0.0)
            o_ref[pl.ds(w, 1), :] = jnp.sum(prod, axis=0, keepdims=True)

    partial = pl.pallas_call(
        kernel,
        grid=(B, Tp // R, Cp // BC),
        in_specs=[
            # Every row of the batch row's channel tile; the kernel reads its windows.
            pl.BlockSpec((None, TWp, BC), lambda b, r, j: (b, 0, j)),
            pl.BlockSpec((None, R, BC), lambda b, r, j: (b, r, j)),
            pl.BlockSpec((None, TWp), lambda b, r, j: (b, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, Wp, BC), lambda b, r, j: (b, r, 0, j)),
        out_shape=jax.ShapeDtypeStruct((B, Tp // R, Wp, Cp), f32),
        interpret=interpret,
        # Triton, not the Mosaic GPU default: the whole-row x block stays in memory (only the
        # windows are loaded), where Mosaic GPU would stage it in shared memory.
        compiler_params=None if interpret else _triton_params(),
        name="short_conv_weight_grad",
    )(x, dy, seg_ext)
    return jnp.sum(partial, axis=(0, 1))[:W, :C]


def available() -> bool:
    """Whether this JAX can compile the kernel for the GPU (it needs Pallas-Triton)."""
    return pl_triton is not None


def _triton_params():
    cls = getattr(pl_triton, "CompilerParams", None) or pl_triton.TritonCompilerParams
    return cls(num_warps=4, num_stages=1)


def _pad(a, rows: int, cols: int):
    if rows == 0 and cols == 0:
        return a
    return jnp.pad(a, ((0, 0), (0, rows), (0, cols)))
