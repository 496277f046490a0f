"""The causal depthwise short convolution as Pallas kernels: forward, and a backward that gives
the input and weight gradients in one pass (GPU; interpret mode elsewhere).

    y_t[c]  = sum_{lag=0}^{W-1} same(t, t-lag) w[W-1-lag, c] x_{t-lag}[c]
    dx_s[c] = sum_{lag=0}^{W-1} same(s+lag, s) w[W-1-lag, c] dy_{s+lag}[c]        (s+lag < T)
    dw[W-1-lag, c] = sum_{b, t} same(t, t-lag) x_{b, t-lag}[c] dy_{b, t}[c]

for ``kimi_k3.layers.short_conv``: same(t, s) says token s is in token t's document (equal
segment ids). Inputs before the first token (t - lag < 0) come from ``tail`` [B, W-1, C] and
count as the first token's document, as in the layer. float32 arithmetic, results in x's dtype
(dw in float32).

Why kernels: XLA:GPU wrote the 1B step's convolutions as fusions far slower than their memory
traffic (the forward at ~0.6 TB/s, the weight gradient as column reductions fused with the input
gradient: 20 ms of each 4-row micro-batch where reading and writing the tensors takes ~2).

    grid (B, T_pad / R, C_pad / BC); program (b, r, j) owns rows [r R, r R + R) of channel tile
    j. It reads the W shifted row windows it needs straight from x, and the backward also the
    W windows of dy ahead of its rows: as contiguous slices where they all lie inside [0, T)
    (every program but the first and last of a row), else as gathers with the row indices
    clamped into [0, T) and the rows outside masked (no padded copy of x is made). The
    backward writes the W weight-gradient sums of its R rows, partial [B, T_pad / R, W_pad,
    C_pad] float32, which the caller sums (R x fewer rows than the tokens).

Tokens past T are computed on clamped rows and cut off; channels are padded to whole tiles
only when C is not a multiple of the tile (a copy; configs' channel counts need none).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.triton_compat import compiler_params, pl_triton

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ConvTiles:
    """Launch parameters: R rows and BC channels per program (powers of two), Triton warps."""

    rows: int = 32
    channels: int = 128
    warps: int = 4


DEFAULT_TILES = ConvTiles()
# The backward (x and dy in; dx and W partial weight-gradient rows out per program) measured
# faster with half the channels at half the warps: short_conv_bench.py on the H200, one
# [4, 4096, 2048] bf16 convolution, forward+backward 0.191 ms against 0.223 with the forward's.
DEFAULT_BWD_TILES = ConvTiles(rows=32, channels=64, warps=2)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def available() -> bool:
    """Whether this JAX can compile the kernels for the GPU (they need Pallas-Triton)."""
    return pl_triton is not None


def _check(x_BxTxC, tail_BxWm1xC, w_WxC, seg_BxT, where: str):
    B, T, C = x_BxTxC.shape
    W = w_WxC.shape[0]
    for name, a, want in (("tail", tail_BxWm1xC, (B, W - 1, C)), ("weight", w_WxC, (W, C)),
                          ("segment_ids", seg_BxT, (B, T))):
        if a.shape != want:
            raise ValueError(f"{where}: {name} must have shape {want} for x {x_BxTxC.shape} and "
                             f"width {W}, got {a.shape}")
    if W < 2:
        raise ValueError(f"{where}: width must be >= 2 (a width of 1 is a scaling), got {W}")


class _Layout:
    """Tile sizes and the padding of channels for one call."""

    def __init__(self, B: int, T: int, C: int, W: int, tiles: ConvTiles, interpret):
        self.T, self.W = T, W
        self.R = min(tiles.rows, _next_pow2(T))
        self.BC = min(tiles.channels, _next_pow2(C))
        self.Tp, self.Cp, self.Wp = _round_up(T, self.R), _round_up(C, self.BC), _next_pow2(W)
        self.grid = (B, self.Tp // self.R, self.Cp // self.BC)
        self.interpret = jax.default_backend() != "gpu" if interpret is None else interpret
        self.params = None if self.interpret else compiler_params(tiles.warps)

    def pad_c(self, a):
        """a [..., C] with zero channels up to C_pad (nothing when C is whole tiles)."""
        extra = self.Cp - a.shape[-1]
        return a if extra == 0 else jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, extra)])

    def specs(self):
        """Block specs of x (the batch row's whole channel tile: the kernel reads its own row
        windows; dy's too), tail, weight and segment ids."""
        T, W, BC = self.T, self.W, self.BC
        return [
            pl.BlockSpec((None, T, BC), lambda b, r, j: (b, 0, j)),
            pl.BlockSpec((None, W - 1, BC), lambda b, r, j: (b, 0, j)),
            pl.BlockSpec((W, BC), lambda b, r, j: (0, j)),
            pl.BlockSpec((None, T), lambda b, r, j: (b, 0)),
        ]


def _window(ref, idx_R, T: int):
    """ref's rows idx (clamped into [0, T): always a valid address; the caller masks)."""
    return ref[jnp.clip(idx_R, 0, T - 1)]


def _tap_inputs(x_ref, tail_ref, seg_ref, rows_R, seg_R, lag: int, T: int, W: int):
    """x_{t-lag} for the program's rows t, float32 [R, BC]: from x, from the tail before the
    first token, zero across documents (the tail counts as the first token's document)."""
    src_R = rows_R - lag
    x_RxBC = _window(x_ref, src_R, T).astype(f32)
    if lag == 0:
        return x_RxBC
    same_R = _window(seg_ref, src_R, T) == seg_R
    tail_RxBC = tail_ref[jnp.clip(src_R + (W - 1), 0, W - 2)].astype(f32)
    first_R = seg_R == seg_ref[0]
    from_x = jnp.where(same_R[:, None], x_RxBC, 0.0)
    from_tail = jnp.where(first_R[:, None], tail_RxBC, 0.0)
    return jnp.where((src_R >= 0)[:, None], from_x, from_tail)


def _tap_inputs_inside(x_ref, seg_ref, r0, seg_R, lag: int, R: int):
    """``_tap_inputs`` for a program whose rows t all have t - lag in [0, T): one contiguous
    window of x and of the segment ids (no clamped gathers, no tail)."""
    x_RxBC = x_ref[pl.ds(r0 - lag, R), :].astype(f32)
    if lag == 0:
        return x_RxBC
    return jnp.where((seg_ref[pl.ds(r0 - lag, R)] == seg_R)[:, None], x_RxBC, 0.0)


def _by_position(body, inside, possible: bool):
    """body(True) for a program whose row windows all lie inside [0, T) (contiguous slices),
    body(False) for the others (clamped gathers, masks, the tail). ``possible`` is False when
    no program can be inside: body(True) is then never traced (its R-row slices would not fit
    a shorter sequence)."""
    if not possible:
        return body(False)
    return lax.cond(inside, lambda: body(True), lambda: body(False))


def conv_forward(x_BxTxC: jax.Array, tail_BxWm1xC: jax.Array, w_WxC: jax.Array,
                 seg_BxT: jax.Array, *, tiles: ConvTiles = DEFAULT_TILES,
                 interpret: bool | None = None) -> jax.Array:
    """y [B, T, C] in x's dtype. ``interpret`` defaults to True off the GPU."""
    _check(x_BxTxC, tail_BxWm1xC, w_WxC, seg_BxT, "conv_forward")
    (B, T, C), W = x_BxTxC.shape, w_WxC.shape[0]
    lay = _Layout(B, T, C, W, tiles, interpret)
    R = lay.R

    def kernel(x_ref, tail_ref, w_ref, seg_ref, y_ref):
        r0 = pl.program_id(1) * R
        rows_R = r0 + jnp.arange(R)

        def conv(inside: bool):
            seg_R = seg_ref[pl.ds(r0, R)] if inside else _window(seg_ref, rows_R, T)
            acc_RxBC = jnp.zeros((R, lay.BC), f32)
            for lag in range(W):
                w_1xBC = w_ref[pl.ds(W - 1 - lag, 1), :].astype(f32)
                x_RxBC = (_tap_inputs_inside(x_ref, seg_ref, r0, seg_R, lag, R) if inside else
                          _tap_inputs(x_ref, tail_ref, seg_ref, rows_R, seg_R, lag, T, W))
                acc_RxBC += x_RxBC * w_1xBC
            return acc_RxBC

        # Inside: every program but the first and last of a row.
        inside = (r0 >= W - 1) & (r0 + R <= T)
        y_ref[...] = _by_position(conv, inside, R <= T).astype(y_ref.dtype)

    y = pl.pallas_call(
        kernel,
        grid=lay.grid,
        in_specs=lay.specs(),
        out_specs=pl.BlockSpec((None, R, lay.BC), lambda b, r, j: (b, r, j)),
        out_shape=jax.ShapeDtypeStruct((B, lay.Tp, lay.Cp), x_BxTxC.dtype),
        interpret=lay.interpret,
        compiler_params=lay.params,
        name="short_conv_fwd",
    )(lay.pad_c(x_BxTxC), lay.pad_c(tail_BxWm1xC), lay.pad_c(w_WxC),
      seg_BxT.astype(jnp.int32))
    return y[:, :T, :C]


def conv_backward(x_BxTxC: jax.Array, tail_BxWm1xC: jax.Array, w_WxC: jax.Array,
                  seg_BxT: jax.Array, dy_BxTxC: jax.Array, *, tiles: ConvTiles = DEFAULT_BWD_TILES,
                  interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """(dx [B, T, C] in x's dtype, dw [W, C] float32) for the cotangent dy [B, T, C]. The
    tail's gradient (W-1 rows) is the caller's: ``tail_grad``."""
    _check(x_BxTxC, tail_BxWm1xC, w_WxC, seg_BxT, "conv_backward")
    if dy_BxTxC.shape != x_BxTxC.shape:
        raise ValueError(f"conv_backward: dy must have x's shape {x_BxTxC.shape}, "
                         f"got {dy_BxTxC.shape}")
    (B, T, C), W = x_BxTxC.shape, w_WxC.shape[0]
    lay = _Layout(B, T, C, W, tiles, interpret)
    R, Wp = lay.R, lay.Wp
    specs = lay.specs()

    def kernel(x_ref, tail_ref, w_ref, seg_ref, dy_ref, dx_ref, dw_ref):
        r0 = pl.program_id(1) * R
        rows_R = r0 + jnp.arange(R)

        def grads(inside: bool):
            """(dx [R, BC], the W taps' weight-gradient sums [1, BC] each)."""
            if inside:
                seg_R = seg_ref[pl.ds(r0, R)]
                dy_RxBC = dy_ref[pl.ds(r0, R), :].astype(f32)
            else:
                seg_R = _window(seg_ref, rows_R, T)
                # dy of the program's own rows (zero past the last token: they add nothing).
                dy_RxBC = jnp.where((rows_R < T)[:, None],
                                    _window(dy_ref, rows_R, T).astype(f32), 0.0)
            dx_RxBC = jnp.zeros((R, lay.BC), f32)
            dw_taps = [None] * W
            for lag in range(W):
                tap = W - 1 - lag
                w_1xBC = w_ref[pl.ds(tap, 1), :].astype(f32)
                # Input gradient: token s+lag read x_s through this tap, if s is in its
                # document.
                dst_R = rows_R + lag
                if inside:
                    dy_ahead = dy_ref[pl.ds(r0 + lag, R), :].astype(f32)
                    ok_R = seg_ref[pl.ds(r0 + lag, R)] == seg_R
                else:
                    dy_ahead = _window(dy_ref, dst_R, T).astype(f32)
                    ok_R = (dst_R < T) & (_window(seg_ref, dst_R, T) == seg_R)
                if lag:
                    dy_ahead = jnp.where(ok_R[:, None], dy_ahead, 0.0)
                dx_RxBC += dy_ahead * w_1xBC
                # Weight gradient: this tap's products over the program's rows.
                x_RxBC = (_tap_inputs_inside(x_ref, seg_ref, r0, seg_R, lag, R) if inside else
                          _tap_inputs(x_ref, tail_ref, seg_ref, rows_R, seg_R, lag, T, W))
                dw_taps[tap] = jnp.sum(x_RxBC * dy_RxBC, axis=0, keepdims=True)
            return dx_RxBC, *dw_taps

        # Inside: every program but the first and last of a row (dy's W-1 rows ahead too).
        inside = (r0 >= W - 1) & (r0 + R + W - 1 <= T)
        dx_RxBC, *dw_taps = _by_position(grads, inside, R + W - 1 <= T)
        for tap in range(W):
            dw_ref[pl.ds(tap, 1), :] = dw_taps[tap]
        for tap in range(W, Wp):  # the padding rows of the power-of-two output block
            dw_ref[pl.ds(tap, 1), :] = jnp.zeros((1, lay.BC), f32)
        dx_ref[...] = dx_RxBC.astype(dx_ref.dtype)

    dx, partial = pl.pallas_call(
        kernel,
        grid=lay.grid,
        in_specs=[*specs, specs[0]],  # dy as x
        out_specs=[pl.BlockSpec((None, R, lay.BC), lambda b, r, j: (b, r, j)),
                   pl.BlockSpec((None, None, Wp, lay.BC), lambda b, r, j: (b, r, 0, j))],
        out_shape=[jax.ShapeDtypeStruct((B, lay.Tp, lay.Cp), x_BxTxC.dtype),
                   jax.ShapeDtypeStruct((B, lay.Tp // R, Wp, lay.Cp), f32)],
        interpret=lay.interpret,
        compiler_params=lay.params,
        name="short_conv_bwd",
    )(lay.pad_c(x_BxTxC), lay.pad_c(tail_BxWm1xC), lay.pad_c(w_WxC),
      seg_BxT.astype(jnp.int32), lay.pad_c(dy_BxTxC))
    return dx[:, :T, :C], jnp.sum(partial, axis=(0, 1))[:W, :C]


def tail_grad(w_WxC: jax.Array, seg_BxT: jax.Array, dy_BxTxC: jax.Array) -> jax.Array:
    """dtail [B, W-1, C] float32: tail row j is the input at position p = j - (W-1) < 0, read
    by tokens t = p + lag < W-1 of the first document,

        dtail_j = sum_{lag > (W-1) - j - 1} [seg_t = seg_0] w[W-1-lag] dy_t,   t = j - (W-1) + lag.

    A few rows: plain JAX."""
    W, T = w_WxC.shape[0], seg_BxT.shape[1]
    first_BxT = (seg_BxT == seg_BxT[:, :1])[..., None]
    rows = []
    for j in range(W - 1):
        acc = jnp.zeros((dy_BxTxC.shape[0], dy_BxTxC.shape[2]), f32)
        for lag in range(W):
            t = j - (W - 1) + lag
            if 0 <= t < T:
                term = jnp.where(first_BxT[:, t], dy_BxTxC[:, t].astype(f32), 0.0)
                acc = acc + term * w_WxC[W - 1 - lag].astype(f32)
        rows.append(acc)
    return jnp.stack(rows, axis=1)

