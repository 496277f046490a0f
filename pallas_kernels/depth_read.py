"""An Attention Residual read and the RMSNorm after it as one Pallas kernel pass, forward and
backward (GPU; interpret mode elsewhere), for ``kimi_k3.layers.attn_res``.

Per token, with n sources s_i [D] (the sources' dtype, bf16 in training), their reciprocal RMS
rho_i, the reader's pseudo-query w [D] and the norm's scale g [D]:

    l_i = (s_i . w) rho_i,   a = softmax(l),   h = round(sum_i a_i s_i)   (to the sources' dtype)
    y   = h r g,             r = 1 / sqrt(mean(h^2) + eps)

Backward, for the cotangent dy [D] (float32 inside; dh rounded to the sources' dtype, as the
unfused norm returns it):

    dh   = round(r (dy g - h r mean(dy g h r)))          dg += dy h r      (column sums)
    da_i = dh . s_i,   dl_i = a_i (da_i - sum_j a_j da_j)
    ds_i = a_i dh + dl_i rho_i w,   drho_i = dl_i (s_i . w),   dw += sum_i dl_i rho_i s_i

Why a kernel: XLA wrote each read and its norm as four or five fusions that each walk the
sources or the mixture again, several times what reading the sources and writing y once takes.
Here the forward reads every source once and writes y and the weights a; the backward reads
the sources and dy once and writes each ds_i once. A program holds all n sources of its rows
in registers, loaded before any arithmetic, so their loads are in flight together (loaded one
source at a time, the kernel did not beat XLA's read and norm; benchmarks/attn_res_bench.py
measures them).

    forward grid (M_pad / R,): program i owns rows [i R, i R + R) of the [M, D] token views,
    all D channels (D a power of two). Backward grid (M_pad / (R S),): program i walks S steps
    of R rows and keeps the column sums dg and dw of them in registers; they come out as one
    row per program, [M_pad / (R S), D] float32, which the caller sums.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import device

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ReadTiles:
    """Launch parameters: R rows per step (a power of two), Triton warps, and (backward) the
    steps each program takes, whose column sums it keeps in registers."""

    rows: int = 1
    warps: int = 4
    steps: int = 1


# Each program loads all its sources before it computes (n loads in flight, not one), so one
# row per program keeps the registers down and several programs on each SM; the backward takes
# 8 warps, which halves each thread's registers, and two rows per program spill there
# (`python -m pallas_kernels.triton_report --depth_read` reports registers and spills).
DEFAULT_FWD_TILES = ReadTiles(rows=1, warps=4)
DEFAULT_BWD_TILES = ReadTiles(rows=1, warps=8, steps=16)


def unsupported(D: int, n: int) -> str | None:
    """None when the kernels take D channels and n sources, else why not (one line)."""
    if D < 1 or D & (D - 1):
        return f"the width D = {D} is not a power of two (the kernels hold whole rows)"
    if n < 1:
        return f"a read needs at least one source, got {n}"
    return None


def _check(sources, inv_rms, w_D, scale_D, where: str):
    if not sources or len(inv_rms) != len(sources):
        raise ValueError(f"{where}: {len(sources)} sources and {len(inv_rms)} reciprocal RMS "
                         f"arrays: one per source, at least one")
    M, D = sources[0].shape
    why = unsupported(D, len(sources))
    if why:
        raise ValueError(f"{where}: {why}")
    for i, (s, r) in enumerate(zip(sources, inv_rms, strict=True)):
        if s.shape != (M, D) or s.dtype != sources[0].dtype:
            raise ValueError(f"{where}: source {i} is {s.shape} {s.dtype}, source 0 is "
                             f"{(M, D)} {sources[0].dtype}: all must match")
        if r.shape != (M,):
            raise ValueError(f"{where}: inv_rms {i} must have shape {(M,)}, got {r.shape}")
    for name, v in (("w", w_D), ("scale", scale_D)):
        if v.shape != (D,):
            raise ValueError(f"{where}: {name} must have shape {(D,)}, got {v.shape}")


def _pow2_at_most(n: int, cap: int) -> int:
    return min(cap, 1 << max(0, n - 1).bit_length())


class _Layout:
    """Rows per step R, steps per program S, the padded token count and the grid."""

    def __init__(self, M: int, tiles: ReadTiles, interpret):
        if tiles.rows < 1 or tiles.rows & (tiles.rows - 1) or tiles.steps < 1:
            raise ValueError(f"ReadTiles: rows must be a power of two and steps >= 1, got "
                             f"{tiles}")
        self.R = _pow2_at_most(M, tiles.rows)
        self.S = max(1, min(tiles.steps, -(-M // self.R)))
        self.Mp = -(-M // (self.R * self.S)) * self.R * self.S
        self.grid = (self.Mp // (self.R * self.S),)
        self.interpret = jax.default_backend() != "gpu" if interpret is None else interpret
        self.params = (None if self.interpret
                       else device.triton_compiler_params(tiles.warps, stages=1))
        self.pad = self.Mp - M

    def rows(self, a):
        """a [M, ...] with zero rows up to M_pad (nothing when M is whole programs). A zero
        row reads as uniform weights over zero sources: y = 0 and zero gradients, no NaN."""
        return a if self.pad == 0 else jnp.pad(a, [(0, self.pad)] + [(0, 0)] * (a.ndim - 1))

    def block(self, D: int | None = None):
        """A program's rows (all S steps of R) of a [M_pad] or [M_pad, D] array."""
        n = self.R * self.S
        if D is None:
            return pl.BlockSpec((n,), lambda i: (i,))
        return pl.BlockSpec((n, D), lambda i: (i, 0))


