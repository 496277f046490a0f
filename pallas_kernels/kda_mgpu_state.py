"""KDA's state passes on Hopper (sm_90) in Pallas' Mosaic GPU backend: drop-ins for
``kda_calls.state_fwd`` and ``kda_calls.state_bwd`` (K, V = 128 or 64, C = 64, bf16
intermediates).

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

``KernelTuning.mgpu_state`` picks other forms, one CTA per SM with double-buffered inputs:
1, two warpgroups per 64 columns, the products that do not depend on the state on the second
(``_state_fwd_two_wg``, ``_state_bwd_two_wg``); 2, all of V in one CTA, each chunk's W, QG, Kg
and Aqk read once per value head (``_state_fwd_two_wg`` with 128 columns, ``_state_bwd_wide``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda_body import KdaConfig
from pallas_kernels.kda_mgpu import CHUNK, WHOLE_DIMS, _swizzled, plgpu

f32, bf16 = jnp.float32, jnp.bfloat16
BV = 64  # V columns per CTA (see the module docstring)
# KernelTuning.mgpu_state: the forms of the passes (see the module docstring); AUTO picks them
ONE_WG, SPLIT, WIDE, AUTO = 0, 1, 2, 3
HOPPER_SMS = 132  # SMs of the sm_90 SXM cards (H100, H200)


def forms(cfg: KdaConfig) -> tuple[int, int]:
    """(forward form, backward form) of the passes for ``cfg.mgpu_state``.

    AUTO: when 64-column CTAs of one per SM would take more than one wave
    (B*HV*V/64 > HOPPER_SMS), the passes are bound by memory and the wide forms, which read
    less, are the faster; otherwise the chain's latency is the time, and the forward takes the
    two-warpgroup form while the backward keeps one warpgroup (its two-warpgroup form is the
    slower there). benchmarks/kda_kernel.py --sweep with --variants "mgpu_state=0;..."
    measures the forms against each other."""
    if cfg.mgpu_state != AUTO:
        return cfg.mgpu_state, cfg.mgpu_state
    if cfg.B * cfg.HV * (cfg.V // BV) > HOPPER_SMS:  # 64-column CTAs
        return WIDE, WIDE
    return SPLIT, ONE_WG


def unsupported_reason(cfg: KdaConfig, out_dtype=bf16) -> str | None:
    """None when the passes here compute this call (``out_dtype``: the forward's O), else why
    not."""
    checks = [
        (plgpu is None, "no Mosaic GPU Pallas in this JAX"),
        (cfg.C != CHUNK, f"chunk {cfg.C} != {CHUNK}"),
        # at 64: one V tile and a [64, 64] state; the wide forms take the same 64 columns
        (cfg.K not in WHOLE_DIMS or cfg.V not in WHOLE_DIMS,
         f"K, V = {cfg.K}, {cfg.V} (want {WHOLE_DIMS})"),
        (cfg.cd != "bfloat16", f"compute dtype {cfg.cd}"),
        (jnp.dtype(out_dtype) != jnp.dtype(bf16), f"output dtype {jnp.dtype(out_dtype)}"),
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

    def dots_onto(self, acc, pairs):
        """acc + sum(a @ b for a, b in pairs), float32, accumulated onto acc itself: no second
        accumulator of acc's shape is live. (The interpreter cannot run an initialised
        accumulator: there the sum is added.)"""
        if not self.compiled:
            (total,) = self.dots((acc.shape, pairs))
            return acc + total

        def body(acc_ref):
            for a, b in pairs:
                plgpu.wgmma(acc_ref, a, b)
        return pl.run_state(body)(plgpu.ACC.init(acc))

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


def _fwd_out_shape(cfg: KdaConfig, residuals: bool):
    """O, final St and, with ``residuals``, h and V' (the module docstring's shapes)."""
    B, HV, C, K, V, N = cfg.B, cfg.HV, cfg.C, cfg.K, cfg.V, cfg.N
    out = [jax.ShapeDtypeStruct((B, N * C, HV, V), bf16),
           jax.ShapeDtypeStruct((B * HV, V, K), f32)]
    if residuals:
        out += [jax.ShapeDtypeStruct((B * HV, N, V, K), bf16),
                jax.ShapeDtypeStruct((B * HV, N, C, V), bf16)]
    return out


def _bwd_out_shape(cfg: KdaConfig):
    """dh, dV' and dS0t (the module docstring's shapes)."""
    BHV, C, K, V, N = cfg.B * cfg.HV, cfg.C, cfg.K, cfg.V, cfg.N
    return [jax.ShapeDtypeStruct((BHV, N, V, K), bf16), jax.ShapeDtypeStruct((BHV, N, C, V), bf16),
            jax.ShapeDtypeStruct((BHV, V, K), f32)]


def _prefetch(ok, fetch):
    """The double-buffered passes' step prologue: ``fetch()`` starts the next chunk's copies
    into the other slot when ``ok``. That slot was the previous chunk's: every product reading
    it has been waited, and the fence orders this warpgroup's accesses before the copies'
    writes."""
    plgpu.commit_smem()
    pl.when(ok)(fetch)


def _stage(x, x_s, dst=None):
    """x into the bf16 buffer x_s, fenced for the products that read it, and on to ``dst`` in
    memory by TMA if given (a residual), once the previous chunk's store has read x_s."""
    if dst is not None:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    x_s[...] = x.astype(bf16)
    plgpu.commit_smem()
    if dst is not None:
        plgpu.copy_smem_to_gmem(x_s, dst)


