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
traffic (the weight gradient as column reductions fused with the input gradient), many times
what reading and writing the tensors takes (benchmarks/short_conv_bench.py measures both).

    grid (B, T_pad / R, C_pad / BC); program (b, r, j) owns rows [r R, r R + R) of channel tile
    j. It reads the W shifted row windows it needs straight from x, and the backward also the
    W windows of dy ahead of its rows: as contiguous slices where they all lie inside [0, T)
    (every program but the first and last of a row), else as gathers with the row indices
    clamped into [0, T) and the rows outside masked (no padded copy of x is made). The
    backward writes the W weight-gradient sums of its R rows, partial [B, T_pad / R, W_pad,
    C_pad] float32, which the caller sums (R x fewer rows than the tokens).

The row form (``ConvTiles.form="rows"``, below) walks each program's rows one at a time instead,
and can apply KDA's activation after the convolution inside both passes: "silu" (v), or
"silu_l2" (q and k: SiLU, then the L2 norm over each group of ``group`` channels, one tile).

Tokens past T are computed on clamped rows and cut off; channels are padded to whole tiles
only when C is not a multiple of the tile (a copy; configs' channel counts need none).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import device

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ConvTiles:
    """Launch parameters: R rows and BC channels per program (powers of two), Triton warps,
    and the kernels' form: "windows" (each tap's rows as one [R, BC] window) or "rows" (the
    program's rows one at a time, see the row form below)."""

    rows: int = 32
    channels: int = 128
    warps: int = 4
    form: str = "windows"
    unroll: int = 0  # the row form: rows per step of its loop over R (0: all R unrolled)

    def __post_init__(self):
        if self.form not in ("windows", "rows"):
            raise ValueError(f"ConvTiles.form must be 'windows' or 'rows', got {self.form!r}")


DEFAULT_TILES = ConvTiles()
# The backward (x and dy in; dx and W partial weight-gradient rows out per program) is faster
# with half the channels at half the warps (benchmarks/short_conv_bench.py measures it).
DEFAULT_BWD_TILES = ConvTiles(rows=32, channels=64, warps=2)
# With an activation (the row form only; with the L2 norm the channels are the norm's group).
DEFAULT_ACT_TILES = ConvTiles(rows=64, channels=128, warps=1, form="rows", unroll=4)

ACTIVATIONS = ("none", "silu", "silu_l2")
L2_EPS = 1e-6  # the L2 norm's; kimi_k3.layers.short_conv's XLA form takes it too


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _check(x_BxTxC, tail_BxWm1xC, w_WxC, seg_BxT, where: str, activation: str = "none",
           group: int = 0, tiles: ConvTiles | None = None):
    B, T, C = x_BxTxC.shape
    W = w_WxC.shape[0]
    if activation not in ACTIVATIONS:
        raise ValueError(f"{where}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if activation == "silu_l2" and not (group >= 1 and group & (group - 1) == 0
                                        and C % group == 0):
        raise ValueError(f"{where}: activation 'silu_l2' normalises groups of `group` channels, "
                         f"which must be a power of two dividing the {C} channels; got {group}")
    if activation != "none" and tiles is not None and tiles.form != "rows":
        raise ValueError(f"{where}: an activation runs in the row form only "
                         f"(ConvTiles.form='rows'), got tiles {tiles}")
    for name, a, want in (("tail", tail_BxWm1xC, (B, W - 1, C)), ("weight", w_WxC, (W, C)),
                          ("segment_ids", seg_BxT, (B, T))):
        if a.shape != want:
            raise ValueError(f"{where}: {name} must have shape {want} for x {x_BxTxC.shape} and "
                             f"width {W}, got {a.shape}")
    if W < 2:
        raise ValueError(f"{where}: width must be >= 2 (a width of 1 is a scaling), got {W}")


class _Layout:
    """Tile sizes and the padding of channels for one call."""

    def __init__(self, B: int, T: int, C: int, W: int, tiles: ConvTiles, interpret,
                 group: int = 0):
        self.T, self.W = T, W
        self.R = min(tiles.rows, _next_pow2(T))
        # An L2 norm over groups of channels takes one group per tile: its sums are the tile's.
        self.BC = group if group else min(tiles.channels, _next_pow2(C))
        self.Tp, self.Cp, self.Wp = _round_up(T, self.R), _round_up(C, self.BC), _next_pow2(W)
        self.grid = (B, self.Tp // self.R, self.Cp // self.BC)
        self.interpret = jax.default_backend() != "gpu" if interpret is None else interpret
        self.params = (None if self.interpret
                       else device.triton_compiler_params(tiles.warps, stages=1))

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


def _plan(x_BxTxC, tail_BxWm1xC, w_WxC, seg_BxT, where: str, activation: str, group: int,
          tiles: ConvTiles, interpret):
    """Both passes' checks, then their _Layout: with the L2 norm a tile is one group."""
    _check(x_BxTxC, tail_BxWm1xC, w_WxC, seg_BxT, where, activation, group, tiles)
    (B, T, C), W = x_BxTxC.shape, w_WxC.shape[0]
    return _Layout(B, T, C, W, tiles, interpret, group if activation == "silu_l2" else 0)


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
                 seg_BxT: jax.Array, *, activation: str = "none", group: int = 0,
                 tiles: ConvTiles | None = None, interpret: bool | None = None) -> jax.Array:
    """y [B, T, C] in x's dtype: the convolution, then ``activation`` ("none", "silu", or
    "silu_l2" over groups of ``group`` channels: see the row form below). ``interpret``
    defaults to True off the GPU."""
    tiles = tiles or (DEFAULT_TILES if activation == "none" else DEFAULT_ACT_TILES)
    lay = _plan(x_BxTxC, tail_BxWm1xC, w_WxC, seg_BxT, "conv_forward", activation, group, tiles,
                interpret)
    (B, T, C), W = x_BxTxC.shape, w_WxC.shape[0]
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
        kernel if tiles.form == "windows" else _forward_rows_kernel(T, W, R, activation,
                                                                   tiles.unroll),
        grid=lay.grid,
        in_specs=lay.specs(),
        out_specs=pl.BlockSpec((None, R, lay.BC), lambda b, r, j: (b, r, j)),
        out_shape=jax.ShapeDtypeStruct((B, lay.Tp, lay.Cp), x_BxTxC.dtype),
        interpret=lay.interpret,
        compiler_params=lay.params,
        name="short_conv_fwd" if activation == "none" else f"short_conv_{activation}_fwd",
    )(lay.pad_c(x_BxTxC), lay.pad_c(tail_BxWm1xC), lay.pad_c(w_WxC),
      seg_BxT.astype(jnp.int32))
    return y[:, :T, :C]


