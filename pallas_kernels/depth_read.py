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
sources or the mixture again (configs/1b.py's 41 reads: 24 ms of a 4-row micro-batch on the
H200, where reading the sources and writing y once takes a few). Here the forward reads every
source once (an online softmax over the sources) and writes y and the weights a; the backward
reads the sources twice (the mixture, then the gradients; the second read mostly from L2) and
dy once, and writes each ds_i once.

    grid (M_pad / R,); program i owns rows [i R, i R + R) of the [M, D] token views, all D
    channels (D a power of two). The column sums dg and dw come out as one row per program,
    [M_pad / R, D] float32, which the caller sums.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Pallas-Triton (deprecated in JAX 0.11, may disappear: then the layer's XLA form is used)
    from jax.experimental.pallas import triton as pl_triton
except ImportError:  # pragma: no cover - depends on the installed JAX
    pl_triton = None

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ReadTiles:
    """Launch parameters: rows per program (a power of two) and Triton warps."""

    rows: int = 8
    warps: int = 8


# At D = 2048, bf16, five sources, Triton 3.6 for sm_90 (pallas_kernels.triton_report's
# method): 4 rows at 8 warps take 141 (forward) and 138 (backward) registers without spills;
# 8 rows take 255 in the forward, 16 rows spill.
DEFAULT_FWD_TILES = ReadTiles(rows=4, warps=8)
DEFAULT_BWD_TILES = ReadTiles(rows=4, warps=8)


def available() -> bool:
    """Whether this JAX can compile the kernels for the GPU (they need Pallas-Triton)."""
    return pl_triton is not None


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


class _Layout:
    def __init__(self, M: int, tiles: ReadTiles, interpret):
        self.R = min(tiles.rows, 1 << max(0, M - 1).bit_length())
        self.Mp = -(-M // self.R) * self.R
        self.grid = (self.Mp // self.R,)
        self.interpret = jax.default_backend() != "gpu" if interpret is None else interpret
        self.params = None if self.interpret else _triton_params(tiles.warps)
        self.pad = self.Mp - M

    def rows(self, a):
        """a [M, ...] with zero rows up to M_pad (nothing when M is whole tiles). A zero row
        reads as uniform weights over zero sources: y = 0 and zero gradients, no NaN."""
        return a if self.pad == 0 else jnp.pad(a, [(0, self.pad)] + [(0, 0)] * (a.ndim - 1))

    def block(self, D: int | None = None):
        if D is None:
            return pl.BlockSpec((self.R,), lambda i: (i,))
        return pl.BlockSpec((self.R, D), lambda i: (i, 0))


def _whole(D: int):
    return pl.BlockSpec((D,), lambda i: (0,))


def read_norm_forward(sources, inv_rms, w_D, scale_D, *, eps: float, out_dtype,
                      tiles: ReadTiles | None = None, interpret: bool | None = None):
    """(y [M, D] in ``out_dtype``, a: n weights [M] float32) for sources n x [M, D] and their
    reciprocal RMS n x [M] (float32). ``tiles`` defaults to DEFAULT_FWD_TILES (read at the
    call), ``interpret`` to True off the GPU."""
    _check(sources, inv_rms, w_D, scale_D, "read_norm_forward")
    tiles = tiles or DEFAULT_FWD_TILES
    n, (M, D) = len(sources), sources[0].shape
    dtype = sources[0].dtype
    lay = _Layout(M, tiles, interpret)

    def kernel(*refs):
        s_refs, r_refs = refs[:n], refs[n:2 * n]
        w_ref, g_ref, y_ref, a_refs = refs[2 * n], refs[2 * n + 1], refs[2 * n + 2], refs[2 * n + 3:]
        # The logits' query in the sources' dtype, as the unfused read casts it for its matmul.
        w_1xD = w_ref[...].astype(dtype).astype(f32)[None, :]
        logits, h_RxD, m_R, den_R = [], None, None, None
        for i in range(n):  # an online softmax: each source is read once
            s_RxD = s_refs[i][...].astype(f32)
            l_R = jnp.sum(s_RxD * w_1xD, axis=1) * r_refs[i][...]
            logits.append(l_R)
            if i == 0:
                m_R, den_R, h_RxD = l_R, jnp.ones_like(l_R), s_RxD
                continue
            m_new = jnp.maximum(m_R, l_R)
            old, new = jnp.exp(m_R - m_new), jnp.exp(l_R - m_new)
            h_RxD = h_RxD * old[:, None] + s_RxD * new[:, None]
            den_R, m_R = den_R * old + new, m_new
        h_RxD = (h_RxD / den_R[:, None]).astype(dtype).astype(f32)
        r_R = jax.lax.rsqrt(jnp.mean(h_RxD * h_RxD, axis=1) + eps)
        g_1xD = g_ref[...].astype(f32)[None, :]
        y_ref[...] = (h_RxD * r_R[:, None] * g_1xD).astype(y_ref.dtype)
        for i in range(n):
            a_refs[i][...] = jnp.exp(logits[i] - m_R) / den_R

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

    def kernel(*refs):
        s_refs, r_refs, a_refs = refs[:n], refs[n:2 * n], refs[2 * n:3 * n]
        w_ref, g_ref, dy_ref = refs[3 * n:3 * n + 3]
        outs = refs[3 * n + 3:]
        ds_refs, dr_refs, dw_ref, dg_ref = outs[:n], outs[n:2 * n], outs[2 * n], outs[2 * n + 1]
        w_1xD = w_ref[...].astype(dtype).astype(f32)[None, :]
        g_1xD = g_ref[...].astype(f32)[None, :]
        a = [a_refs[i][...] for i in range(n)]
        h_RxD = a[0][:, None] * s_refs[0][...].astype(f32)
        for i in range(1, n):
            h_RxD += a[i][:, None] * s_refs[i][...].astype(f32)
        h_RxD = h_RxD.astype(dtype).astype(f32)
        r_R = jax.lax.rsqrt(jnp.mean(h_RxD * h_RxD, axis=1) + eps)
        xhat_RxD = h_RxD * r_R[:, None]
        dy_RxD = dy_ref[...].astype(f32)
        dg_ref[...] = jnp.sum(dy_RxD * xhat_RxD, axis=0)[None, :]
        gdy_RxD = dy_RxD * g_1xD
        c_R = jnp.mean(gdy_RxD * xhat_RxD, axis=1)
        dh_RxD = (r_R[:, None] * (gdy_RxD - xhat_RxD * c_R[:, None])).astype(dtype).astype(f32)
        da = [jnp.sum(dh_RxD * s_refs[i][...].astype(f32), axis=1) for i in range(n)]
        abar_R = a[0] * da[0]
        for i in range(1, n):
            abar_R += a[i] * da[i]
        dw_1xD = jnp.zeros((1, D), f32)
        for i in range(n):
            s_RxD = s_refs[i][...].astype(f32)
            dl_R = a[i] * (da[i] - abar_R)
            coef_R = dl_R * r_refs[i][...]
            ds_refs[i][...] = (a[i][:, None] * dh_RxD + coef_R[:, None] * w_1xD).astype(dtype)
            dr_refs[i][...] = dl_R * jnp.sum(s_RxD * w_1xD, axis=1)
            dw_1xD += jnp.sum(coef_R[:, None] * s_RxD, axis=0)[None, :]
        dw_ref[...] = dw_1xD

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


def _triton_params(warps: int):
    cls = getattr(pl_triton, "CompilerParams", None) or pl_triton.TritonCompilerParams
    return cls(num_warps=warps, num_stages=1)