def _whole(D: int):
    return pl.BlockSpec((D,), lambda i: (0,))


def _softmax(logits):
    """softmax over a list of [R] logits (the sources), as a list."""
    m_R = logits[0]
    for l_R in logits[1:]:
        m_R = jnp.maximum(m_R, l_R)
    e = [jnp.exp(l_R - m_R) for l_R in logits]
    den_R = e[0]
    for e_R in e[1:]:
        den_R = den_R + e_R
    return [e_R / den_R for e_R in e]


def _mix(a, s, dtype):
    """sum_i a_i s_i [R, D] float32, rounded to the sources' dtype (the read's output)."""
    h_RxD = a[0][:, None] * s[0]
    for a_R, s_RxD in zip(a[1:], s[1:], strict=True):
        h_RxD = h_RxD + a_R[:, None] * s_RxD
    return h_RxD.astype(dtype).astype(f32)


def read_norm_forward(sources, inv_rms, w_D, scale_D, *, eps: float, out_dtype,
                      tiles: ReadTiles | None = None, interpret: bool | None = None):
    """(y [M, D] in ``out_dtype``, a: n weights [M] float32) for sources n x [M, D] and their
    reciprocal RMS n x [M] (float32). ``tiles`` defaults to DEFAULT_FWD_TILES (read at the
    call; its steps are ignored: one step per program), ``interpret`` to True off the GPU."""
    _check(sources, inv_rms, w_D, scale_D, "read_norm_forward")
    tiles = dataclasses.replace(tiles or DEFAULT_FWD_TILES, steps=1)
    n, (M, D) = len(sources), sources[0].shape
    dtype = sources[0].dtype
    lay = _Layout(M, tiles, interpret)

    def kernel(*refs):
        s_refs, r_refs = refs[:n], refs[n:2 * n]
        w_ref, g_ref, y_ref, a_refs = refs[2 * n], refs[2 * n + 1], refs[2 * n + 2], refs[2 * n + 3:]
        s = [ref[...].astype(f32) for ref in s_refs]  # every load issued before any math
        # The logits' query in the sources' dtype, as the unfused read casts it for its matmul.
        w_1xD = w_ref[...].astype(dtype).astype(f32)[None, :]
        a = _softmax([jnp.sum(s_RxD * w_1xD, axis=1) * r_ref[...]
                      for s_RxD, r_ref in zip(s, r_refs, strict=True)])
        h_RxD = _mix(a, s, dtype)
        r_R = jax.lax.rsqrt(jnp.mean(h_RxD * h_RxD, axis=1) + eps)
        g_1xD = g_ref[...].astype(f32)[None, :]
        y_ref[...] = (h_RxD * r_R[:, None] * g_1xD).astype(y_ref.dtype)
        for a_ref, a_R in zip(a_refs, a, strict=True):
            a_ref[...] = a_R

    outs = pl.pallas_call(
        kernel,
        grid=lay.grid,
        in_specs=[lay.block(D)] * n + [lay.block()] * n + [_whole(D), _whole(D)],
        out_specs=[lay.block(D)] + [lay.block()] * n,
        out_shape=[jax.ShapeDtypeStruct((lay.Mp, D), out_dtype)]
        + [jax.ShapeDtypeStruct((lay.Mp,), f32)] * n,
        interpret=lay.interpret,
        compiler_params=lay.params,
        name="depth_read_norm_fwd",
    )(*map(lay.rows, sources), *(lay.rows(r.astype(f32)) for r in inv_rms), w_D, scale_D)
    return outs[0][:M], [a[:M] for a in outs[1:]]