def conv_backward(x_BxTxC: jax.Array, tail_BxWm1xC: jax.Array, w_WxC: jax.Array,
                  seg_BxT: jax.Array, dy_BxTxC: jax.Array, *, activation: str = "none",
                  group: int = 0, tiles: ConvTiles | None = None,
                  interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """(dx [B, T, C] in x's dtype, dw [W, C] float32) for the cotangent dy [B, T, C] of
    ``conv_forward``'s y with the same ``activation``. The tail's gradient (W-1 rows) is the
    caller's: ``tail_grad``."""
    tiles = tiles or (DEFAULT_BWD_TILES if activation == "none" else DEFAULT_ACT_TILES)
    lay = _plan(x_BxTxC, tail_BxWm1xC, w_WxC, seg_BxT, "conv_backward", activation, group, tiles,
                interpret)
    if dy_BxTxC.shape != x_BxTxC.shape:
        raise ValueError(f"conv_backward: dy must have x's shape {x_BxTxC.shape}, "
                         f"got {dy_BxTxC.shape}")
    (B, T, C), W = x_BxTxC.shape, w_WxC.shape[0]
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
        kernel if tiles.form == "windows" else _backward_rows_kernel(T, W, R, Wp, lay.BC,
                                                                     activation, tiles.unroll),
        grid=lay.grid,
        in_specs=[*specs, specs[0]],  # dy as x
        out_specs=[pl.BlockSpec((None, R, lay.BC), lambda b, r, j: (b, r, j)),
                   pl.BlockSpec((None, None, Wp, lay.BC), lambda b, r, j: (b, r, 0, j))],
        out_shape=[jax.ShapeDtypeStruct((B, lay.Tp, lay.Cp), x_BxTxC.dtype),
                   jax.ShapeDtypeStruct((B, lay.Tp // R, Wp, lay.Cp), f32)],
        interpret=lay.interpret,
        compiler_params=lay.params,
        name="short_conv_bwd" if activation == "none" else f"short_conv_{activation}_bwd",
    )(lay.pad_c(x_BxTxC), lay.pad_c(tail_BxWm1xC), lay.pad_c(w_WxC),
      seg_BxT.astype(jnp.int32), lay.pad_c(dy_BxTxC))
    return dx[:, :T, :C], jnp.sum(partial, axis=(0, 1))[:W, :C]


def tail_grad(w_WxC: jax.Array, seg_BxT: jax.Array, dy_BxTxC: jax.Array, *,
              activation: str = "none", group: int = 0, x_BxTxC: jax.Array | None = None,
              tail_BxWm1xC: jax.Array | None = None) -> jax.Array:
    """dtail [B, W-1, C] float32: tail row j is the input at position p = j - (W-1) < 0, read
    by tokens t = p + lag < W-1 of the first document,

        dtail_j = sum_{lag > (W-1) - j - 1} [seg_t = seg_0] w[W-1-lag] dz_t,   t = j - (W-1) + lag,

    dz = dy, or with an activation dL/dz of the first W-1 tokens from their z, recomputed from
    x and the tail (which must then be given). A few rows: plain JAX."""
    W, T = w_WxC.shape[0], seg_BxT.shape[1]
    n = min(T, W - 1)  # the tokens that read the tail
    dz_BxNxC = dy_BxTxC[:, :n].astype(f32)
    if activation != "none":
        if x_BxTxC is None or tail_BxWm1xC is None:
            raise ValueError("tail_grad: an activation needs x and the tail to recompute z")
        B, _, C = dz_BxNxC.shape
        g = group if activation == "silu_l2" else C
        z_BxNxC = _first_rows_conv(x_BxTxC[:, :n], tail_BxWm1xC, w_WxC, seg_BxT[:, :n])
        dz_BxNxC = _activation_grad(z_BxNxC.reshape(B, n, C // g, g),
                                    dz_BxNxC.reshape(B, n, C // g, g),
                                    activation).reshape(B, n, C)
    return _tail_grad_from_dz(w_WxC, seg_BxT[:, :n], dz_BxNxC)


def _first_rows_conv(x_BxNxC, tail_BxWm1xC, w_WxC, seg_BxN):
    """z [B, N, C] float32 of the first N <= W-1 tokens in plain JAX (the tail counts as the
    first token's document)."""
    W, N = w_WxC.shape[0], x_BxNxC.shape[1]
    x_ext = jnp.concatenate([tail_BxWm1xC, x_BxNxC], axis=1).astype(f32)
    seg_ext = jnp.concatenate([jnp.repeat(seg_BxN[:, :1], W - 1, axis=1), seg_BxN], axis=1)
    z = jnp.zeros(x_BxNxC.shape, f32)
    for lag in range(W):
        rows = slice(W - 1 - lag, W - 1 - lag + N)
        same = (seg_ext[:, rows] == seg_BxN)[..., None]
        z = z + jnp.where(same, x_ext[:, rows] * w_WxC[W - 1 - lag].astype(f32), 0.0)
    return z


def _tail_grad_from_dz(w_WxC: jax.Array, seg_BxT: jax.Array, dy_BxTxC: jax.Array) -> jax.Array:
    """tail_grad's sum, dy [B, T', C] holding dL/dz of the first T' tokens."""
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


# ----------------------------------------------------------------------------------------------
# The row form (ConvTiles.form == "rows"): each program walks its R rows one at a time, keeping
# the last W-1 rows of x (forward, and the backward's weight gradient) and the W-1 unfinished
# rows of dx (backward) in registers. Every row of x and dy is loaded once per program (plus
# W-1 rows at each end), and the weight gradient's sums run along each thread's own columns:
# no gathered windows and no reduction across threads. ``ConvTiles.unroll`` rows make one step
# of a loop over the R rows (the rows are unrolled, the steps are not: a bounded program and
# register count whatever R is). With an activation the forward writes only its output, and
# the backward recomputes each row's z from the rows of x it carries, so neither z nor dL/dz
# reaches memory.


def _row(ref, t, T: int):
    """Row t of a [T, BC] block as [1, BC] (t clamped into [0, T): the caller masks)."""
    return ref[pl.ds(jnp.clip(t, 0, T - 1), 1), :]


def _row_id(seg_ref, t, T: int):
    """The segment id of row t as [1] (t clamped into [0, T))."""
    return seg_ref[pl.ds(jnp.clip(t, 0, T - 1), 1)]


def _rows_before(x_ref, tail_ref, seg_ref, r0, T: int, W: int):
    """{offset: (x [1, BC] float32, segment id [1])} for the W-1 rows r0 - (W-1) .. r0 - 1:
    from x, or from the tail before the first token (which counts as its document)."""
    out = {}
    for off in range(-(W - 1), 0):
        p = r0 + off
        from_tail = tail_ref[pl.ds(jnp.clip(p + W - 1, 0, W - 2), 1), :].astype(f32)
        x_1xBC = jnp.where(p >= 0, _row(x_ref, p, T).astype(f32), from_tail)
        out[off] = (x_1xBC, jnp.where(p >= 0, _row_id(seg_ref, p, T), seg_ref[pl.ds(0, 1)]))
    return out


def _masked(same_1, a_1xBC):
    return jnp.where(same_1[:, None], a_1xBC, 0.0)


def _sigmoid(z):
    return 1.0 / (1.0 + jnp.exp(-z))


def _activate(z, activation: str):
    """y from the convolution's z (float32) [..., group]: the norm is over the last axis (in
    the kernels, the tile's channels)."""
    if activation == "none":
        return z
    s = z * _sigmoid(z)
    if activation == "silu":
        return s
    return s * lax.rsqrt(jnp.sum(s * s, axis=-1, keepdims=True) + L2_EPS)


def _activation_grad(z, dy, activation: str):
    """dL/dz from z and dL/dy (float32) [..., group], by the chain rule through ``_activate``:

        s = SiLU(z), r = (sum s^2 + eps)^(-1/2), y = s r:    ds = r (dy - y sum(y dy))
        dz = ds sigmoid(z) (1 + z sigmoid(-z))
    """
    if activation == "none":
        return dy
    sig = _sigmoid(z)
    if activation == "silu_l2":
        s = z * sig
        r = lax.rsqrt(jnp.sum(s * s, axis=-1, keepdims=True) + L2_EPS)
        y = s * r
        dy = r * (dy - y * jnp.sum(y * dy, axis=-1, keepdims=True))
    # 1 - sigmoid(z) as sigmoid(-z): the subtraction would lose its digits for large z.
    return dy * sig * (1.0 + z * _sigmoid(-z))


def _conv_row(rows: dict, i: int, w: list, W: int):
    """z of row offset i [1, BC] float32 from ``rows`` (offset -> (x, segment id)), the taps
    in lag order."""
    x_t, id_t = rows[i]
    z_1xBC = x_t * w[W - 1]  # tap W-1-lag multiplies x_{t-lag}
    for lag in range(1, W):
        x_s, id_s = rows[i - lag]
        z_1xBC += _masked(id_s == id_t, x_s * w[W - 1 - lag])
    return z_1xBC


def _keyed(values, W: int) -> dict:
    """A carried tuple of the W-1 rows before a chunk, keyed by offset -(W-1) .. -1."""
    return {o - (W - 1): v for o, v in enumerate(values)}


def _forward_rows_kernel(T: int, W: int, R: int, activation: str = "none", G: int = 0):
    """G rows per step of a loop over the program's R rows (0: all R unrolled)."""
    G = R if G <= 0 or G >= R or G < W - 1 else G

    def kernel(x_ref, tail_ref, w_ref, seg_ref, y_ref):
        r0 = pl.program_id(1) * R
        w = [w_ref[pl.ds(tap, 1), :].astype(f32) for tap in range(W)]

        def chunk(base, rows):
            """Rows base .. base + G - 1; ``rows`` keyed by offset from base, holding the W-1
            before them. Returns the W-1 last rows, keyed as the next chunk needs them."""
            for g in range(G):
                t = r0 + base + g
                rows[g] = (_row(x_ref, t, T).astype(f32), _row_id(seg_ref, t, T))
                y_1xBC = _activate(_conv_row(rows, g, w, W), activation)
                y_ref[pl.ds(base + g, 1), :] = y_1xBC.astype(y_ref.dtype)
                del rows[g - (W - 1)]  # out of every later row's window
            return tuple(rows[g] for g in range(G - (W - 1), G))

        last = chunk(0, _rows_before(x_ref, tail_ref, seg_ref, r0, T, W))
        if R > G:
            lax.fori_loop(1, R // G, lambda k, last: chunk(k * G, _keyed(last, W)), last)
    return kernel


def _backward_rows_kernel(T: int, W: int, R: int, Wp: int, BC: int, activation: str = "none",
                          G: int = 0):
    """G rows per step of a loop over the program's R rows (0: all R unrolled), then the W-1
    rows after them, whose dL/dz reaches the program's last rows' dx. With an activation, z of
    each row is recomputed from the carried rows of x."""
    G = R if G <= 0 or G >= R or G < W - 1 else G
    act = activation != "none"

    def kernel(x_ref, tail_ref, w_ref, seg_ref, dy_ref, dx_ref, dw_ref):
        r0 = pl.program_id(1) * R
        w = [w_ref[pl.ds(tap, 1), :].astype(f32) for tap in range(W)]

        def chunk(base, n, rows, dx, dw, base_static, own: bool):
            """Rows base .. base + n - 1 (the program's own, or with ``own`` False the W-1
            after them). ``rows``: offset from base -> (x, segment id), the W-1 rows before
            the chunk included; ``dx``: offset -> dx of that row so far (the dz_t with
            t - lag = row, in lag order); ``dw``: the W taps' sums. ``base_static``: base when
            it is a Python int (the first chunk and the rows after), to leave out rows that
            are not the program's; inside the loop every row is."""
            def is_own(j):
                if base_static is not None and not 0 <= base_static + j < R:
                    return False
                return own or j < 0

            for g in range(n):
                t = r0 + base + g
                id_t = _row_id(seg_ref, t, T)
                dz_t = jnp.where(t < T, _row(dy_ref, t, T).astype(f32), 0.0)
                if own or act:
                    rows[g] = (_row(x_ref, t, T).astype(f32), id_t)
                if act:
                    dz_t = _activation_grad(_conv_row(rows, g, w, W), dz_t, activation)
                if own:
                    # Weight gradient: tap W-1-lag multiplies x_{t-lag}, if in t's document.
                    for lag in range(W):
                        x_s, id_s = rows[g - lag]
                        prod = x_s * dz_t
                        dw[W - 1 - lag] += prod if lag == 0 else _masked(id_s == id_t, prod)
                # Input gradient: token t read x_s (s = t - lag, a row of this program)
                # through tap W-1-lag, if s is in its document.
                for lag in range(W):
                    j = g - lag
                    if is_own(j):
                        term = dz_t * w[W - 1 - lag]
                        dx[j] = term if lag == 0 else dx[j] + _masked(rows[j][1] == id_t, term)
                j = g - (W - 1)  # row j has all its W terms
                if j in dx and is_own(j):
                    dx_ref[pl.ds(base + j, 1), :] = dx.pop(j).astype(dx_ref.dtype)
                rows.pop(g - (W - 1), None)
            # Keyed by offset from the next chunk's base.
            return ({o - n: v for o, v in rows.items()}, {o - n: v for o, v in dx.items()}, dw)

        rows, dx, dw = chunk(0, G, _rows_before(x_ref, tail_ref, seg_ref, r0, T, W), {},
                             [jnp.zeros((1, BC), f32) for _ in range(W)], 0, True)
        if R > G:
            def body(k, carry):
                rows_c, dx_c, dw_c = carry
                rows, dx, dw = chunk(k * G, G, _keyed(rows_c, W), _keyed(dx_c, W), list(dw_c),
                                     None, True)
                return (tuple(rows[o] for o in range(-(W - 1), 0)),
                        tuple(dx[o] for o in range(-(W - 1), 0)), tuple(dw))

            carry = (tuple(rows[o] for o in range(-(W - 1), 0)),
                     tuple(dx[o] for o in range(-(W - 1), 0)), tuple(dw))
            rows_c, dx_c, dw_c = lax.fori_loop(1, R // G, body, carry)
            rows, dx, dw = _keyed(rows_c, W), _keyed(dx_c, W), list(dw_c)
        chunk(R, W - 1, rows, dx, dw, R, False)
        for tap in range(W):
            dw_ref[pl.ds(tap, 1), :] = dw[tap]
        for tap in range(W, Wp):  # the padding rows of the power-of-two output block
            dw_ref[pl.ds(tap, 1), :] = jnp.zeros((1, BC), f32)
    return kernel