def _two_wg_indices(HV: int, bv: int):
    """(bh, b, hv, the V tile's columns, warpgroup) of a two-warpgroup pass's CTA, grid
    (B*HV, V / bv) with a warpgroup axis "wg"."""
    bh, vt, wg = lax.axis_index("bh"), lax.axis_index("vt"), lax.axis_index("wg")
    return bh, lax.div(bh, jnp.int32(HV)), lax.rem(bh, jnp.int32(HV)), pl.ds(vt * bv, bv), wg


def _finish_together(done):
    """Both warpgroups arrive at ``done`` and wait for each other: neither leaves while the
    other may still issue products into shared memory."""
    plgpu.barrier_arrive(done)
    plgpu.barrier_wait(done)


def _call(kernel, cfg: KdaConfig, out_shape, scratch, interpret, name: str):
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    return plgpu.kernel(kernel, out_type=tuple(out_shape), grid=(cfg.B * cfg.HV, cfg.V // BV),
                        kernel_name=name,
                        grid_names=("bh", "vt"), scratch_types=tuple(scratch),
                        compiler_params=params, interpret=interpret)


def state_fwd(cfg: KdaConfig, W, U, QG, Kg, Aqk, gam, h0t, *, out_dtype, residuals: bool,
              interpret=None):
    """``kda_calls.state_fwd`` on Mosaic GPU (same arguments and outputs; ``unsupported_reason``
    must be None). ``interpret``: Mosaic GPU interpret params (CPU), None compiles for sm_90.
    ``cfg.mgpu_state`` (KernelTuning) 1 and 2: ``_state_fwd_two_wg`` with 64 and 128 columns."""
    assert unsupported_reason(cfg, out_dtype) is None
    form = forms(cfg)[0]
    if form in (SPLIT, WIDE):
        return _state_fwd_two_wg(cfg, W, U, QG, Kg, Aqk, gam, h0t, residuals=residuals,
                                 bv=BV if form == SPLIT else cfg.V, interpret=interpret)
    HV, C, K, N = cfg.HV, cfg.C, cfg.K, cfg.N
    ops = _Ops(compiled=interpret is None)
    WG = plgpu.Layout.WGMMA
    out_shape = _fwd_out_shape(cfg, residuals)

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
    return _call(kernel, cfg, out_shape, scratch, interpret, "kda_state_fwd")(
        W, U, QG, Kg, Aqk, gam, h0t)


def _state_fwd_two_wg(cfg: KdaConfig, W, U, QG, Kg, Aqk, gam, h0t, *, residuals: bool, bv: int,
                      interpret=None):
    """``state_fwd`` with CTAs of two warpgroups over V tiles of ``bv`` columns, grid
    (B*HV, V / bv), every input double-buffered (the next chunk's copies start when the step
    begins).

    Warpgroup 0 walks the chain, the transposed state St [bv, K] float32 in its registers:
    V' = U - W St^T, then St <- St Diag(gam) + V'^T Kg accumulated onto St itself (at bv = 128
    a second [bv, K] accumulator would not fit in the registers). It publishes the bf16 state
    entering each chunk and the chunk's V' in shared memory (barrier ``ready``), and warpgroup
    1 computes O = QG St^T + Aqk V' from them while warpgroup 0 goes on with the state: the
    output's products, 3/7 of a chunk's multiply-adds at K = 2C, leave the chain. Warpgroup 0
    overwrites them for the next chunk only after warpgroup 1 has waited its products
    (barrier ``free``).

    One CTA per SM either way (~160 KB of shared memory at bv = 64, ~210 KB at 128). bv = 64
    (``KernelTuning.mgpu_state`` = 1) shortens each step of the chain, which is the time when
    there are few chains (long rows, few of them). bv = 128 (= 2) reads each chunk's W, Kg and
    QG once per value head instead of twice, which counts when many chains make the pass
    bound by memory.
    """
    B, HV, C, K, V, N = cfg.B, cfg.HV, cfg.C, cfg.K, cfg.V, cfg.N
    BHV = B * HV
    ops = _Ops(compiled=interpret is None)
    WG = plgpu.Layout.WGMMA
    out_shape = _fwd_out_shape(cfg, residuals)

    def kernel(W_g, U_g, QG_g, Kg_g, A_g, gam_g, h0_g, o_g, ST_g, *refs):
        res_g, refs = refs[:2 * residuals], refs[2 * residuals:]
        (W_s, U_s, Kg_s, gam_s, QG_s, A_s, St_s, Vp_s, o_s, chain_in, out_in, ready, free,
         done, *tbufs) = refs
        StT_0, VpT_s, StT_1 = tbufs if tbufs else (None,) * 3
        bh, b, hv, vcols, wg = _two_wg_indices(HV, bv)

        @pl.when(wg == 0)
        def _chain():
            def fetch(n, slot):
                for src, dst in ((W_g.at[bh, n], W_s), (U_g.at[bh, n, :, vcols], U_s),
                                 (Kg_g.at[bh, n], Kg_s), (gam_g.at[bh, n], gam_s)):
                    plgpu.copy_gmem_to_smem(src, dst.at[slot], chain_in.at[slot])

            fetch(0, 0)

            def step(n, St):
                slot = lax.rem(n, 2)
                _prefetch(n + 1 < N, lambda: fetch(n + 1, 1 - slot))

                @pl.when(n > 0)
                def _():
                    plgpu.barrier_wait(free)  # warpgroup 1 has waited its products of chunk n-1

                _stage(St, St_s, res_g[0].at[bh, n, vcols] if residuals else None)
                plgpu.barrier_wait(chain_in.at[slot])
                (WSt,) = ops.dots(((C, bv), [(W_s.at[slot], ops.tview(St_s, StT_0))]))
                # _stage's wait covered the previous chunk's V' store too
                Vp_s[...] = (U_s.at[slot][...].astype(f32) - WSt).astype(bf16)
                plgpu.commit_smem()
                if residuals:
                    plgpu.copy_smem_to_gmem(Vp_s, res_g[1].at[bh, n, :, vcols])
                plgpu.barrier_arrive(ready)
                St = St * lax.broadcast_in_dim(ops.load(gam_s.at[slot, 0], WG.reduce(0)),
                                               (bv, K), [1])
                return ops.dots_onto(St, [(ops.tview(Vp_s, VpT_s), Kg_s.at[slot])])

            ST_g.at[bh, vcols][...] = lax.fori_loop(0, N, step, ops.load(h0_g.at[bh, vcols], WG))
            plgpu.barrier_wait(free)  # warpgroup 1's last arrival
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _output():
            def fetch(n, slot):
                for src, dst in ((QG_g, QG_s), (A_g, A_s)):
                    plgpu.copy_gmem_to_smem(src.at[bh, n], dst.at[slot], out_in.at[slot])

            fetch(0, 0)

            def step(n, carry):
                slot = lax.rem(n, 2)

                @pl.when(n + 1 < N)
                def _():
                    fetch(n + 1, 1 - slot)

                plgpu.barrier_wait(out_in.at[slot])
                plgpu.barrier_wait(ready)
                (O,) = ops.dots(((C, bv), [(QG_s.at[slot], ops.tview(St_s, StT_1)),
                                          (A_s.at[slot], Vp_s)]))
                plgpu.barrier_arrive(free)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last store has read o_s
                o_s[...] = O.astype(bf16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_s, o_g.at[b, pl.ds(n * C, C), hv, vcols])
                return carry

            lax.fori_loop(0, N, step, 0)
            plgpu.wait_smem_to_gmem(0)

        _finish_together(done)

    scratch = [
        _swizzled((2, C, K), bf16),  # W, two chunks
        _swizzled((2, C, bv), bf16),  # U
        _swizzled((2, C, K), bf16),  # Kg
        plgpu.SMEM((2, 1, K), f32),  # gam
        _swizzled((2, C, K), bf16),  # QG
        _swizzled((2, C, C), bf16),  # Aqk
        _swizzled((bv, K), bf16),  # St entering the chunk (bf16): both warpgroups' operand
        _swizzled((C, bv), bf16),  # V': both warpgroups' operand, its staging
        _swizzled((C, bv), bf16),  # O's staging
        plgpu.Barrier(num_arrivals=4, num_barriers=2),  # warpgroup 0's copies, per slot
        plgpu.Barrier(num_arrivals=2, num_barriers=2),  # warpgroup 1's
        plgpu.Barrier(),  # ready: St_s and V'_s hold chunk n
        plgpu.Barrier(),  # free: warpgroup 1 is done with them
        plgpu.Barrier(num_arrivals=2),  # done: both warpgroups
    ]
    if interpret is not None:  # explicit transposes, one set per warpgroup: St^T, V'^T; St^T
        scratch += [_swizzled((K, bv), bf16), _swizzled((bv, C), bf16), _swizzled((K, bv), bf16)]
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    return plgpu.kernel(kernel, out_type=tuple(out_shape), grid=(BHV, V // bv),
                        kernel_name=f"kda_state_fwd_two_wg_{bv}",
                        grid_names=("bh", "vt"), num_threads=2, thread_name="wg",
                        scratch_types=tuple(scratch), compiler_params=params,
                        interpret=interpret)(W, U, QG, Kg, Aqk, gam, h0t)


def state_bwd(cfg: KdaConfig, dO, W, QG, Kg, Aqk, gam, dSTt, *, interpret=None):
    """``kda_calls.state_bwd`` on Mosaic GPU (same arguments and outputs; ``unsupported_reason``
    must be None; dO bf16). The chunks are walked last to first. ``cfg.mgpu_state``
    (KernelTuning) 1: ``_state_bwd_two_wg``, 2: ``_state_bwd_wide``."""
    assert unsupported_reason(cfg) is None and dO.dtype == bf16
    form = forms(cfg)[1]
    if form == SPLIT:
        return _state_bwd_two_wg(cfg, dO, W, QG, Kg, Aqk, gam, dSTt, interpret=interpret)
    if form == WIDE:
        return _state_bwd_wide(cfg, dO, W, QG, Kg, Aqk, gam, dSTt, interpret=interpret)
    HV, C, K, N = cfg.HV, cfg.C, cfg.K, cfg.N
    ops = _Ops(compiled=interpret is None)
    WG = plgpu.Layout.WGMMA
    out_shape = _bwd_out_shape(cfg)

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
    return _call(kernel, cfg, out_shape, scratch, interpret, "kda_state_bwd")(
        dO, W, QG, Kg, Aqk, gam, dSTt)


def _state_bwd_wide(cfg: KdaConfig, dO, W, QG, Kg, Aqk, gam, dSTt, *, interpret=None):
    """``state_bwd`` with all V = 128 columns in one CTA of one warpgroup, grid (B*HV,): each
    chunk's W, QG, Kg and Aqk are read once per value head instead of twice, and every input is
    double-buffered (the next chunk's copies start when the step begins). Per chunk:

        dV'  = Aqk^T dO + Kg dSt^T                   [C, V] accumulator
        dSt <- dSt Diag(gam) + dO^T QG + (-dV')^T W   accumulated onto dSt itself

    (a second [V, K] float32 accumulator would not fit beside dSt in the registers; -dV' is
    rounded to bf16 exactly as dV' is). ~210 KB of shared memory: one CTA per SM.
    """
    B, HV, C, K, V, N = cfg.B, cfg.HV, cfg.C, cfg.K, cfg.V, cfg.N
    BHV = B * HV
    ops = _Ops(compiled=interpret is None)
    WG = plgpu.Layout.WGMMA
    out_shape = _bwd_out_shape(cfg)

    def kernel(dO_g, W_g, QG_g, Kg_g, A_g, gam_g, dST_g, dh_g, dVp_g, dS0_g, *refs):
        dO_s, W_s, QG_s, Kg_s, A_s, gam_s, dSt_s, dVp_s, ndVp_s, bars, *tbufs = refs
        AT_s, dStT_s, dOT_s, ndVpT_s = tbufs if tbufs else (None,) * 4
        bh = lax.axis_index("bh")
        b, hv = lax.div(bh, jnp.int32(HV)), lax.rem(bh, jnp.int32(HV))
        inputs = ((lambda n: dO_g.at[b, pl.ds(n * C, C), hv], dO_s),
                  *((lambda n, g=g: g.at[bh, n], s) for g, s in (
                      (W_g, W_s), (QG_g, QG_s), (Kg_g, Kg_s), (A_g, A_s), (gam_g, gam_s))))

        def fetch(n, slot):
            for src, dst in inputs:
                plgpu.copy_gmem_to_smem(src(n), dst.at[slot], bars.at[slot])

        fetch(N - 1, 0)

        def step(i, dSt):
            n, slot = N - 1 - i, lax.rem(i, 2)
            _prefetch(n > 0, lambda: fetch(n - 1, 1 - slot))
            _stage(dSt, dSt_s, dh_g.at[bh, n])  # and the previous chunk's dV' store is done
            plgpu.barrier_wait(bars.at[slot])
            (dVp,) = ops.dots(((C, V), [(ops.tview(A_s.at[slot], AT_s), dO_s.at[slot]),
                                        (Kg_s.at[slot], ops.tview(dSt_s, dStT_s))]))
            dVp_s[...] = dVp.astype(bf16)
            ndVp_s[...] = (-dVp).astype(bf16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dVp_s, dVp_g.at[bh, n])
            dSt = dSt * lax.broadcast_in_dim(ops.load(gam_s.at[slot, 0], WG.reduce(0)),
                                             (V, K), [1])
            return ops.dots_onto(dSt, [(ops.tview(dO_s.at[slot], dOT_s), QG_s.at[slot]),
                                       (ops.tview(ndVp_s, ndVpT_s), W_s.at[slot])])

        dS0_g.at[bh][...] = lax.fori_loop(0, N, step, ops.load(dST_g.at[bh], WG))
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        _swizzled((2, C, V), bf16),  # dO, two chunks
        _swizzled((2, C, K), bf16),  # W
        _swizzled((2, C, K), bf16),  # QG
        _swizzled((2, C, K), bf16),  # Kg
        _swizzled((2, C, C), bf16),  # Aqk
        plgpu.SMEM((2, 1, K), f32),  # gam
        _swizzled((V, K), bf16),  # dSt leaving the chunk (bf16), dh's staging
        _swizzled((C, V), bf16),  # dV', its staging
        _swizzled((C, V), bf16),  # -dV', the operand
        plgpu.Barrier(num_arrivals=len(("dO", "W", "QG", "Kg", "A", "gam")), num_barriers=2),
    ]
    if interpret is not None:  # explicit transposes for the interpreter: Aqk^T, dSt^T, dO^T, -dV'^T
        scratch += [_swizzled((C, C), bf16), _swizzled((K, V), bf16),
                    _swizzled((V, C), bf16), _swizzled((V, C), bf16)]
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    return plgpu.kernel(kernel, out_type=tuple(out_shape), grid=(BHV,), grid_names=("bh",),
                        kernel_name="kda_state_bwd_wide",
                        scratch_types=tuple(scratch), compiler_params=params,
                        interpret=interpret)(dO, W, QG, Kg, Aqk, gam, dSTt)


def _state_bwd_two_wg(cfg: KdaConfig, dO, W, QG, Kg, Aqk, gam, dSTt, *, interpret=None):
    """``state_bwd`` with CTAs of two warpgroups over V tiles of 64 columns, grid (B*HV, V / BV),
    every input double-buffered. Warpgroup 1 computes each chunk's products that do not depend
    on the state gradient, X = Aqk^T dO [C, BV] and Y = dO^T QG [BV, K], a chunk ahead, and
    hands them over in float32 shared memory (barriers ``xy_ready``, ``xy_free``). Warpgroup 0
    walks the chain with one product left on each side of it:

        dV'  = X + Kg dSt^T
        dSt <- dSt Diag(gam) + Y + (-dV')^T W        accumulated onto dSt itself

    where the one-warpgroup pass issues two (3/7 of a chunk's multiply-adds leave the chain).
    ~210 KB of shared memory: one CTA per SM (``KernelTuning.mgpu_state`` = 1, for few chains,
    where a step of the chain is the time).
    """
    B, HV, C, K, V, N = cfg.B, cfg.HV, cfg.C, cfg.K, cfg.V, cfg.N
    BHV = B * HV
    ops = _Ops(compiled=interpret is None)
    WG = plgpu.Layout.WGMMA
    out_shape = _bwd_out_shape(cfg)

    def kernel(dO_g, W_g, QG_g, Kg_g, A_g, gam_g, dST_g, dh_g, dVp_g, dS0_g, *refs):
        (W_s, Kg_s, gam_s, dO_s, A_s, QG_s, X_s, Y_s, dSt_s, dVp_s, ndVp_s, chain_in, xy_in,
         xy_ready, xy_free, done, *tbufs) = refs
        dStT_s, ndVpT_s, AT_s, dOT_s = tbufs if tbufs else (None,) * 4
        bh, b, hv, vcols, wg = _two_wg_indices(HV, BV)

        @pl.when(wg == 0)
        def _chain():
            def fetch(n, slot):
                for src, dst in ((W_g, W_s), (Kg_g, Kg_s), (gam_g, gam_s)):
                    plgpu.copy_gmem_to_smem(src.at[bh, n], dst.at[slot], chain_in.at[slot])

            fetch(N - 1, 0)

            def step(i, dSt):
                n, slot = N - 1 - i, lax.rem(i, 2)
                _prefetch(n > 0, lambda: fetch(n - 1, 1 - slot))
                _stage(dSt, dSt_s, dh_g.at[bh, n, vcols])  # and the last dV' store is done
                plgpu.barrier_wait(chain_in.at[slot])
                plgpu.barrier_wait(xy_ready)
                dVp = ops.dots_onto(ops.load(X_s, WG),
                                    [(Kg_s.at[slot], ops.tview(dSt_s, dStT_s))])
                dVp_s[...] = dVp.astype(bf16)
                ndVp_s[...] = (-dVp).astype(bf16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(dVp_s, dVp_g.at[bh, n, :, vcols])
                decay = lax.broadcast_in_dim(ops.load(gam_s.at[slot, 0], WG.reduce(0)),
                                             (BV, K), [1])
                dSt = dSt * decay + ops.load(Y_s, WG)
                plgpu.barrier_arrive(xy_free)  # X and Y are in registers
                return ops.dots_onto(dSt, [(ops.tview(ndVp_s, ndVpT_s), W_s.at[slot])])

            dS0_g.at[bh, vcols][...] = lax.fori_loop(0, N, step,
                                                     ops.load(dST_g.at[bh, vcols], WG))
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _products():
            def fetch(n, slot):
                for src, dst in ((dO_g.at[b, pl.ds(n * C, C), hv, vcols], dO_s),
                                 (A_g.at[bh, n], A_s), (QG_g.at[bh, n], QG_s)):
                    plgpu.copy_gmem_to_smem(src, dst.at[slot], xy_in.at[slot])

            fetch(N - 1, 0)

            def step(i, carry):
                n, slot = N - 1 - i, lax.rem(i, 2)

                @pl.when(n > 0)
                def _():
                    fetch(n - 1, 1 - slot)

                plgpu.barrier_wait(xy_in.at[slot])
                X, Y = ops.dots(((C, BV), [(ops.tview(A_s.at[slot], AT_s), dO_s.at[slot])]),
                                ((BV, K), [(ops.tview(dO_s.at[slot], dOT_s), QG_s.at[slot])]))

                @pl.when(i > 0)
                def _():
                    plgpu.barrier_wait(xy_free)  # warpgroup 0 has read chunk n+1's

                X_s[...] = X
                Y_s[...] = Y
                plgpu.barrier_arrive(xy_ready)
                return carry

            lax.fori_loop(0, N, step, 0)
            plgpu.barrier_wait(xy_free)  # warpgroup 0's last reading

        _finish_together(done)

    scratch = [
        _swizzled((2, C, K), bf16),  # W, two chunks
        _swizzled((2, C, K), bf16),  # Kg
        plgpu.SMEM((2, 1, K), f32),  # gam
        _swizzled((2, C, BV), bf16),  # dO
        _swizzled((2, C, C), bf16),  # Aqk
        _swizzled((2, C, K), bf16),  # QG
        plgpu.SMEM((C, BV), f32),  # X = Aqk^T dO
        plgpu.SMEM((BV, K), f32),  # Y = dO^T QG
        _swizzled((BV, K), bf16),  # dSt leaving the chunk (bf16), dh's staging
        _swizzled((C, BV), bf16),  # dV', its staging
        _swizzled((C, BV), bf16),  # -dV', the operand
        plgpu.Barrier(num_arrivals=3, num_barriers=2),  # warpgroup 0's copies, per slot
        plgpu.Barrier(num_arrivals=3, num_barriers=2),  # warpgroup 1's
        plgpu.Barrier(),  # xy_ready: X_s and Y_s hold chunk n
        plgpu.Barrier(),  # xy_free: warpgroup 0 has read them
        plgpu.Barrier(num_arrivals=2),  # done: both warpgroups
    ]
    if interpret is not None:  # explicit transposes, per warpgroup: dSt^T, -dV'^T; Aqk^T, dO^T
        scratch += [_swizzled((K, BV), bf16), _swizzled((BV, C), bf16),
                    _swizzled((C, C), bf16), _swizzled((BV, C), bf16)]
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    return plgpu.kernel(kernel, out_type=tuple(out_shape), grid=(BHV, V // BV),
                        kernel_name="kda_state_bwd_two_wg",
                        grid_names=("bh", "vt"), num_threads=2, thread_name="wg",
                        scratch_types=tuple(scratch), compiler_params=params,
                        interpret=interpret)(dO, W, QG, Kg, Aqk, gam, dSTt)