def read_norm_backward(sources, inv_rms, w_D, scale_D, weights, dy_MxD, *, eps: float,
                       tiles: ReadTiles | None = None, interpret: bool | None = None):
    """(ds: n x [M, D] in the sources' dtype, drho: n x [M] float32, dw [D] float32,
    dscale [D] float32) for the cotangent dy [M, D] of ``read_norm_forward``'s y; ``weights``
    are its a. ``tiles`` defaults to DEFAULT_BWD_TILES."""
    _check(sources, inv_rms, w_D, scale_D, "read_norm_backward")
    tiles = tiles or DEFAULT_BWD_TILES
    n, (M, D) = len(sources), sources[0].shape
    if len(weights) != n or any(a.shape != (M,) for a in weights) or dy_MxD.shape != (M, D):
        raise ValueError(f"read_norm_backward: weights must be {n} x {(M,)} and dy {(M, D)}, got "
                         f"{[a.shape for a in weights]} and {dy_MxD.shape}")
    dtype = sources[0].dtype
    lay = _Layout(M, tiles, interpret)
    R = lay.R

    def kernel(*refs):
        s_refs, r_refs, a_refs = refs[:n], refs[n:2 * n], refs[2 * n:3 * n]
        w_ref, g_ref, dy_ref = refs[3 * n:3 * n + 3]
        outs = refs[3 * n + 3:]
        ds_refs, dr_refs, dw_ref, dg_ref = outs[:n], outs[n:2 * n], outs[2 * n], outs[2 * n + 1]
        w_1xD = w_ref[...].astype(dtype).astype(f32)[None, :]
        g_1xD = g_ref[...].astype(f32)[None, :]

        def step(j, carry):
            dw_1xD, dg_1xD = carry
            rows = pl.ds(j * R, R)
            s = [ref[rows, :].astype(f32) for ref in s_refs]
            dy_RxD = dy_ref[rows, :].astype(f32)
            a = [ref[rows] for ref in a_refs]
            h_RxD = _mix(a, s, dtype)
            r_R = jax.lax.rsqrt(jnp.mean(h_RxD * h_RxD, axis=1) + eps)
            xhat_RxD = h_RxD * r_R[:, None]
            dg_1xD = dg_1xD + jnp.sum(dy_RxD * xhat_RxD, axis=0, keepdims=True)
            gdy_RxD = dy_RxD * g_1xD
            c_R = jnp.mean(gdy_RxD * xhat_RxD, axis=1)
            # The unfused norm returns dh in the read's dtype.
            dh_RxD = (r_R[:, None] * (gdy_RxD - xhat_RxD * c_R[:, None])).astype(dtype)
            dh_RxD = dh_RxD.astype(f32)
            da = [jnp.sum(dh_RxD * s_RxD, axis=1) for s_RxD in s]
            abar_R = a[0] * da[0]
            for a_R, da_R in zip(a[1:], da[1:], strict=True):
                abar_R = abar_R + a_R * da_R
            for i in range(n):
                dl_R = a[i] * (da[i] - abar_R)
                coef_R = dl_R * r_refs[i][rows]
                ds_refs[i][rows, :] = (a[i][:, None] * dh_RxD
                                       + coef_R[:, None] * w_1xD).astype(dtype)
                dr_refs[i][rows] = dl_R * jnp.sum(s[i] * w_1xD, axis=1)
                dw_1xD = dw_1xD + jnp.sum(coef_R[:, None] * s[i], axis=0, keepdims=True)
            return dw_1xD, dg_1xD

        zero = jnp.zeros((1, D), f32)
        dw_1xD, dg_1xD = jax.lax.fori_loop(0, lay.S, step, (zero, zero))
        dw_ref[...], dg_ref[...] = dw_1xD, dg_1xD

    G = lay.grid[0]
    partial = pl.BlockSpec((1, D), lambda i: (i, 0))
    outs = pl.pallas_call(
        kernel,
        grid=lay.grid,
        in_specs=[lay.block(D)] * n + [lay.block()] * (2 * n) + [_whole(D), _whole(D),
                                                                  lay.block(D)],
        out_specs=[lay.block(D)] * n + [lay.block()] * n + [partial, partial],
        out_shape=[jax.ShapeDtypeStruct((lay.Mp, D), dtype)] * n
        + [jax.ShapeDtypeStruct((lay.Mp,), f32)] * n
        + [jax.ShapeDtypeStruct((G, D), f32)] * 2,
        interpret=lay.interpret,
        compiler_params=lay.params,
        name="depth_read_norm_bwd",
    )(*map(lay.rows, sources), *(lay.rows(r.astype(f32)) for r in inv_rms),
      *(lay.rows(a) for a in weights), w_D, scale_D, lay.rows(dy_MxD))
    ds = [d[:M] for d in outs[:n]]
    drho = [d[:M] for d in outs[n:2 * n]]
    return ds, drho, jnp.sum(outs[2 * n], axis=0), jnp.sum(outs[2 * n + 1], axis=0)

