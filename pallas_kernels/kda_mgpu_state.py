"""KDA's state passes on Hopper (sm_90) in Pallas' Mosaic GPU backend: drop-ins for
``kda_calls.state_fwd`` and ``kda_calls.state_bwd`` (K = V = 128, C = 64, bf16 intermediates).

One CTA of one warpgroup per (value head row bh, V tile of BV = 64 columns): grid
(B*HV, V / BV), each walking all N chunks with a transposed [BV, K] state in float32 registers
(the wgmma accumulator layout). Per chunk, with ``kda_body.state_step``'s and
``reverse_step``'s notation (St = S^T, dSt = (dL/dS after the chunk)^T):

    forward   V'  = U - W St^T                   [C, K] x [K, BV]   (St^T: a transposed view)
              O   = QG St^T + Aqk V'             [C, K] x [K, BV] + [C, C] x [C, BV]
              St <- St Diag(gam) + V'^T Kg        [BV, C] x [C, K]
    backward  dV' = Aqk^T dO + Kg dSt^T           [C, C] x [C, BV] + [C, K] x [K, BV]
              dSt <- dSt Diag(gam) + dO^T QG - dV'^T W      [BV, C] x [C, K], twice

The state enters each product as bf16 (as the Triton kernels' ``mm`` casts it). The two
products after the first of a chunk are issued together and waited once. Every operand buffer
is single: the next chunk's inputs are copied in (TMA) as soon as this chunk's last product
reading each has been waited, so the copies run under the remaining products. That keeps a CTA
under 113 KB of shared memory (Pallas' estimate), two per SM: 256 CTAs at B*HV = 128 in one
wave, each SM switching between two independent chains.

Shapes as ``kda_calls``: forward O [B, Tp, HV, V] (bf16), final St [B*HV, V, K] float32 and,
with ``residuals``, h [B*HV, N, V, K] (the state entering each chunk) and V' [B*HV, N, C, V]
(bf16); backward dh [B*HV, N, V, K], dV' [B*HV, N, C, V] (bf16) and dS0t [B*HV, V, K] float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda_body import KdaConfig
from pallas_kernels.kda_mgpu import CHUNK, DIM, _swizzled, plgpu

f32, bf16 = jnp.float32, jnp.bfloat16
BV = 64  # V columns per CTA (see the module docstring)


def unsupported_reason(cfg: KdaConfig, out_dtype=bf16) -> str | None:
    """None when the passes here compute this call (``out_dtype``: the forward's O), else why
    not."""
    checks = [
        (plgpu is None, "no Mosaic GPU Pallas in this JAX"),
        (cfg.C != CHUNK, f"chunk {cfg.C} != {CHUNK}"),
        (cfg.K != DIM or cfg.V != DIM, f"K, V = {cfg.K}, {cfg.V} (want {DIM})"),
        (cfg.cd != "bfloat16", f"compute dtype {cfg.cd}"),
        (jnp.dtype(out_dtype) != jnp.dtype(bf16), f"output dtype {out_dtype}"),
    ]
    for bad, why in checks:
        if bad:
            return why
    return None


class _Ops:
    """The pieces both passes use, compiled or interpreted."""

    def __init__(self, compiled: bool):
        self.compiled = compiled

    def tview(self, ref, tbuf):
        """ref^T as a wgmma operand: a transposed view; the interpreter's wgmma takes none, so
        there ref^T is stored into tbuf (a buffer of the transposed shape)."""
        if self.compiled:
            return plgpu.transpose_ref(ref, (1, 0))
        tbuf[...] = ref[...].T
        return tbuf

    @staticmethod
    def dots(*groups):
        """For each (shape, pairs) of ``groups``, sum(a @ b for a, b in pairs) float32: every
        wgmma issued first, then one wait (reading the accumulators)."""
        def scoped(*accs):
            for acc, (_, pairs) in zip(accs, groups, strict=True):
                for a, b in pairs:
                    plgpu.wgmma(acc, a, b)
            return tuple(acc[...] for acc in accs)
        return pl.run_scoped(scoped, *(plgpu.ACC(shape, f32) for shape, _ in groups))

    def load(self, ref, layout):
        """A float32 ref (GMEM or untiled SMEM) into registers in ``layout``."""
        if self.compiled:
            return plgpu.load(ref, (), layout=layout, optimized=False)
        return ref[...]


class _Copies:
    """Single-buffered TMA copies of one chunk's inputs, one barrier each: ``fetch(n, names)``
    starts chunk n's, ``wait(names)`` waits for the last started."""

    def __init__(self, bars, table):
        self.bars, self.table = bars, table  # name -> (chunk n -> GMEM view, SMEM buffer)
        self.index = {name: i for i, name in enumerate(table)}

    def fetch(self, n, *names):
        for name in names or tuple(self.table):
            src, dst = self.table[name]
            plgpu.copy_gmem_to_smem(src(n), dst, self.bars.at[self.index[name]])

    def fetch_if(self, ok, n, *names):
        @pl.when(ok)
        def _():
            self.fetch(n, *names)

    def wait(self, *names):
        for name in names:
            plgpu.barrier_wait(self.bars.at[self.index[name]])


def _call(kernel, cfg: KdaConfig, out_shape, scratch, interpret):
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    return plgpu.kernel(kernel, out_type=tuple(out_shape), grid=(cfg.B * cfg.HV, cfg.V // BV),
                        grid_names=("bh", "vt"), scratch_types=tuple(scratch),
                        compiler_params=params, interpret=interpret)


def state_fwd(cfg: KdaConfig, W, U, QG, Kg, Aqk, gam, h0t, *, out_dtype, residuals: bool,
              interpret=None):
    """``kda_calls.state_fwd`` on Mosaic GPU (same arguments and outputs; ``unsupported_reason``
    must be None). ``interpret``: Mosaic GPU interpret params (CPU), None compiles for sm_90."""
    assert unsupported_reason(cfg, out_dtype) is None
    B, HV, C, K, N = cfg.B, cfg.HV, cfg.C, cfg.K, cfg.N
    BHV, Tp = B * HV, N * C
    ops = _Ops(compiled=interpret is None)
    WG = plgpu.Layout.WGMMA
    out_shape = [jax.ShapeDtypeStruct((B, Tp, HV, cfg.V), bf16),
                 jax.ShapeDtypeStruct((BHV, cfg.V, K), f32)]
    if residuals:
        out_shape += [jax.ShapeDtypeStruct((BHV, N, cfg.V, K), bf16),
                      jax.ShapeDtypeStruct((BHV, N, C, cfg.V), bf16)]

    def kernel(W_g, U_g, QG_g, Kg_g, A_g, gam_g, h0_g, o_g, ST_g, *refs):
        res_g, refs = refs[:2 * residuals], refs[2 * residuals:]
        W_s, U_s, QG_s, Kg_s, A_s, gam_s, St_s, Vp_s, o_s, bars, *tbufs = refs
        StT_s, VpT_s = tbufs if tbufs else (None, None)
        bh, vt = lax.axis_index("bh"), lax.axis_index("vt")
        b, hv = lax.div(bh, jnp.int32(HV)), lax.rem(bh, jnp.int32(HV))
        vcols = pl.ds(vt * BV, BV)
        io = _Copies(bars, {
            "W": (lambda n: W_g.at[bh, n], W_s), "U": (lambda n: U_g.at[bh, n, :, vcols], U_s),
            "QG": (lambda n: QG_g.at[bh, n], QG_s), "A": (lambda n: A_g.at[bh, n], A_s),
            "Kg": (lambda n: Kg_g.at[bh, n], Kg_s), "gam": (lambda n: gam_g.at[bh, n], gam_s)})
        io.fetch(0)

        def step(n, St):
            more = n + 1 < N
            # the previous chunk's stores have read St_s, V'_s and o_s
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            St_s[...] = St.astype(bf16)
            plgpu.commit_smem()
            if residuals:
                plgpu.copy_smem_to_gmem(St_s, res_g[0].at[bh, n, vcols])
            St_t = ops.tview(St_s, StT_s)
            io.wait("W", "U")
            (WSt,) = ops.dots(((C, BV), [(W_s, St_t)]))
            io.fetch_if(more, n + 1, "W")
            Vp = U_s[...].astype(f32) - WSt
            Vp_s[...] = Vp.astype(bf16)
            plgpu.commit_smem()
            io.fetch_if(more, n + 1, "U")
            if residuals:
                plgpu.copy_smem_to_gmem(Vp_s, res_g[1].at[bh, n, :, vcols])
            io.wait("QG", "A", "Kg", "gam")
            St = St * lax.broadcast_in_dim(ops.load(gam_s.at[0], WG.reduce(0)), (BV, K), [1])
            O, update = ops.dots(((C, BV), [(QG_s, St_t), (A_s, Vp_s)]),
                                 ((BV, K), [(ops.tview(Vp_s, VpT_s), Kg_s)]))
            io.fetch_if(more, n + 1, "QG", "A", "Kg", "gam")
            o_s[...] = O.astype(bf16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_g.at[b, pl.ds(n * C, C), hv, vcols])
            return St + update

        ST_g.at[bh, vcols][...] = lax.fori_loop(0, N, step, ops.load(h0_g.at[bh, vcols], WG))
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        _swizzled((C, K), bf16),  # W
        _swizzled((C, BV), bf16),  # U
        _swizzled((C, K), bf16),  # QG
        _swizzled((C, K), bf16),  # Kg
        _swizzled((C, C), bf16),  # Aqk
        plgpu.SMEM((1, K), f32),  # gam
        _swizzled((BV, K), bf16),  # St entering the chunk (bf16), h's staging
        _swizzled((C, BV), bf16),  # V', its staging
        _swizzled((C, BV), bf16),  # O's staging
        plgpu.Barrier(num_barriers=6),  # one per input copy
    ]
    if interpret is not None:  # explicit transposes for the interpreter: St^T, V'^T
        scratch += [_swizzled((K, BV), bf16), _swizzled((BV, C), bf16)]
    return _call(kernel, cfg, out_shape, scratch, interpret)(W, U, QG, Kg, Aqk, gam, h0t)


def state_bwd(cfg: KdaConfig, dO, W, QG, Kg, Aqk, gam, dSTt, *, interpret=None):
    """``kda_calls.state_bwd`` on Mosaic GPU (same arguments and outputs; ``unsupported_reason``
    must be None; dO bf16). The chunks are walked last to first."""
    assert unsupported_reason(cfg) is None and dO.dtype == bf16
    B, HV, C, K, N = cfg.B, cfg.HV, cfg.C, cfg.K, cfg.N
    BHV = B * HV
    ops = _Ops(compiled=interpret is None)
    WG = plgpu.Layout.WGMMA
    out_shape = [jax.ShapeDtypeStruct((BHV, N, cfg.V, K), bf16),
                 jax.ShapeDtypeStruct((BHV, N, C, cfg.V), bf16),
                 jax.ShapeDtypeStruct((BHV, cfg.V, K), f32)]

    def kernel(dO_g, W_g, QG_g, Kg_g, A_g, gam_g, dST_g, dh_g, dVp_g, dS0_g, *refs):
        dO_s, W_s, QG_s, Kg_s, A_s, gam_s, dSt_s, dVp_s, bars, *tbufs = refs
        AT_s, dStT_s, dOT_s, dVpT_s = tbufs if tbufs else (None,) * 4
        bh, vt = lax.axis_index("bh"), lax.axis_index("vt")
        b, hv = lax.div(bh, jnp.int32(HV)), lax.rem(bh, jnp.int32(HV))
        vcols = pl.ds(vt * BV, BV)
        io = _Copies(bars, {
            "dO": (lambda n: dO_g.at[b, pl.ds(n * C, C), hv, vcols], dO_s),
            "A": (lambda n: A_g.at[bh, n], A_s), "Kg": (lambda n: Kg_g.at[bh, n], Kg_s),
            "QG": (lambda n: QG_g.at[bh, n], QG_s), "W": (lambda n: W_g.at[bh, n], W_s),
            "gam": (lambda n: gam_g.at[bh, n], gam_s)})
        io.fetch(N - 1)

        def step(i, dSt):
            n = N - 1 - i
            more = n > 0
            # the previous chunk's stores have read dSt_s and dV'_s
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            dSt_s[...] = dSt.astype(bf16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dSt_s, dh_g.at[bh, n, vcols])
            io.wait("dO", "A", "Kg")
            (dVp,) = ops.dots(((C, BV), [(ops.tview(A_s, AT_s), dO_s),
                                         (Kg_s, ops.tview(dSt_s, dStT_s))]))
            io.fetch_if(more, n - 1, "A", "Kg")
            dVp_s[...] = dVp.astype(bf16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dVp_s, dVp_g.at[bh, n, :, vcols])
            io.wait("QG", "W", "gam")
            dSt = dSt * lax.broadcast_in_dim(ops.load(gam_s.at[0], WG.reduce(0)), (BV, K), [1])
            dOQG, dVpW = ops.dots(((BV, K), [(ops.tview(dO_s, dOT_s), QG_s)]),
                                  ((BV, K), [(ops.tview(dVp_s, dVpT_s), W_s)]))
            io.fetch_if(more, n - 1, "dO", "QG", "W", "gam")
            return dSt + dOQG - dVpW

        dS0_g.at[bh, vcols][...] = lax.fori_loop(0, N, step, ops.load(dST_g.at[bh, vcols], WG))
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        _swizzled((C, BV), bf16),  # dO
        _swizzled((C, K), bf16),  # W
        _swizzled((C, K), bf16),  # QG
        _swizzled((C, K), bf16),  # Kg
        _swizzled((C, C), bf16),  # Aqk
        plgpu.SMEM((1, K), f32),  # gam
        _swizzled((BV, K), bf16),  # dSt leaving the chunk (bf16), dh's staging
        _swizzled((C, BV), bf16),  # dV', its staging
        plgpu.Barrier(num_barriers=6),  # one per input copy
    ]
    if interpret is not None:  # explicit transposes for the interpreter: Aqk^T, dSt^T, dO^T, dV'^T
        scratch += [_swizzled((C, C), bf16), _swizzled((K, BV), bf16),
                    _swizzled((BV, C), bf16), _swizzled((BV, C), bf16)]
    return _call(kernel, cfg, out_shape, scratch, interpret)(dO, W, QG, Kg, Aqk, gam, dSTt)
